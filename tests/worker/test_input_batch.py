"""The persistent batch: rows stay consistent through adds, removals, condensing and reordering."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import pytest

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.scheduler_output import NewRequestData
from patchbay.worker.input_batch import InputBatch


def _request(req_id: str, num_tokens: int, blocks: list[int]) -> NewRequestData:
    tokens = [hash((req_id, i)) % 1000 for i in range(num_tokens)]
    return NewRequestData(
        req_id,
        tokens,
        [],
        SamplingParams(max_tokens=num_tokens + 1),
        (blocks, [b + 100 for b in blocks]),
        num_computed_tokens=num_tokens // 2,
    )


def _snapshot(batch: InputBatch) -> dict[str, tuple]:
    found = {}
    for req_id, row in batch.req_id_to_index.items():
        count = batch.num_tokens[row]
        tables = tuple(tuple(t.table[row, : t.num_blocks[row]]) for t in batch.block_tables)
        found[req_id] = (
            tuple(batch.token_ids[row, :count]),
            int(batch.num_computed_tokens[row]),
            tables,
            batch.sampling_params[row].max_tokens,
        )
    return found


def _batch() -> InputBatch:
    return InputBatch(max_num_reqs=6, max_model_len=64, block_sizes=[16, 16], device=torch.device("cpu"))


def test_removals_leave_holes_that_condense_fills_from_the_end():
    batch = _batch()
    for index in range(5):
        batch.add_request(_request(f"r{index}", 10 + index, [index + 1]))
    before = _snapshot(batch)
    batch.remove_request("r1")
    batch.remove_request("r3")
    batch.condense()
    assert batch.num_rows == batch.num_reqs == 3
    assert sorted(batch.req_id_to_index.values()) == [0, 1, 2]
    assert _snapshot(batch) == {k: v for k, v in before.items() if k not in {"r1", "r3"}}


def test_new_requests_fill_holes_first():
    batch = _batch()
    for index in range(3):
        batch.add_request(_request(f"r{index}", 5, [index + 1]))
    batch.remove_request("r0")
    assert batch.add_request(_request("new", 7, [9])) == 0


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_reorder_puts_each_row_where_asked(order):
    batch = _batch()
    for index in range(4):
        batch.add_request(_request(f"r{index}", 6 + 3 * index, [index + 1, index + 2]))
    before = _snapshot(batch)
    batch.reorder(list(order))
    assert [batch.req_ids[row] for row in range(4)] == [f"r{original}" for original in order]
    assert _snapshot(batch) == before


def test_reorder_rejects_what_is_not_a_permutation():
    batch = _batch()
    batch.add_request(_request("r0", 4, [1]))
    batch.add_request(_request("r1", 4, [2]))
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder([0, 0])


def test_appending_tokens_is_vectorised_per_row():
    batch = _batch()
    for index in range(3):
        batch.add_request(_request(f"r{index}", 4 + index, [1]))
    batch.append_tokens(np.array([0, 2]), np.array([777, 888]))
    assert batch.token_ids[0, 4] == 777 and batch.token_ids[2, 6] == 888
    assert list(batch.num_tokens[:3]) == [5, 5, 7]


def test_slot_mapping_follows_the_block_table():
    batch = InputBatch(max_num_reqs=2, max_model_len=64, block_sizes=[4], device=torch.device("cpu"))
    batch.add_request(NewRequestData("a", list(range(8)), [], SamplingParams(), ([7, 2],), 0))
    slots = batch.block_tables[0].slot_mapping(np.array([0, 0, 0]), np.array([0, 5, 7]))
    assert slots.tolist() == [28, 9, 11]
