"""Float weights to GGUF blocks (the bytes llama.cpp writes), for the formats that re-quantize as they load.

:func:`q8_0_blocks` is llama.cpp's Q8_0: per 32 inputs, a float16 scale ``max|w| / 127`` and int8 levels.
:func:`q4_1_blocks` is Q4_1's layout (a float16 scale and minimum per 32 inputs, 4-bit levels) with a better
choice of scale and minimum than the range's ends: for each block it tries the grids that cut the range into 7 to
15 steps, fits scale and minimum to each grid's levels by least squares, and keeps the grid of least squared
error (the idea of llama.cpp's ``make_qkx2_quants``).  A weight already on a Q4_1 grid (a model dequantized from
a Q4_1 file) is found again exactly, wherever its block spans at least 8 levels; a float weight loses less than
with the range's ends.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
ROWS_PER_CHUNK = 256
"""Rows quantized at once (bounds the search's temporaries to a few MB)."""
Q4_1_STEPS = torch.arange(15.0, 6.5, -0.5)
"""The grids tried: the block's range cut into 15, 14.5, ..., 7 steps."""


def q8_0_blocks(weight: torch.Tensor) -> np.ndarray:
    """``weight`` (``[rows, K]``, K a multiple of 32) as Q8_0 blocks: ``uint8 [rows, K / 32 * 34]``."""
    rows, inputs = weight.shape
    out = np.empty((rows, inputs // BLOCK * 34), dtype=np.uint8)
    for start in range(0, rows, ROWS_PER_CHUNK):
        blocks = weight[start : start + ROWS_PER_CHUNK].detach().float().reshape(-1, BLOCK)
        scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
        stored = scale.half()
        inverse = torch.where(stored.float() > 0, 1 / stored.float(), torch.zeros_like(scale))
        levels = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
        packed = torch.cat([stored.view(torch.uint8).view(-1, 2), levels.view(torch.uint8)], dim=-1)
        out[start : start + ROWS_PER_CHUNK] = packed.reshape(-1, out.shape[1]).numpy()
    return out


def q4_1_blocks(weight: torch.Tensor) -> np.ndarray:
    """``weight`` (``[rows, K]``, K a multiple of 32) as Q4_1 blocks, ``uint8 [rows, K / 32 * 20]``, with the
    scale and minimum of least squared error among the grids of :data:`Q4_1_STEPS`."""
    rows, inputs = weight.shape
    out = np.empty((rows, inputs // BLOCK * 20), dtype=np.uint8)
    for start in range(0, rows, ROWS_PER_CHUNK):
        blocks = weight[start : start + ROWS_PER_CHUNK].detach().float().reshape(-1, BLOCK)
        scale, minimum = _best_q4_1_grid(blocks)
        scale16, minimum16 = scale.half(), minimum.half()
        divisor = scale16.float().clamp(min=torch.finfo(torch.float16).tiny)
        levels = torch.round((blocks - minimum16.float()[:, None]) / divisor[:, None]).clamp(0, 15).to(torch.uint8)
        nibbles = levels[:, : BLOCK // 2] | (levels[:, BLOCK // 2 :] << 4)
        packed = torch.cat(
            [scale16.view(torch.uint8).view(-1, 2), minimum16.view(torch.uint8).view(-1, 2), nibbles], dim=-1
        )
        out[start : start + ROWS_PER_CHUNK] = packed.reshape(-1, out.shape[1]).numpy()
    return out


def _best_q4_1_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the ``(scale, minimum)`` of least squared error over the grids tried (float32)."""
    low = blocks.amin(dim=-1, keepdim=True)
    span = (blocks.amax(dim=-1, keepdim=True) - low).clamp(min=torch.finfo(torch.float32).tiny)
    best_error = torch.full((blocks.shape[0],), float("inf"))
    best_scale = (span / 15).squeeze(-1)
    best_minimum = low.squeeze(-1)
    for steps in Q4_1_STEPS:
        levels = torch.round((blocks - low) * (steps / span)).clamp(0, 15)
        # Least squares of w ~ scale * level + minimum over the block.
        mean_level, mean_weight = levels.mean(dim=-1), blocks.mean(dim=-1)
        centred = levels - mean_level[:, None]
        variance = (centred * centred).sum(dim=-1)
        scale = torch.where(
            variance > 0,
            (centred * (blocks - mean_weight[:, None])).sum(dim=-1) / variance.clamp(min=1e-30),
            span[:, 0] / 15,
        )
        minimum = mean_weight - scale * mean_level
        error = ((levels * scale[:, None] + minimum[:, None] - blocks) ** 2).sum(dim=-1)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_minimum = torch.where(better, minimum, best_minimum)
    return best_scale.clamp(min=0), best_minimum
