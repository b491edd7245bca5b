"""``torch``: the LoRA shrink and expand as plain torch operations.

``shrink`` and ``expand`` run one matrix product per active slot: the rows of
one slot are gathered (``index_select`` over the mapping's grouped order),
multiplied by that slot's A (then B) and written back (``index_copy`` for
shrink, ``index_add_`` for expand).  Rows without an adapter cost nothing.

``add_lora`` stacks the step's active slots instead when several are active
or most rows have an adapter: one product of every row with all active A's,
each row's columns of the other slots set to zero (selected, not multiplied
by zero: a slot whose product overflows to inf, or NaN, must not reach the
other rows, since ``inf × 0`` is NaN) and its own scaled, then one product
with the active B's side by side, added to the output.
That computes the extra columns of the other slots, but in two products per
linear instead of six operations per slot: on a CPU a step's hundreds of
small per-slot products cost more than the few extra columns. The stacked B
is kept until its slots' weights change; the mask lasts one step.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel

from patchbay.interfaces import LoRAKernel, LoRAKernelCapabilities, LoRAMapping


class TorchLoRAKernel(LoRAKernel):
    """One matmul per slot for shrink and for expand; two over the stacked active slots for ``add_lora``."""

    contract_version = "1.1"

    capabilities: ClassVar[LoRAKernelCapabilities] = LoRAKernelCapabilities(
        devices=("cpu", "cuda", "mps"), dtypes=("float32", "bfloat16", "float16")
    )

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._stacked_b: dict[int, tuple[int, tuple[int, ...], torch.Tensor]] = {}
        """``id(lora_b)`` -> (its version, the slots stacked, ``[out, slots x rank]``)."""
        self._mask: tuple[LoRAMapping, tuple[int, int, torch.dtype], torch.Tensor, torch.Tensor] | None = None
        """The last step's mapping, (scalings' version, stacked rank, dtype), and its row masks ``[rows, slots x
        rank]``: which columns are the row's own slot's (bool), and their scale (zero elsewhere)."""

    def add_lora(
        self,
        output: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scalings: torch.Tensor,
        mapping: LoRAMapping,
    ) -> None:
        active = mapping.active_slots
        if not active:
            return
        adapter_rows = mapping.segment_starts[-1]
        if len(active) == 1 and 2 * adapter_rows < mapping.num_rows:
            super().add_lora(output, x, lora_a, lora_b, scalings, mapping)
            return
        slots = torch.tensor(active, device=lora_a.device)
        stacked_a = lora_a.index_select(0, slots).flatten(0, 1)  # [slots x rank, in]
        own, scale = self._row_masks(mapping, scalings, lora_a.shape[1], x.dtype)
        h = torch.where(own, x @ stacked_a.T, 0).mul_(scale)
        output.addmm_(h.to(output.dtype), self._stacked(lora_b, active).T)

    def _stacked(self, lora_b: torch.Tensor, active: tuple[int, ...]) -> torch.Tensor:
        kept = self._stacked_b.get(id(lora_b))
        if kept is not None and kept[0] == lora_b._version and kept[1] == active:
            return kept[2]
        slots = torch.tensor(active, device=lora_b.device)
        stacked = lora_b.index_select(0, slots).permute(1, 0, 2).flatten(1, 2).contiguous()
        self._stacked_b[id(lora_b)] = (lora_b._version, active, stacked)
        return stacked

    def _row_masks(
        self, mapping: LoRAMapping, scalings: torch.Tensor, rank: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (scalings._version, rank, dtype)
        if self._mask is not None and self._mask[0] is mapping and self._mask[1] == key:
            return self._mask[2], self._mask[3]
        active = mapping.active_slots
        position = torch.full((int(scalings.shape[0]) + 1,), -1, dtype=torch.int64, device=scalings.device)
        position[torch.tensor(active, device=scalings.device)] = torch.arange(len(active), device=scalings.device)
        # A row's place among the active slots (its slot -1, no adapter, maps to the last entry: -1).
        row_position = position[mapping.slots.to(scalings.device)]
        scale = torch.zeros(mapping.num_rows, len(active), dtype=torch.float32, device=scalings.device)
        own = torch.zeros(mapping.num_rows, len(active), dtype=torch.bool, device=scalings.device)
        rows = torch.nonzero(row_position >= 0, as_tuple=True)[0]
        scale[rows, row_position[rows]] = scalings[mapping.slots[rows]]
        own[rows, row_position[rows]] = True
        built = own.repeat_interleave(rank, dim=1), scale.repeat_interleave(rank, dim=1).to(dtype)
        self._mask = (mapping, key, *built)
        return built

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
