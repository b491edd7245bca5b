"""Speculative decoding in the runner: where logits are needed, verification, and what drafters get.

A request that runs ``k`` draft tokens this step needs ``k + 1`` logits:
one scoring each draft (the *target* rows) and one after the last draft
(the *bonus* row).  The main sampler draws the bonus tokens; the rejection
sampler accepts a prefix of each request's drafts and appends a recovered
or the bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass

import numpy as np
import torch

from patchbay.interfaces import RejectionSampler, SamplingMetadata, SpecDecodeMetadata
from patchbay.sampling_params import SamplingParams


def arange_within(counts: np.ndarray) -> np.ndarray:
    """Offsets inside consecutive runs of the given lengths: ``[2, 3] -> [0, 1, 0, 1, 2]``."""
    counts = counts.astype(np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass
class LogitsLayout:
    """Which flattened step positions get logits, and which of those rows score drafts or bonus tokens."""

    logits_indices: np.ndarray
    """Step positions whose hidden states go through the lm head."""
    num_drafts: np.ndarray
    """Drafts of each sampling request."""
    bonus_indices: np.ndarray
    """Row (of the computed logits) after each sampling request's last draft: one per request."""
    target_indices: np.ndarray
    """Rows scoring each draft, all requests' drafts concatenated."""

    @property
    def has_drafts(self) -> bool:
        return bool(self.num_drafts.any())


def logits_layout(cu_num_scheduled: np.ndarray, num_drafts: np.ndarray, complete: np.ndarray) -> LogitsLayout:
    """The logits rows of one step.

    Example: chunks ending at ``[4, 9, 12]`` with ``[2, 0, 1]`` drafts, the
    second request still prefilling (not complete): logits at positions
    ``[1, 2, 3, 10, 11]``; bonus rows ``[2, 4]``; target rows ``[0, 1, 3]``.
    """
    num_logits = np.where(complete, num_drafts + 1, 0)
    logits_indices = np.repeat(cu_num_scheduled - num_logits, num_logits) + arange_within(num_logits)
    sampling_drafts = num_drafts[complete]
    per_request = sampling_drafts + 1
    ends = np.cumsum(per_request)
    return LogitsLayout(
        logits_indices=logits_indices.astype(np.int64),
        num_drafts=sampling_drafts,
        bonus_indices=(ends - 1).astype(np.int64),
        target_indices=(np.repeat(ends - per_request, sampling_drafts) + arange_within(sampling_drafts)).astype(
            np.int64
        ),
    )


def verify(
    rejection_sampler: RejectionSampler,
    layout: LogitsLayout,
    logits: torch.Tensor,
    drafts: list[list[int]],
    bonus_token_ids: torch.Tensor,
    sampling: SamplingMetadata,
    vocab_size: int,
) -> list[list[int]]:
    """Each sampling request's new tokens: its accepted drafts, then a recovered or the bonus token."""
    device = logits.device
    num_drafts = layout.num_drafts.tolist()
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for row in drafts for t in row], dtype=torch.long, device=device),
        num_draft_tokens=num_drafts,
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(layout.num_drafts).astype(np.int64)).to(device),
        target_logits_indices=torch.from_numpy(layout.target_indices).to(device),
        bonus_logits_indices=torch.from_numpy(layout.bonus_indices).to(device),
        logits_indices=torch.from_numpy(layout.logits_indices).to(device),
    )
    target_logits = logits[metadata.target_logits_indices]
    output = rejection_sampler.verify(metadata, None, target_logits, bonus_token_ids, sampling)
    return rejection_sampler.parse_output(output, vocab_size)


def may_draft(params: SamplingParams) -> bool:
    """Whether a request's sampling can be verified exactly by the rejection sampler path.

    Requests asking for logprobs (a rejection sampler returns token ids only)
    or whose processing depends on the tokens generated so far (penalties,
    ``min_tokens``, bad words: the bonus token would be scored without the
    accepted drafts in its history) decode without drafts, as in vLLM.
    """
    return (
        params.logprobs is None
        and params.prompt_logprobs is None
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.min_tokens
        and not params.bad_words_token_ids
    )


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters of a run."""

    num_drafting_steps: int = 0
    """Request-steps that verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None
    """How often the draft at each position (0 = first) was accepted."""
    drafted_per_position: list[int] | None = None

    def record(self, num_drafts: int, num_accepted: int, max_drafts: int) -> None:
        if self.accepted_per_position is None:
            self.accepted_per_position = [0] * max_drafts
            self.drafted_per_position = [0] * max_drafts
        self.num_drafting_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        drafted, accepted = self.drafted_per_position, self.accepted_per_position
        assert drafted is not None  # set together with accepted_per_position
        for position in range(num_drafts):
            drafted[position] += 1
            if position < num_accepted:
                accepted[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position or [], self.drafted_per_position or [], strict=True)
        ]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per drafting request-step: accepted drafts plus the one token always produced."""
        return 1.0 + self.num_accepted_tokens / self.num_drafting_steps if self.num_drafting_steps else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "mean_accepted_length": self.mean_accepted_length,
        }


class DraftProposalError(ValueError):
    """A drafter proposed something the target cannot verify (an id outside the vocabulary, too many drafts)."""


def check_draft_proposals(
    drafter: str,
    proposals: Sequence[Sequence[int]],
    req_ids: Sequence[str],
    num_tokens: Sequence[int],
    skip: set[int],
    *,
    vocab_size: int,
    max_drafts: int,
    max_model_len: int,
) -> list[list[int]]:
    """The proposals as lists of ints, or :class:`DraftProposalError` naming ``drafter`` and the request.

    ``num_tokens[i]`` is request ``i``'s length now: its drafts may take it
    to ``max_model_len`` at most.  Rows in ``skip`` get no drafts, whatever
    was proposed for them.
    """
    if len(proposals) != len(req_ids):
        raise DraftProposalError(
            f"{drafter} returned {len(proposals)} proposals for a batch of {len(req_ids)} requests"
        )
    checked: list[list[int]] = []
    for index, proposal in enumerate(proposals):
        if index in skip:
            checked.append([])
            continue
        drafts = [int(token) for token in proposal]
        where = f"{drafter} proposed for request {req_ids[index]!r}"
        limit = min(max_drafts, max_model_len - num_tokens[index])
        if len(drafts) > limit:
            raise DraftProposalError(
                f"{where} {len(drafts)} drafts; at most {limit} are allowed "
                f"(num_speculative_tokens {max_drafts}, {num_tokens[index]} of max_model_len "
                f"{max_model_len} tokens used)"
            )
        bad = [token for token in drafts if not 0 <= token < vocab_size]
        if bad:
            raise DraftProposalError(f"{where} token ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
        checked.append(drafts)
    return checked
