"""``torch``: the LoRA shrink and expand as plain torch operations, one matrix product per active slot.

The rows of one slot are gathered (``index_select`` over the mapping's
grouped order), multiplied by that slot's A (then B) and written back
(``index_copy`` for shrink, ``index_add_`` for expand).  A step touches only
the slots its rows use, so rows without an adapter cost nothing and a decode
step of a few rows costs a few small products.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import LoRAKernel, LoRAKernelCapabilities, LoRAMapping


class TorchLoRAKernel(LoRAKernel):
    """Gathers each active slot's rows and runs one matmul per slot for shrink and for expand."""

    contract_version = "1.1"

    capabilities: ClassVar[LoRAKernelCapabilities] = LoRAKernelCapabilities(
        devices=("cpu", "cuda", "mps"), dtypes=("float32", "bfloat16", "float16")
    )

    def shrink(
        self, x: torch.Tensor, lora_a: torch.Tensor, scalings: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        h = x.new_zeros((x.shape[0], lora_a.shape[1]))
        for rows, slot in _segments(mapping):
            product = x.index_select(0, rows) @ lora_a[slot].T
            h.index_copy_(0, rows, product.mul_(scalings[slot].to(product.dtype)))
        return h

    def expand(self, output: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping) -> None:
        for rows, slot in _segments(mapping):
            output.index_add_(0, rows, (h.index_select(0, rows) @ lora_b[slot].T).to(output.dtype))


def _segments(mapping: LoRAMapping):
    order, starts = mapping.order, mapping.segment_starts
    for index, slot in enumerate(mapping.active_slots):
        yield order[starts[index] : starts[index + 1]], slot
