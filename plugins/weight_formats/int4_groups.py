"""int4 groups of GPTQ, AWQ and compressed-tensors checkpoints, as GGUF blocks the block tiles multiply.

Each of these formats stores a linear weight as 4-bit levels ``q`` with, per group of ``G`` input features (32,
64, 128, ...) and output feature, a scale ``s`` and an integer zero point ``z``: ``w = s * (q - z)``.  A group
of ``G`` is ``G / 32`` blocks of 32 sharing its scale and zero, so:

- a symmetric checkpoint (``z = 8`` everywhere) is Q4_0 exactly: ``d = s``, the levels as they are;
- an asymmetric one is Q4_1: ``d = s`` and ``m = -s * z`` rounded to float16 (the zero's offset then carries a
  relative error below 2**-11; the kit compares the products with these very blocks).

GPTQ's act-order (``desc_act``: ``g_idx`` not in input order) groups input features that are not next to each
other; :class:`InputOrder` sorts the inputs by group once, and each product gathers its inputs in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True)
class Int4Groups:
    """One linear weight's int4 groups, unpacked: ``levels`` uint8 ``[out, in]`` (0..15), ``scales`` float16
    ``[out, groups]``, ``zeros`` int ``[out, groups]`` (``None``: symmetric, 8), inputs in group order."""

    levels: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def group_size(self) -> int:
        """Inputs per group."""
        return self.levels.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` the groups stand for (``s * (q - z)``)."""
        out_features, in_features = self.levels.shape
        groups = self.levels.view(out_features, -1, self.group_size).float()
        zeros = self.zeros.float() if self.zeros is not None else torch.full_like(self.scales, 8.0, dtype=torch.float32)
        values = (groups - zeros[..., None]) * self.scales.float()[..., None]
        return values.view(out_features, in_features)

    def gguf_blocks(self) -> tuple[str, np.ndarray]:
        """The groups as GGUF blocks of 32 (``Q4_0`` when symmetric, else ``Q4_1``): ``(type, uint8 [out, bytes])``."""
        out_features, in_features = self.levels.shape
        if self.group_size % BLOCK:
            raise ValueError(f"groups of {self.group_size} inputs do not split into blocks of {BLOCK}")
        repeat = self.group_size // BLOCK
        scales = self.scales.to(torch.float16).repeat_interleave(repeat, dim=1).reshape(-1, 1)
        levels = self.levels.reshape(-1, BLOCK)
        nibbles = levels[:, : BLOCK // 2] | (levels[:, BLOCK // 2 :] << 4)
        if self.zeros is None or bool((self.zeros == 8).all()):
            blocks = torch.cat([scales.view(torch.uint8), nibbles], dim=1)
            return "Q4_0", blocks.reshape(out_features, -1).numpy()
        zeros = self.zeros.float().repeat_interleave(repeat, dim=1).reshape(-1, 1)
        minimums = (-scales.float() * zeros).to(torch.float16)
        blocks = torch.cat([scales.view(torch.uint8), minimums.view(torch.uint8), nibbles], dim=1)
        return "Q4_1", blocks.reshape(out_features, -1).numpy()


def unpack_along_rows(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 ``[rows, cols]`` of eight 4-bit values each to uint8 ``[rows * 8, cols]``: nibble ``order[j]`` of row
    ``r`` is value row ``8r + j`` (GPTQ packs its levels so, along the inputs)."""
    shifts = torch.tensor([4 * position for position in order], dtype=torch.int32).view(1, 8, 1)
    values = (packed.to(torch.int32).unsqueeze(1) >> shifts) & 15
    return values.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_along_columns(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 ``[rows, cols]`` of eight 4-bit values each to uint8 ``[rows, cols * 8]``: nibble ``order[j]`` of column
    ``c`` is value column ``8c + j`` (GPTQ's zeros, AWQ's levels and zeros, compressed-tensors' levels)."""
    shifts = torch.tensor([4 * position for position in order], dtype=torch.int32).view(1, 1, 8)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 15
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


class InputOrder:
    """Inputs sorted by group (GPTQ's act-order): ``perm[i]`` is the original input at sorted position ``i``."""

    def __init__(self, group_of_input: torch.Tensor) -> None:
        self.perm = torch.argsort(group_of_input.to(torch.int64), stable=True)
        self.identity = bool(torch.equal(self.perm, torch.arange(len(self.perm))))

    def columns(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[..., in]`` with its inputs in group order."""
        return values if self.identity else values.index_select(-1, self.perm)
