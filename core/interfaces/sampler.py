"""Samplers (logits to tokens) and rejection samplers (verification of draft tokens)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

SAMPLING_PARAMS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "min_tokens",
        "bad_words",
        "allowed_token_ids",
        "seed",
        "logprobs",
        "prompt_logprobs",
    }
)
"""Every per-request sampling parameter a sampler may be asked to honour."""


@dataclass(frozen=True)
class SamplerConfig(ServingConfig):
    """What a run needs from its sampler."""

    role: Literal["sample", "verify"] = "sample"
    """``sample`` for the main sampler, ``verify`` for speculative decoding's rejection sampler."""
    params_used: frozenset[str] = frozenset()
    """Sampling parameters the run's requests set (subset of :data:`SAMPLING_PARAMS`)."""
    random_sampling: bool = False
    """Whether any request samples with temperature > 0."""


@dataclass(frozen=True)
class SamplerCapabilities(Capabilities):
    """What a sampler can serve."""

    role: Literal["sample", "verify"] = "sample"
    supported_params: frozenset[str] = SAMPLING_PARAMS
    supports_random: bool = True
    """``False`` for greedy-only samplers."""
    logprobs_mode: Literal["raw", "processed"] = "raw"
    """Whether returned logprobs are of the raw model logits or after penalties/temperature."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if not isinstance(config, SamplerConfig):
            return found
        if config.role != self.role:
            found.append(f"is a {self.role!r} sampler, the run needs a {config.role!r} sampler")
        missing = sorted(config.params_used - self.supported_params)
        if missing:
            found.append(f"sampling parameters not supported: {', '.join(missing)}")
        if config.random_sampling and not self.supports_random:
            found.append("greedy only: cannot serve requests with temperature > 0")
        return found


@dataclass
class SamplingMetadata:
    """Per-row sampling state of one step, built by the runner from the persistent batch.

    Row ``i`` of every tensor belongs to the ``i``-th sampled row of the
    logits.  Temperatures of greedy rows are 0.
    """

    temperature: torch.Tensor
    """float32 ``[num_rows]``."""
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    """int64 ``[num_rows]``; 0 disables top-k for a row.  ``None``: no row uses it."""
    top_p: torch.Tensor | None = None
    """float32 ``[num_rows]``; 1.0 disables top-p for a row.  ``None``: no row uses it."""
    min_p: torch.Tensor | None = None
    """float32 ``[num_rows]``; 0.0 disables min-p for a row.  ``None``: no row uses it."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Seeded generators of rows whose request set ``seed``, by row index.

    A row with a generator must draw all its randomness from it, so its
    tokens do not depend on the rest of the batch.  The runner only passes
    rows whose sample is kept, so every draw advances the request's stream.
    """
    max_num_logprobs: int | None = None
    """Largest ``logprobs`` of any row, ``None`` when no row asked for logprobs."""
    output_token_ids: list[list[int]] = field(default_factory=list)
    """Tokens each row's request generated so far (penalties, ``min_tokens``, bad words)."""
    prompt_token_ids: torch.Tensor | None = None
    """int64 ``[num_rows, max_prompt_len]`` padded with ``vocab_size``; set when a row uses repetition_penalty."""
    frequency_penalties: torch.Tensor | None = None
    """float32 ``[num_rows]`` (0 disables); ``None``: no row uses it."""
    presence_penalties: torch.Tensor | None = None
    """float32 ``[num_rows]`` (0 disables); ``None``: no row uses it."""
    repetition_penalties: torch.Tensor | None = None
    """float32 ``[num_rows]`` (1 disables); ``None``: no row uses it."""
    logit_bias: list[dict[int, float] | None] = field(default_factory=list)
    """Per row, token id -> bias added to its logit (empty list: no row uses it)."""
    allowed_token_ids_mask: torch.Tensor | None = None
    """bool ``[num_rows, vocab]``; ``True`` marks tokens that are *not* allowed."""
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    """Row index -> token sequences that must not be completed (the last token of each is banned
    when the row's output ends with the sequence's other tokens)."""
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    """Row index -> (min_tokens, stop token ids to block while fewer outputs exist)."""


@dataclass
class SamplerOutput:
    """A sampler's answer for one step."""

    sampled_token_ids: torch.Tensor
    """int64 ``[num_rows, 1]`` (``[num_rows, k]`` for a rejection sampler, padded with -1)."""
    logprob_token_ids: torch.Tensor | None = None
    """int64 ``[num_rows, n + 1]``: the sampled token then the top-``n`` tokens."""
    logprobs: torch.Tensor | None = None
    """float32 ``[num_rows, n + 1]``, logprobs of ``logprob_token_ids``."""
    sampled_token_ranks: torch.Tensor | None = None
    """int64 ``[num_rows]``, rank of the sampled token (1 = most likely)."""


class SamplerBase(Plugin):
    """Common base of :class:`Sampler` and :class:`RejectionSampler` (the ``sampler`` kind)."""

    kind: ClassVar[str] = "sampler"
    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Create the sampler with its validated ``options`` (``None``: the defaults)."""
        self.options = options if options is not None else self.Options()


class Sampler(SamplerBase):
    """Turns one step's logits into the next token of each sampled row."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[num_rows, vocab]``, float32).

        Must be vectorised over rows, honour each row's parameters and seeded
        generator, and return logprobs when ``metadata.max_num_logprobs`` is
        not ``None``.  Must not modify ``logits`` in place unless documented.
        """


@dataclass
class SpecDecodeMetadata:
    """Where draft and bonus positions sit among the verified logits.

    Example: two requests with 3 and 1 draft tokens::

        num_draft_tokens     = [3, 1]
        cu_num_draft_tokens  = [3, 4]
        target_logits_indices = [0, 1, 2, 4]   # rows scoring each draft token
        bonus_logits_indices  = [3, 5]         # rows after the last draft token
    """

    draft_token_ids: torch.Tensor
    """int64 ``[total_draft_tokens]``, all requests' drafts concatenated."""
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor
    """Positions in the flattened step whose hidden states produce the logits above."""


class RejectionSampler(SamplerBase):
    """Verifies draft tokens against the target model, losslessly."""

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(role="verify")

    @abstractmethod
    def verify(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> torch.Tensor:
        """Accept a prefix of each request's drafts and append one recovered or bonus token.

        ``target_logits`` is ``[total_draft_tokens, vocab]``; ``draft_probs``
        the drafter's probabilities at the same rows (``None`` for drafters
        without probabilities, such as n-gram); ``bonus_token_ids`` the
        ``[num_reqs, 1]`` tokens the main sampler drew after the last draft.
        Returns int64 ``[num_reqs, max_drafts + 1]`` padded with -1.  Greedy
        rows accept while the draft equals the target argmax; random rows
        follow the accept/resample rule so the output distribution equals the
        target's.
        """

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int) -> list[list[int]]:
        """Strip padding from :meth:`verify`'s output: the accepted tokens of each request."""
        rows = output_token_ids.tolist()
        return [[token for token in row if 0 <= token < vocab_size] for row in rows]
