"""Speculative-decoding drafters (proposers)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import numpy as np
    import torch
    from pydantic import BaseModel


@dataclass(frozen=True)
class DrafterConfig(ServingConfig):
    """What a run asks of its drafter."""

    num_speculative_tokens: int = 3
    max_model_len: int = 2048
    vocab_size: int = 32000


@dataclass(frozen=True)
class DrafterCapabilities(Capabilities):
    """What a drafter needs from the runner and what it can serve."""

    needs_hidden_states: bool = False
    """Needs the target's last hidden states at the sampled positions (Medusa)."""
    needs_aux_hidden_states: tuple[int, ...] = ()
    """Target layer indices whose hidden states it needs (EAGLE-3)."""
    needs_attention_metadata: bool = False
    """Runs its own attention over the paged cache (EAGLE)."""
    produces_draft_probs: bool = False
    """Returns probabilities with its drafts (enables exact verification of random rows)."""
    max_num_speculative_tokens: int | None = None

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if not isinstance(config, DrafterConfig):
            return found
        if config.num_speculative_tokens < 1:
            found.append(f"num_speculative_tokens must be >= 1 (got {config.num_speculative_tokens})")
        limit = self.max_num_speculative_tokens
        if limit is not None and config.num_speculative_tokens > limit:
            found.append(f"at most {limit} speculative tokens (asked for {config.num_speculative_tokens})")
        return found


@dataclass
class DraftBatch:
    """The requests to draft for after a step, in persistent-batch order.

    ``token_ids[i]`` holds all of request ``i``'s tokens so far (prompt,
    then output, including the token sampled this step).  Fields a drafter
    did not declare a need for are ``None``.
    """

    req_ids: list[str]
    token_ids: list[np.ndarray]
    num_speculative_tokens: int
    max_model_len: int
    hidden_states: torch.Tensor | None = None
    """``[num_reqs, hidden]``: the target's last hidden state behind each sampled token."""
    aux_hidden_states: list[torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    attention_metadata: Any = None
    skip: set[int] = field(default_factory=set)
    """Batch indices that must not draft (finished, near ``max_model_len``, unsupported sampling)."""


@dataclass
class DraftProposals:
    """A drafter's answer: per request, a (possibly empty) list of draft token ids."""

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None
    """``[total_draft_tokens, vocab]`` when the drafter produces probabilities."""


class Drafter(Plugin):
    """Proposes draft tokens that the target model verifies in the next step."""

    kind: ClassVar[str] = "drafter"
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities()

    def __init__(self, options: BaseModel | None = None, *, config: DrafterConfig | None = None) -> None:
        """Create the drafter with its validated ``options`` and the run's :class:`DrafterConfig`."""
        self.options = options if options is not None else self.Options()
        self.config = config if config is not None else DrafterConfig()

    def load(self, target_model: Any) -> None:
        """Load weights or share modules with the target (embeddings, lm head). Default: nothing."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> DraftProposals:
        """Propose up to ``batch.num_speculative_tokens`` tokens for each request.

        Each list must hold valid token ids (``0 <= id < vocab_size``), be
        empty for indices in ``batch.skip``, and never make a request longer
        than ``batch.max_model_len``.  The same inputs give the same drafts.
        """
