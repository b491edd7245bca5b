"""The persistent input batch: CPU mirrors of every running request's state, updated incrementally.

Rows are batch slots.  A request keeps its row while it runs, so each step
only writes what changed (new requests, new blocks, sampled tokens) instead
of rebuilding the batch.  Removal leaves a hole; :meth:`InputBatch.condense`
moves rows from the end into holes so that live rows stay ``0..num_reqs-1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from patchbay.scheduling.scheduler_output import NewRequestData
from patchbay.worker.block_table import BlockTable
from patchbay.worker.sampling_state import SamplingState


class InputBatch:
    """Token ids, counts, block tables and sampling parameters of the running requests."""

    def __init__(self, *, max_num_reqs: int, max_model_len: int, block_sizes: list[int], device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        # One column past max_model_len: a prompt of exactly max_model_len tokens still samples one token.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        """Known tokens of each row: prompt, then generated (the sampled one of the last step included)."""
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_tables = [
            BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size) for block_size in block_sizes
        ]
        self.sampling_params: list[Any] = [None] * max_num_reqs
        self.sampling = SamplingState(max_num_reqs)
        self.device = device
        self._row_arrays = [self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, *self.sampling.arrays]
        self.num_rows = 0
        """Rows in use, holes included; equals ``num_reqs`` after :meth:`condense`."""
        self._holes: set[int] = set()

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, request: NewRequestData) -> int:
        """Place a new (or resumed) request in the lowest free row; return the row."""
        if request.req_id in self.req_id_to_index:
            raise ValueError(f"request {request.req_id!r} is already in the batch")
        if self._holes:
            row = min(self._holes)
            self._holes.remove(row)
        else:
            if self.num_rows == self.max_num_reqs:
                raise ValueError(f"the batch holds at most {self.max_num_reqs} requests (scheduler.max_num_seqs)")
            row = self.num_rows
            self.num_rows += 1
        tokens = request.all_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {len(tokens)} tokens, max_model_len is {self.max_model_len}"
            )
        self.req_ids[row] = request.req_id
        self.req_id_to_index[request.req_id] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(request.prompt_token_ids)
        self.num_computed_tokens[row] = request.num_computed_tokens
        for table, block_ids in zip(self.block_tables, request.block_ids, strict=True):
            table.set_row(row, block_ids)
        self.sampling_params[row] = request.sampling_params
        self.sampling.add(row, request.req_id, request.sampling_params, self.device)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Drop a request, leaving a hole; return its former row (``None`` if it was not here).

        Its seeded generator stays (a preempted request resumes its stream) until :meth:`forget_request`.
        """
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.sampling_params[row] = None
        self._holes.add(row)
        return row

    def forget_request(self, req_id: str) -> None:
        """Drop a finished request, with what the batch keeps for it while it is away (its generator)."""
        self.remove_request(req_id)
        self.sampling.forget(req_id)

    def condense(self) -> None:
        """Fill holes with rows from the end so live rows are contiguous."""
        while self._holes:
            last = self.num_rows - 1
            if last in self._holes:
                self._holes.remove(last)
                self.num_rows -= 1
                continue
            hole = min(self._holes)
            self._holes.remove(hole)
            self._move_row(last, hole)
            self.num_rows -= 1

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        count = self.num_tokens[src]
        self.token_ids[dst, :count] = self.token_ids[src, :count]
        for array in self._row_arrays:
            array[dst] = array[src]
        for table in self.block_tables:
            table.move_row(src, dst)
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.req_id_to_index[req_id] = dst

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two rows (for backends that ask to reorder the batch)."""
        if a == b:
            return
        longest = max(self.num_tokens[a], self.num_tokens[b])
        self.token_ids[[a, b], :longest] = self.token_ids[[b, a], :longest]
        for array in self._row_arrays:
            array[[a, b]] = array[[b, a]]
        for table in self.block_tables:
            table.swap_rows(a, b)
        self.req_ids[a], self.req_ids[b] = self.req_ids[b], self.req_ids[a]
        self.sampling_params[a], self.sampling_params[b] = self.sampling_params[b], self.sampling_params[a]
        for row in (a, b):
            req_id = self.req_ids[row]
            if req_id is not None:
                self.req_id_to_index[req_id] = row

    def reorder(self, order: list[int]) -> None:
        """Rearrange rows so that row ``i`` holds what row ``order[i]`` held (``order`` is a permutation).

        Applied as swaps: e.g. ``[2, 0, 1]`` swaps rows 0 and 2, then 1 and 2.
        """
        if sorted(order) != list(range(self.num_rows)):
            raise ValueError(f"reorder_batch must return a permutation of range({self.num_rows}), got {order}")
        where = list(range(self.num_rows))  # where[original row] = its current row
        holder = list(range(self.num_rows))  # holder[current row] = the original row it holds
        for target, original in enumerate(order):
            source = where[original]
            if source != target:
                self.swap_rows(target, source)
                displaced = holder[target]
                holder[target], holder[source] = original, displaced
                where[original], where[displaced] = target, source

    def output_token_ids(self, rows: np.ndarray) -> list[list[int]]:
        """Tokens each row's request generated so far."""
        return [self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist() for row in rows]

    def prompt_token_ids(self, rows: np.ndarray, pad: int) -> torch.Tensor:
        """int64 ``[len(rows), longest prompt]`` of the rows' prompts, padded with ``pad``."""
        width = int(self.num_prompt_tokens[rows].max()) if len(rows) else 0
        prompts = np.full((len(rows), width), pad, dtype=np.int64)
        for i, row in enumerate(rows):
            count = self.num_prompt_tokens[row]
            prompts[i, :count] = self.token_ids[row, :count]
        return torch.from_numpy(prompts)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token to each of ``rows`` (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
