"""Speculative-decoding drafters (proposers)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
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
    """Target decoder layers whose outputs it needs (EAGLE-3), when that choice does not depend on the model.

    Index ``i`` is the output of decoder layer ``i``: transformers'
    ``output_hidden_states[i + 1]``, except that the last layer's output is
    taken before the final norm.  Negative indices count from the last
    layer, as in Python, so ``(-3, -2)`` fits a model of any depth.  This is
    only the default of :meth:`Drafter.aux_hidden_state_layers`, which the
    runner asks after :meth:`Drafter.load`: a drafter whose layers depend on
    the target (low, middle and high layers) or on its trained weights
    leaves it empty and overrides that method."""
    needs_attention_metadata: bool = False
    """Runs its own attention over the paged cache (EAGLE)."""
    reads_vocabulary_weights: bool = False
    """Copies the target's vocabulary-sized weights (its LM head or embedding rows: EAGLE, Medusa).  With
    tensor-parallel ranks the runner then keeps the vocabulary whole on every rank instead of sharding it
    (``runtime.tensor_parallel_size``): the drafter sees the weights a single process has."""
    produces_draft_probs: bool = False
    """Returns probabilities with its drafts.  Not used yet: the runner passes ``draft_probs=None`` to the
    rejection sampler, which verifies every draft as if proposed with probability 1 -- exact for
    deterministic drafters (n-gram, greedy EAGLE), not for drafters that sample their drafts."""
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
class DraftStep:
    """The target's whole step, for drafters that run their own layers over it (EAGLE).

    Rows follow the step's flattened tokens (request after request, as the
    target ran them), including draft tokens that were verified and rejected:
    request ``i``'s last ``num_rejected[i]`` rows are such rejects and must be
    ignored.
    """

    token_ids: torch.Tensor
    """int64 ``[num_tokens]``: the tokens the target ran."""
    positions: torch.Tensor
    """int64 ``[num_tokens]``."""
    hidden_states: torch.Tensor
    """``[num_tokens, hidden]``: the target's final hidden states (before the lm head)."""
    query_start_loc: np.ndarray
    """int32 ``[num_reqs + 1]``."""
    num_rejected: np.ndarray
    """int32 ``[num_reqs]``."""
    attention_metadata: Any
    """The step's :class:`~patchbay.interfaces.CommonAttentionMetadata` (first KV-cache group)."""
    aux_hidden_states: list[torch.Tensor] | None = None
    """``[num_tokens, hidden]`` outputs of each layer :meth:`Drafter.aux_hidden_state_layers` names, in its order;
    ``None`` when it names none."""


@dataclass
class DraftBatch:
    """The requests of a step, in the order the target ran them, to draft for.

    Every request of the step is here (so the batch lines up with
    :class:`DraftStep`); those that must not draft, partial prefills
    included, are listed in ``skip`` and must get an empty list.

    ``token_ids[i]`` holds all of request ``i``'s tokens so far (prompt,
    then output, including the tokens accepted this step).  Fields a drafter
    did not declare a need for are ``None``.
    """

    req_ids: list[str]
    token_ids: list[np.ndarray]
    num_speculative_tokens: int
    max_model_len: int
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """The tokens each request gained this step (accepted drafts, then the recovered or bonus token)."""
    hidden_states: torch.Tensor | None = None
    """``[num_reqs, hidden]``: the target's final hidden state that produced each request's last token."""
    step: DraftStep | None = None
    """The target's whole step, for drafters declaring ``needs_attention_metadata``."""
    skip: set[int] = field(default_factory=set)
    """Batch indices that must not draft (finished, near ``max_model_len``, unsupported sampling)."""


@dataclass
class DrafterContext:
    """What a drafter may use of the run, given once to :meth:`Drafter.load`."""

    model: Any
    """The target transformers model (``get_input_embeddings()``, ``get_output_embeddings()``, its config).

    With ``runtime.tensor_parallel_size`` above 1 the embedding and LM head weights hold this rank's rows of the
    vocabulary only (their ``vocab_shard`` attribute says which); calling the modules, which every rank does in
    step, still gives whole-vocabulary embeddings and logits."""
    attention_backend: Any
    """The run's :class:`~patchbay.interfaces.AttentionBackend`: a drafter with its own attention layers makes
    their implementations (and sizes their caches with ``kv_cache_shape``) through it."""
    metadata_builder: Any
    """The run's metadata builder for the first KV-cache group (build the drafter's per-step metadata with it)."""
    block_size: int
    num_blocks: int
    """Blocks in the target's KV pool; a drafter cache of the same size can reuse the target's block tables."""
    device: Any
    dtype: Any
    """The run's torch dtype."""


@dataclass
class DraftProposals:
    """A drafter's answer: per request, a (possibly empty) list of draft token ids."""

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None
    """``[total_draft_tokens, vocab]`` when the drafter produces probabilities (not passed on yet; see
    :attr:`DrafterCapabilities.produces_draft_probs`)."""


class Drafter(Plugin):
    """Proposes draft tokens that the target model verifies in the next step."""

    kind: ClassVar[str] = "drafter"
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities()

    def __init__(self, options: BaseModel | None = None, *, config: DrafterConfig | None = None) -> None:
        """Create the drafter with its validated ``options`` and the run's :class:`DrafterConfig`."""
        self.options = options if options is not None else self.Options()
        self.config = config if config is not None else DrafterConfig()

    def load(self, context: DrafterContext) -> None:
        """Load weights, share modules with the target (embeddings, lm head), allocate caches. Default: nothing.

        Called once before the first step.  On the engine's own rank it runs
        before the KV pool is sized, with ``context.num_blocks`` 1, so that
        the pool's sizing counts the drafter's weights; the pool's real size
        then comes through :meth:`resize_kv_cache`.
        """

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes the loaded drafter's own KV cache takes per block of the target's pool (default: 0, none).

        The engine counts them, times the pool's blocks, when it sizes the
        pool (``cache.memory: auto``) and checks that the run fits in memory.
        """
        return 0

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Make the drafter's own KV cache cover ``num_blocks`` blocks of the target's pool, as if :meth:`load`
        had been given them (default: nothing).  Called after :meth:`load`, before the first step."""

    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The target decoder layers whose outputs this loaded drafter needs, each step (default: the capability's).

        The runner asks once, after :meth:`load`, and fills
        :attr:`DraftStep.aux_hidden_states` with those layers' outputs, in
        this order, captured during the target's own forward pass (no second
        pass; nothing is captured when the answer is empty).  Indices follow
        :attr:`DrafterCapabilities.needs_aux_hidden_states`: ``i`` is layer
        ``i``'s output, negative ones count from the last layer.  An index
        outside the model's layers stops the run with an error naming the
        drafter.

        Why a method and not only the class-level capability: which layers
        to read depends on the target's depth (EAGLE-3 reads a low, a middle
        and a high layer, e.g. ``(2, L // 2, L - 3)`` of ``L``) and, once
        trained, on the layers the weights were trained on; both are known
        only once :meth:`load` has seen the model and the weights.
        """
        return tuple(self.capabilities.needs_aux_hidden_states)

    @abstractmethod
    def propose(self, batch: DraftBatch) -> DraftProposals:
        """Propose up to ``batch.num_speculative_tokens`` tokens for each request.

        Each list must hold valid token ids (``0 <= id < vocab_size``), be
        empty for indices in ``batch.skip``, and never make a request longer
        than ``batch.max_model_len``.  The same inputs give the same drafts.
        """


def resolve_aux_layers(layers: Sequence[int], num_layers: int, *, drafter: str) -> tuple[int, ...]:
    """``layers`` (from :meth:`Drafter.aux_hidden_state_layers`) as indices in ``[0, num_layers)``.

    Negative indices count from the end; one outside the model raises
    ``ValueError`` naming ``drafter``.
    """
    outside = [index for index in layers if not -num_layers <= index < num_layers]
    if outside:
        raise ValueError(
            f"drafter {drafter!r} asks for the outputs of target layers {tuple(layers)}, but the model has "
            f"{num_layers} decoder layers (valid indices: 0..{num_layers - 1}, or -{num_layers}..-1 from the end); "
            f"{outside} are outside it"
        )
    return tuple(index % num_layers for index in layers)
