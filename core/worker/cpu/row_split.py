"""Linear layers that keep every CPU thread busy when few rows run.

With few rows (decode steps, the lm head at sampled rows) a linear layer is a
matrix-vector product bound by memory bandwidth, and the BLAS kernel torch
calls for it runs on one thread: on the development machine (2 cores, AVX2)
``F.linear`` of 1 to 4 rows streams weights at about 8-16 GB/s while both
cores together read 40 GB/s.  Cutting the weight's output rows into one slice
per thread and running the slices as one batched product (``torch.bmm``, which
parallelises over the batch) uses every core: 1.5-3.5x faster layers for up to
a few hundred rows, no gain for large prefill chunks (measured with
``patchbay bench``; see docs/benchmarks.md).  Each output element is still one
dot product over the whole input, so results match ``F.linear`` to float
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MAX_ROWS = 192
"""Above this many rows torch's own GEMM is as fast or faster (it parallelises well over rows)."""


def row_split_linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slices: int, max_rows: int = DEFAULT_MAX_ROWS
) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)``, as ``slices`` batched row blocks of a contiguous ``weight``.

    Falls to ``F.linear`` above ``max_rows`` rows or when ``out_features`` does not divide into ``slices``.
    """
    out_features, in_features = weight.shape
    rows = inputs.numel() // in_features
    if rows > max_rows or rows == 0 or slices < 2 or out_features % slices:
        return F.linear(inputs, weight, bias)
    blocks = weight.view(slices, out_features // slices, in_features)
    flat = inputs.reshape(rows, in_features)
    # [slices, out/slices, in] @ [slices, in, rows] -> [slices, out/slices, rows] -> [rows, out]
    sliced = torch.bmm(blocks, flat.t().unsqueeze(0).expand(slices, -1, -1))
    output = sliced.permute(2, 0, 1).reshape(*inputs.shape[:-1], out_features)
    return output if bias is None else output + bias


class RowSplitLinear:
    """The forward of one ``nn.Linear`` run by :func:`row_split_linear`."""

    def __init__(self, linear: nn.Linear, slices: int, max_rows: int) -> None:
        self.linear = linear
        self.slices = slices
        self.max_rows = max_rows

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return row_split_linear(input, self.linear.weight, self.linear.bias, self.slices, self.max_rows)


def use_row_split_linears(model: nn.Module, threads: int, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Give every eligible ``nn.Linear`` of ``model`` a :class:`RowSplitLinear` forward; return how many.

    Eligible: a float32 CPU weight whose output features divide evenly into
    ``threads`` slices, in a linear that has no forward of its own yet (fused
    projections choose their product themselves).  Nothing changes with fewer
    than two threads.
    """
    if threads < 2:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or "forward" in vars(module):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
            continue
        if module.out_features % threads:
            continue
        module.forward = RowSplitLinear(module, threads, max_rows)  # type: ignore[method-assign]
        count += 1
    return count
