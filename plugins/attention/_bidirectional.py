"""Encoder-only attention: every request of the step whole, each query attending all of its request's keys.

No KV cache is read or written (an encoder-only model keeps none).  Requests of similar lengths are attended
together in one SDPA call over their padded rows: a run's shorter requests repeat their last row up to the run's
length, the repeats masked as keys and dropped as queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F


def runs_of_similar_length(lengths: Sequence[int]) -> list[list[int]]:
    """Requests (indices) in runs whose lengths are within 2x of the run's longest, longest first.

    Lengths ``[20, 3, 18, 2, 9]`` give runs ``[[0, 2], [4], [1, 3]]``: padding costs at most twice the work.
    """
    ordered = sorted((index for index, length in enumerate(lengths) if length > 0), key=lambda i: -lengths[i])
    runs: list[list[int]] = []
    for index in ordered:
        if runs and 2 * lengths[index] >= lengths[runs[-1][0]]:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


@dataclass
class LengthRun:
    """Requests of similar lengths, attended in one SDPA call: their rows padded to the run's longest."""

    rows: torch.Tensor
    """long ``[requests, longest]``: each request's rows, its last one repeated past its length."""
    valid: torch.Tensor
    """bool ``[requests, longest]``: the rows that are the request's own (not repeats)."""
    mask: torch.Tensor | None
    """bool ``[requests, 1, 1, longest]``: the keys each query sees; ``None`` when no request is padded."""
    span: tuple[int, int] | None = None
    """A run of one request: its rows ``[start, stop)``, attended as a view, without a gather."""


def plan_runs(query_starts: Sequence[int], device: torch.device) -> list[LengthRun]:
    """The step's requests as :class:`LengthRun` s (built once per step, shared by every layer)."""
    lengths = [end - start for start, end in pairwise(query_starts)]
    runs = []
    for run in runs_of_similar_length(lengths):
        longest = lengths[run[0]]
        starts = torch.tensor([query_starts[r] for r in run], device=device)
        counts = torch.tensor([lengths[r] for r in run], device=device)
        offsets = torch.arange(longest, device=device)
        valid = offsets[None, :] < counts[:, None]
        rows = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)
        span = (query_starts[run[0]], query_starts[run[0]] + longest) if len(run) == 1 else None
        runs.append(LengthRun(rows, valid, None if bool(valid.all()) else valid[:, None, None, :], span))
    return runs


def attend_bidirectional(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    runs: Sequence[LengthRun],
    num_tokens: int,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[tokens, heads, head_size]`` attention of each request's rows to all of its own keys (``key``/``value``:
    ``[tokens, kv_heads, head_size]``, grouped-query heads allowed), run by run; the requests cover rows
    ``[0, num_tokens)``, and the rows past them (padding) are zeros."""
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    output[num_tokens:].zero_()
    enable_gqa = query.shape[1] != key.shape[1]
    compute = compute_dtype or query.dtype
    for run in runs:
        if run.span is not None:
            start, stop = run.span
            one_query, one_key, one_value = (
                tensor[start:stop].to(compute).transpose(0, 1)[None] for tensor in (query, key, value)
            )
            attended = F.scaled_dot_product_attention(one_query, one_key, one_value, scale=scale, enable_gqa=enable_gqa)
            output[start:stop] = attended[0].transpose(0, 1).to(query.dtype)
            continue
        queries, keys, values = (
            tensor[run.rows].to(compute).permute(0, 2, 1, 3) for tensor in (query, key, value)
        )  # [requests, heads, longest, head_size]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=run.mask, scale=scale, enable_gqa=enable_gqa
        ).permute(0, 2, 1, 3)
        output[run.rows[run.valid]] = attended[run.valid].to(query.dtype)
    return output
