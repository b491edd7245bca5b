"""Logits processing shared by the ``standard`` and ``rejection`` samplers, vectorised over rows.

The documented order, for every row:

(a) the allowed-token mask, (b) bad words, (c) ``min_tokens`` and logit bias,
(d) penalties (repetition, then frequency and presence) -- see
:func:`apply_logits_processors`; then, for random rows only,
(e) temperature, min-p, top-k and top-p -- see :func:`apply_sampling_filters`.
Greedy rows take the argmax after (d).

Banned tokens get a logit of ``-inf``; their probability is exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from patchbay.interfaces import SamplingMetadata
from patchbay.toolkit.fused_ops import inverse_cdf_rows

NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps (a) to (d) on float32 ``logits`` (``[num_rows, vocab]``); the input is left untouched.

    Where no step applies (every row greedy or plainly sampled) the result is ``logits`` itself when it is
    float32 already: callers must not modify it in place.  Copying a 64-request step's logits cost more
    than its argmax.
    """
    banned = _banned_by_bad_words(metadata) + _banned_by_min_tokens(metadata)
    if metadata.allowed_token_ids_mask is not None or banned or any(metadata.logit_bias):  # steps in place
        logits = logits.to(torch.float32, copy=True)
    else:
        logits = logits.to(torch.float32)
    if metadata.allowed_token_ids_mask is not None:
        logits.masked_fill_(metadata.allowed_token_ids_mask, NEG_INF)
    if banned:
        rows, tokens = zip(*banned, strict=True)
        logits[_index(rows, logits.device), _index(tokens, logits.device)] = NEG_INF
    if metadata.logit_bias:
        _add_logit_bias(logits, metadata.logit_bias)
    return _apply_penalties(logits, metadata)


def apply_sampling_filters(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step (e) before the draw, for random rows: a new tensor of logits whose softmax is the sampled distribution.

    Order: divide by ``temperature`` (> 0); min-p drops tokens whose
    probability is below ``min_p`` times the row's largest; top-k keeps the
    ``k`` largest logits (all tokens tied with the ``k``-th are kept; 0 or
    ``k >= vocab`` keeps everything); top-p, on the distribution renormalised
    after top-k, keeps the smallest set of most likely tokens whose mass
    reaches ``p`` (always at least one token; 1 keeps everything).
    """
    logits = logits / temperature.unsqueeze(1)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    if top_k is not None or top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return logits


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` (``[num_rows, vocab]``, rows need not be normalised), int64 ``[num_rows]``.

    Inverse transform sampling: one uniform ``u`` per row, and the row's first
    token whose cumulative probability exceeds ``u`` times the row's total
    (:func:`~patchbay.toolkit.fused_ops.inverse_cdf_rows`); a token of
    probability 0 is never drawn.  Rows listed in ``generators`` draw their
    ``u`` from their own generator only, so their tokens depend on nothing
    else in the batch; the other rows share one batched draw from the default
    generator.  One random number per row, where an exponential race needs one
    per token: torch's ``exponential_`` took ~20 ms for 16 rows of a
    49,152-token vocabulary on a 2-core CPU.
    """
    return inverse_cdf_rows(probs, draw_uniform(probs.shape[0], generators, probs.device))


def draw_uniform(num_rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """float64 uniforms in ``[0, 1)``, one per row: row ``i`` from ``generators[i]`` when present."""
    uniform = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row : row + 1].uniform_(generator=generator)
    return uniform


def top_p_mask(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``True`` where a token, in rows sorted by descending probability, falls outside the top-p set.

    A token is kept while the mass of the tokens before it is below ``p``:
    ``probs [.5, .3, .2], p = .7 -> mass before [0, .5, .8] -> keep [T, T, F]``.
    """
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside = mass_before >= top_p.unsqueeze(1)
    outside[:, 0] = False
    # p = 1 disables top-p; rounding in the cumulative sum must not drop the tail.
    return outside & (top_p < 1.0).unsqueeze(1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).to(torch.int64)
        kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, NEG_INF)
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(top_p_mask(sorted_probs, top_p), NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _index(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _outputs(metadata: SamplingMetadata, row: int) -> list[int]:
    return metadata.output_token_ids[row] if metadata.output_token_ids else []


def _banned_by_bad_words(metadata: SamplingMetadata) -> list[tuple[int, int]]:
    # A bad word [w1, ..., wn] bans wn when the row's output ends with w1..w(n-1).
    banned = []
    for row, words in metadata.bad_words_token_ids.items():
        outputs = _outputs(metadata, row)
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix) :] == prefix:
                banned.append((row, word[-1]))
    return banned


def _banned_by_min_tokens(metadata: SamplingMetadata) -> list[tuple[int, int]]:
    banned: list[tuple[int, int]] = []
    for row, (min_tokens, stop_token_ids) in metadata.min_tokens.items():
        if len(_outputs(metadata, row)) < min_tokens:
            banned.extend((row, token) for token in stop_token_ids)
    return banned


def _add_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    rows, tokens, biases = [], [], []
    for row, bias in enumerate(logit_bias):
        for token, value in (bias or {}).items():
            rows.append(row)
            tokens.append(token)
            biases.append(value)
    if rows:
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_((_index(rows, logits.device), _index(tokens, logits.device)), values, accumulate=True)


def output_token_counts(
    output_token_ids: list[list[int]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """float32 ``[num_rows, vocab]``: how often each token occurs in each row's output so far.

    ``[[3, 1, 3], []]`` with vocab 4 -> ``[[0, 1, 0, 2], [0, 0, 0, 0]]``.
    """
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=device)
    if output_token_ids and any(output_token_ids):
        width = max(len(ids) for ids in output_token_ids)
        # Pad with `vocab`: padding lands in the extra column, dropped below.
        padded = _index([ids + [vocab] * (width - len(ids)) for ids in output_token_ids], device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    repetition = metadata.repetition_penalties
    frequency = metadata.frequency_penalties
    presence = metadata.presence_penalties
    if repetition is None and frequency is None and presence is None:
        return logits
    num_rows, vocab = logits.shape
    counts = output_token_counts(metadata.output_token_ids, num_rows, vocab, logits.device)
    if repetition is not None:
        seen = counts > 0
        if metadata.prompt_token_ids is not None:
            # Prompt ids are padded with `vocab`, which falls in the extra column.
            in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
            in_prompt.scatter_(1, metadata.prompt_token_ids.to(torch.int64), True)
            seen |= in_prompt[:, :vocab]
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits
