"""The ``rejection`` sampler: lossless verification of draft tokens for speculative decoding."""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import (
    SAMPLING_PARAMS,
    RejectionSampler,
    SamplerCapabilities,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from patchbay.plugins.samplers import _processing
from patchbay.toolkit.fused_ops import argmax_rows, inverse_cdf_rows

PADDING = -1


class StandardRejectionSampler(RejectionSampler):
    """Accepts each draft with probability ``min(1, p/q)`` and resamples from ``max(p - q, 0)`` on rejection.

    ``p`` is the target distribution after the ``standard`` sampler's
    processing (mask, bad words, ``min_tokens``, logit bias and penalties,
    each draft position seeing the request's output plus the drafts before
    it; then temperature, min-p, top-k and top-p); ``q`` is the drafter's
    distribution, one-hot on the draft when ``draft_probs`` is ``None``.
    Greedy requests accept while the draft equals the target argmax and then
    take the argmax.  When every draft is accepted the bonus token follows.
    Seeded requests draw only from their own generator: one uniform per draft
    to accept it, then one per draft to draw its recovered token (inverse
    transform sampling over the residual).
    """

    contract_version = "1.1"

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        role="verify",
        devices=("cpu", "cuda", "mps"),
        # Verification returns token ids only, so "logprobs" is not served; prompt logprobs are computed
        # by the runner from the prompt's logits, never through this sampler.
        supported_params=SAMPLING_PARAMS - {"logprobs"},
        supports_random=True,
        logprobs_mode="raw",
    )

    def verify(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> torch.Tensor:
        """Accepted drafts, then a recovered or the bonus token: int64 ``[num_reqs, max_drafts + 1]``, padded -1."""
        device = target_logits.device
        num_drafts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64, device=device)
        request_of_row = torch.repeat_interleave(torch.arange(len(num_drafts), device=device), num_drafts)
        draft_ids = metadata.draft_token_ids.to(device=device, dtype=torch.int64)

        processed = _processing.apply_logits_processors(target_logits, _per_draft_row(sampling, metadata))
        # Greedy rows: accept while the draft is the argmax; the argmax is also the recovered token.
        recovered = argmax_rows(processed)
        accepted = draft_ids == recovered
        random_rows = (sampling.temperature[request_of_row] > 0).nonzero().squeeze(1)
        if random_rows.numel():
            accepted[random_rows], recovered[random_rows] = self._verify_random_rows(
                processed, random_rows, request_of_row, draft_ids, draft_probs, sampling
            )
        return _assemble(accepted, recovered, draft_ids, bonus_token_ids, num_drafts)

    @staticmethod
    def _verify_random_rows(
        processed: torch.Tensor,
        rows: torch.Tensor,
        request_of_row: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        sampling: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted, recovered) for the draft rows ``rows`` of random requests."""
        requests = request_of_row[rows]

        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[requests]

        target = _processing.apply_sampling_filters(
            processed[rows],
            sampling.temperature[requests],
            min_p=pick(sampling.min_p),
            top_k=pick(sampling.top_k),
            top_p=pick(sampling.top_p),
        ).softmax(dim=-1)
        drafts = draft_ids[rows].unsqueeze(1)
        if draft_probs is None:
            draft = torch.zeros_like(target).scatter_(1, drafts, 1.0)
        else:
            draft = draft_probs[rows].to(torch.float32)
        acceptance, recovery = _draw_uniforms(requests, sampling.generators, target.device)
        # u < p(x) / q(x), written without the division: accepts with probability min(1, p/q).
        accepted = acceptance * draft.gather(1, drafts).squeeze(1) < target.gather(1, drafts).squeeze(1)
        recovered = inverse_cdf_rows((target - draft).clamp_min_(0.0), recovery)
        return accepted, recovered


def _per_draft_row(sampling: SamplingMetadata, metadata: SpecDecodeMetadata) -> SamplingMetadata:
    """``sampling`` (one row per request) expanded to one row per draft token, for the logits processors.

    The draft at position ``t`` of a request sees the request's output
    followed by its first ``t`` drafts (penalties, bad words and
    ``min_tokens`` depend on it).
    """
    counts = metadata.num_draft_tokens
    request_of_row = [request for request, count in enumerate(counts) for _ in range(count)]
    index = torch.tensor(request_of_row, dtype=torch.int64, device=sampling.temperature.device)

    def pick(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[index.to(values.device)]

    history_needed = (
        sampling.repetition_penalties is not None
        or sampling.frequency_penalties is not None
        or sampling.presence_penalties is not None
        or sampling.bad_words_token_ids
        or sampling.min_tokens
    )
    outputs: list[list[int]] = []
    if history_needed:
        drafts = metadata.draft_token_ids.tolist()
        start = 0
        for request, count in enumerate(counts):
            generated = sampling.output_token_ids[request] if sampling.output_token_ids else []
            outputs.extend(generated + drafts[start : start + position] for position in range(count))
            start += count
    rows_of: dict[int, list[int]] = {}
    for row, request in enumerate(request_of_row):
        rows_of.setdefault(request, []).append(row)
    return SamplingMetadata(
        temperature=sampling.temperature[index.to(sampling.temperature.device)],
        all_greedy=sampling.all_greedy,
        all_random=sampling.all_random,
        output_token_ids=outputs,
        prompt_token_ids=pick(sampling.prompt_token_ids),
        frequency_penalties=pick(sampling.frequency_penalties),
        presence_penalties=pick(sampling.presence_penalties),
        repetition_penalties=pick(sampling.repetition_penalties),
        logit_bias=[sampling.logit_bias[request] for request in request_of_row] if sampling.logit_bias else [],
        allowed_token_ids_mask=pick(sampling.allowed_token_ids_mask),
        bad_words_token_ids={
            row: words for request, words in sampling.bad_words_token_ids.items() for row in rows_of.get(request, [])
        },
        min_tokens={row: value for request, value in sampling.min_tokens.items() for row in rows_of.get(request, [])},
    )


def _draw_uniforms(
    requests: torch.Tensor, generators: dict[int, torch.Generator], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float64 uniforms per row, one to accept the draft and one to draw the recovered token; rows of
    seeded requests from the request's generator (first the acceptance uniforms, then the recovery ones)."""
    num_rows = requests.shape[0]
    acceptance = torch.empty(num_rows, dtype=torch.float64, device=device)
    recovery = torch.empty(num_rows, dtype=torch.float64, device=device)
    seeded = torch.zeros(num_rows, dtype=torch.bool, device=device)
    for request, generator in generators.items():
        rows = (requests == request).nonzero().squeeze(1)
        if rows.numel():
            acceptance[rows] = torch.rand(rows.numel(), generator=generator, dtype=torch.float64, device=device)
            recovery[rows] = torch.rand(rows.numel(), generator=generator, dtype=torch.float64, device=device)
            seeded[rows] = True
    unseeded = (~seeded).nonzero().squeeze(1)
    if unseeded.numel():
        acceptance[unseeded] = torch.rand(unseeded.numel(), dtype=torch.float64, device=device)
        recovery[unseeded] = torch.rand(unseeded.numel(), dtype=torch.float64, device=device)
    return acceptance, recovery


def _assemble(
    accepted: torch.Tensor,
    recovered: torch.Tensor,
    draft_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """Lay out each request's accepted drafts, then its recovered (or bonus) token, padded with -1.

    ``num_drafts [2, 1], accepted [T, F, F]`` -> ``[[d0, r1, -1], [r2, -1, -1]]``;
    with ``accepted [T, T, T]`` -> ``[[d0, d1, bonus0], [d2, bonus1, -1]]``.
    """
    device = draft_ids.device
    bonus = bonus_token_ids.reshape(-1).to(device=device, dtype=torch.int64)
    if draft_ids.numel() == 0:
        return bonus.unsqueeze(1).clone()
    width = int(num_drafts.max())
    starts = torch.cumsum(num_drafts, 0) - num_drafts
    position = torch.arange(width, device=device).unsqueeze(0)
    in_request = position < num_drafts.unsqueeze(1)
    # Flattened draft row at (request, position), e.g. starts [0, 2] -> [[0, 1], [2, 3]]; padding is masked.
    flat = (starts.unsqueeze(1) + position).clamp_max_(draft_ids.shape[0] - 1)
    rejected = in_request & ~accepted[flat]
    # First rejected position, or num_drafts when every draft was accepted.
    num_accepted = torch.minimum(torch.where(rejected, position, width).amin(dim=1), num_drafts)

    num_reqs = num_drafts.shape[0]
    output = torch.full((num_reqs, width + 1), PADDING, dtype=torch.int64, device=device)
    output[:, :width] = torch.where(position < num_accepted.unsqueeze(1), draft_ids[flat], PADDING)
    first_rejected = (starts + num_accepted).clamp_max_(draft_ids.shape[0] - 1)
    last = torch.where(num_accepted == num_drafts, bonus, recovered[first_rejected])
    output[torch.arange(num_reqs, device=device), num_accepted] = last
    return output
