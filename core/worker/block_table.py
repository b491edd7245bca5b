"""The runner's CPU mirror of one KV-cache group's block tables, one row per batch slot."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Block ids of every request in the persistent batch for one KV-cache group."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_to_row(row, block_ids)

    def append_to_row(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"request needs {end} blocks, more than max_model_len allows ({self.table.shape[1]})")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        count = self.num_blocks[src]
        self.table[dst, :count] = self.table[src, :count]
        self.num_blocks[dst] = count

    def swap_rows(self, a: int, b: int) -> None:
        self.table[[a, b]] = self.table[[b, a]]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token, given its batch row and position.

        Example, block_size 4, row 0's table [7, 2]: position 5 is in the
        table's block 1 (id 2) at offset 1, so its slot is 2 * 4 + 1 = 9.
        """
        block_ids = self.table[rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size
