"""Rows of an int8 KV cache, in torch: rounding keys and values into them and reading them back.

The format is the contract's (:mod:`patchbay.interfaces.int8_kv`); attention backends that serve int8 caches
and the conformance kit use these to write and read it.
"""

from __future__ import annotations

import torch

from patchbay.interfaces.int8_kv import LEVELS, SCALE_BYTES

__all__ = ["dequantize_rows", "quantize_rows", "row_scales"]


def quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows ``[..., head_size + 4]`` of float rows ``[..., head_size]`` (any float dtype).

    Features are divided by their row's scale in float32 and rounded half to even.
    """
    values = rows.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / LEVELS
    levels = torch.where(scale > 0, values / scale, torch.zeros_like(values)).round_().clamp_(-LEVELS, LEVELS)
    scale_bytes = scale.contiguous().view(torch.int8)
    return torch.cat((levels.to(torch.int8), scale_bytes), dim=-1)


def row_scales(cache_rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[...]`` of int8 cache rows ``[..., head_size + 4]``."""
    return cache_rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize_rows(cache_rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float rows ``[..., head_size]`` in ``dtype`` of int8 cache rows ``[..., head_size + 4]``."""
    features = cache_rows[..., :-SCALE_BYTES].float()
    return (features * row_scales(cache_rows).unsqueeze(-1)).to(dtype)
