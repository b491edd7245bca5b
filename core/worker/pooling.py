"""The runner's pooling: which hidden states each pooling request keeps across its chunks, and the pooler's call.

A pooling engine's runner never samples.  After each forward pass it keeps,
per request, the rows of the hidden states its pooler reads
(:attr:`patchbay.interfaces.Pooler.positions`): every row for ``all``
(a prompt prefilled in chunks keeps each chunk's), the prompt's first row for
``first``, nothing until the last chunk for ``last``.  The requests whose
prompt finishes in the step are pooled together in one call; their vectors go
back to the scheduler, which finishes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from patchbay.interfaces import ClassificationHead, Pooler, PoolingBatch, PoolingParams
from patchbay.scheduling.request import PoolingRequest


@dataclass
class _Pooled:
    """One running pooling request: its parameters, token types and the rows kept from earlier chunks."""

    params: PoolingParams
    token_type_ids: np.ndarray | None
    kept: list[torch.Tensor] = field(default_factory=list)


class StepPooling:
    """The running pooling requests' kept hidden states, and the pooler over those whose prompts finish."""

    def __init__(self, pooler: Pooler, head: ClassificationHead | None, pooler_name: str = "") -> None:
        self.pooler = pooler
        self.head = head
        self.pooler_name = pooler_name or f"pooler {type(pooler).__module__}.{type(pooler).__qualname__}"
        """How errors about the pooler's vectors name it (``pooler:NAME`` when the engine built it)."""
        self._requests: dict[str, _Pooled] = {}

    def add_request(self, req_id: str, pooling: PoolingRequest | None) -> None:
        """Start keeping rows for a new (or resumed) request; a request without ``pooling`` is an error here."""
        if pooling is None:
            raise ValueError(f"request {req_id!r} generates, but this runner pools (the run has a pooling section)")
        types = np.asarray(pooling.token_type_ids, dtype=np.int64) if pooling.token_type_ids is not None else None
        self._requests[req_id] = _Pooled(pooling.params, types)

    def remove_request(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request (a preempted one starts again from its first token)."""
        self._requests.pop(req_id, None)

    def token_type_ids(
        self, req_ids: Sequence[str], num_scheduled: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor | None:
        """The step's token types, ``[num_tokens]`` (``positions``: each token's position in its prompt);
        ``None`` when no request of the step has any."""
        requests = [self._requests[req_id] for req_id in req_ids]
        if all(request.token_type_ids is None for request in requests):
            return None
        types = np.zeros(len(positions), dtype=np.int64)
        start = 0
        for request, count in zip(requests, num_scheduled.tolist(), strict=True):
            if request.token_type_ids is not None:
                types[start : start + count] = request.token_type_ids[positions[start : start + count]]
            start += count
        return torch.from_numpy(types)

    def pool(
        self,
        req_ids: Sequence[str],
        seq_lens: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        complete: np.ndarray,
        hidden_states: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Keep the step's rows each request's pooler reads and pool the requests whose prompt finished.

        Request ``i`` ran ``num_scheduled[i]`` tokens, its rows ``query_start_loc[i]:query_start_loc[i+1]``,
        up to position ``seq_lens[i] - 1``; ``complete[i]``: its prompt's last token ran.
        Returns the finished requests' vectors (float32, on the CPU).
        """
        positions = self.pooler.positions
        starts = seq_lens - num_scheduled
        finished: list[str] = []
        lengths: list[int] = []
        parts: list[torch.Tensor] = []
        for index, req_id in enumerate(req_ids):
            request = self._requests[req_id]
            begin, end = int(query_start_loc[index]), int(query_start_loc[index + 1])
            rows = hidden_states[begin:end]
            if positions == "first":
                rows = rows[:1] if starts[index] == 0 else rows[:0]
            elif positions == "last":
                rows = rows[-1:] if complete[index] else rows[:0]
            if not complete[index]:
                if len(rows):
                    request.kept.append(rows.clone())  # a copy: the step's whole hidden states are freed
                continue
            finished.append(req_id)
            lengths.append(int(seq_lens[index]))
            parts.append(torch.cat([*request.kept, rows]) if request.kept else rows)
        if not finished:
            return {}
        row_starts = np.concatenate([[0], np.cumsum([len(part) for part in parts])]).tolist()
        batch = PoolingBatch(
            req_ids=finished,
            hidden_states=torch.cat(parts),
            row_starts=row_starts,
            prompt_lens=lengths,
            params=[self._requests[req_id].params for req_id in finished],
            head=self.head,
        )
        vectors = list(self.pooler.pool(batch))
        if len(vectors) != len(finished):
            raise RuntimeError(
                f"{self.pooler_name} returned {len(vectors)} vectors for the {len(finished)} requests it was given"
            )
        return {req_id: vector.detach().float().cpu() for req_id, vector in zip(finished, vectors, strict=True)}
