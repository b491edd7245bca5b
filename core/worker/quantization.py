"""Weight-only int8 quantization for decode: int8 weights with one scale per output row, activations in float.

A decode step reads every weight once for a handful of rows, so it is bound
by memory bandwidth: int8 weights halve the bytes of bfloat16 and quarter
those of float32. torch's CPU kernel for it (``aten._weight_int8pack_mm``)
multiplies activations of the model's dtype by int8 weights and per-row
scales; it is fast for few rows (with bfloat16 activations, measured ~10x
bfloat16 ``F.linear`` at one row on an AVX512-BF16 CPU) and slow for many, so
steps of more than :data:`INT8_MAX_ROWS` rows (prefill chunks, large batches)
keep the float weight. The quantization is symmetric per output row:
``scale = max|w_row| / 127``, ``q = round(w / scale)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX_ROWS = 16
"""Above this many rows the float weight runs (torch's int8 kernel falls behind its GEMM; measured at 8-64 rows)."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight, per-row scales)`` with ``weight ~= q * scales[:, None]``, scales in the weight's dtype."""
    rows = weight.detach().float()
    scales = rows.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    quantized = torch.round(rows / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return quantized, scales.to(weight.dtype)


class Int8Linear:
    """The forward of one ``nn.Linear`` with int8 weights for steps of few rows."""

    def __init__(self, linear: nn.Linear, max_rows: int = INT8_MAX_ROWS) -> None:
        self.linear = linear
        self.max_rows = max_rows
        self.qweight, self.scales = quantize_int8(linear.weight)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        in_features = self.qweight.shape[1]
        rows = inputs.numel() // in_features
        if rows > self.max_rows or rows == 0 or inputs.dtype != self.scales.dtype:
            return F.linear(inputs, self.linear.weight, self.linear.bias)
        flat = inputs.reshape(rows, in_features).contiguous()
        output = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        output = output.view(*inputs.shape[:-1], self.qweight.shape[0])
        return output if self.linear.bias is None else output + self.linear.bias


def quantize_linears_int8(model: nn.Module, max_rows: int = INT8_MAX_ROWS) -> int:
    """Give every CPU ``nn.Linear`` of ``model`` (the LM head included) an :class:`Int8Linear` forward; return how many.

    Linears that already have a forward of their own are left alone.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and "forward" not in vars(module) and module.weight.device.type == "cpu":
            module.forward = Int8Linear(module, max_rows)  # type: ignore[method-assign]
            count += 1
    return count
