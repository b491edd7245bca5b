"""A weight held as the toolkit's block tiles of GGUF blocks: the packed weight every built-in quantized format
hands the runner (GGUF files as they are; GPTQ, AWQ and compressed-tensors groups after their repacking)."""

from __future__ import annotations

import torch

from patchbay.interfaces import PackedWeight
from patchbay.plugins.weight_formats.int4_groups import InputOrder
from patchbay.toolkit import block_tiles


class GGUFBlockWeight(PackedWeight):
    """A quantized GGUF tensor as block tiles, multiplied on the threads there were when it was loaded."""

    def __init__(self, tiles: block_tiles.BlockTiles, threads: int, order: InputOrder | None = None) -> None:
        self.tiles = tiles
        self.threads = threads
        self.order = order
        """Where the inputs were sorted by group (GPTQ's act-order): the product gathers them in that order."""
        self.out_features = tiles.out_features
        self.in_features = tiles.in_features
        self.tensor_type = tiles.format.name

    def product(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            inputs = self.order.columns(inputs)
        return block_tiles.block_linear(inputs, self.tiles, bias, threads=self.threads)

    def dequantize(self) -> torch.Tensor:
        return self._in_input_order(block_tiles.dequantize(self.tiles))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._in_input_order(block_tiles.dequantize_rows(self.tiles, ids, threads=1))

    def _in_input_order(self, values: torch.Tensor) -> torch.Tensor:
        if self.order is None or self.order.identity:
            return values
        restored = torch.empty_like(values)
        restored[:, self.order.perm] = values
        return restored

    def shard(self, dim: int, index: int, count: int) -> PackedWeight:
        if dim == 1 and self.order is not None and not self.order.identity:
            raise ValueError("a weight whose inputs are in act-order cannot be cut along its inputs")
        size = (self.out_features if dim == 0 else self.in_features) // count
        cut = block_tiles.slice_outputs if dim == 0 else block_tiles.slice_inputs
        return GGUFBlockWeight(cut(self.tiles, index * size, (index + 1) * size), self.threads, self.order)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes
