"""What the built-in poolers share: one row per request out of a batch's rows, and the embedding's finish."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from patchbay.interfaces import PoolingBatch, PoolingParams, Positions


def reduce_rows(batch: PoolingBatch, positions: Positions) -> torch.Tensor:
    """float32 ``[requests, hidden]``: each request's one row (``first``, ``last``) or the mean of its rows (``all``).

    Rows of 3 and 2 tokens: segment ids ``[0, 0, 0, 1, 1]``, summed per request then divided by ``[3, 2]``.
    """
    hidden = batch.hidden_states
    if positions != "all":
        if hidden.shape[0] != batch.num_requests:
            raise ValueError(
                f"a pooler reading the {positions} position takes one row per request; the batch has "
                f"{hidden.shape[0]} rows for {batch.num_requests} requests"
            )
        return hidden.float()
    starts = torch.tensor(batch.row_starts, dtype=torch.long, device=hidden.device)
    counts = starts[1:] - starts[:-1]
    if bool((counts <= 0).any()):
        empty = [batch.req_ids[i] for i in torch.nonzero(counts <= 0).flatten().tolist()]
        raise ValueError(f"requests {empty} have no rows to pool")
    segments = torch.repeat_interleave(torch.arange(batch.num_requests, device=hidden.device), counts)
    sums = torch.zeros(batch.num_requests, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segments, hidden.float())
    return sums / counts[:, None].to(torch.float32)


def finish_embeddings(
    pooled: torch.Tensor, params: Sequence[PoolingParams], default_normalize: bool
) -> list[torch.Tensor]:
    """Each row cut to its request's ``dimensions`` (Matryoshka), then L2-normalized where asked: ``l2(e[:d])``."""
    found = []
    for row, request in zip(pooled, params, strict=True):
        if request.dimensions is not None:
            row = row[: request.dimensions]
        normalize = default_normalize if request.normalize is None else request.normalize
        found.append(F.normalize(row, p=2, dim=0) if normalize else row)
    return found
