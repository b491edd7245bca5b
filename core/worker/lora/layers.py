"""The model side of LoRA: target linears wrapped to add each row's adapter through the run's kernel.

Every decoder layer's ``q/k/v/o_proj`` and ``gate/up/down_proj`` is wrapped
in a :class:`LoRALinear` holding that layer's stacked slot weights.  The
wrapper runs the base linear (whatever CPU path it took), then, when the
step has rows with an adapter, the kernel's ``add_lora`` over the step's
:class:`~patchbay.interfaces.LoRAMapping`, read from the shared :class:`LoRAStep`.

On a tensor-parallel rank the wrapped linear is a shard
(:class:`~patchbay.worker.parallel.tensor_parallel.ProjectionSlice`): each slot
keeps the matching rows of B (column parallel) or columns of A (row parallel),
so the rank adds its part of the adapter's product, summed over the ranks with
the base output's own partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from patchbay.interfaces import LoRAKernel, LoRAMapping
from patchbay.worker.parallel.tensor_parallel import ProjectionSlice


@dataclass
class LoRAStep:
    """What every wrapped linear reads during one forward pass: the kernel and the step's mapping."""

    kernel: LoRAKernel
    scalings: torch.Tensor
    """float32 ``[max_loras]``: each slot's scale (0 for an empty slot)."""
    mapping: LoRAMapping | None = None
    """This step's row -> slot mapping; ``None`` outside a step (the model then runs as the base model)."""


class LoRALinear(nn.Module):
    """A target linear plus the stacked A and B of every slot for it."""

    def __init__(
        self,
        base: nn.Module,
        step: LoRAStep,
        *,
        in_features: int,
        out_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        keeps: ProjectionSlice | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.keeps = keeps
        """This rank's part of the projection (``None``: all of it); ``in_features``/``out_features`` are the part's."""
        self.in_features, self.out_features = in_features, out_features
        self.lora_a = torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        self.used_slots: set[int] = set()
        """Slots holding an adapter that targets this linear (the others are zeros and are skipped)."""

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one slot's adapter for this linear (``None``: the adapter does not target it), zero-padded."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None or b is None:
            self.used_slots.discard(slot)
            return
        if self.keeps is not None and self.keeps.keeps == "outputs":
            b = b[self.keeps.start : self.keeps.stop]
        elif self.keeps is not None:
            a = a[:, self.keeps.start : self.keeps.stop]
        rank = a.shape[0]
        self.lora_a[slot, :rank].copy_(a)
        self.lora_b[slot, :, :rank].copy_(b)
        self.used_slots.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base(x)
        mapping = self.step.mapping
        if mapping is None or not self.used_slots.intersection(mapping.active_slots):
            return output
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] != mapping.num_rows:
            raise RuntimeError(f"LoRA: a linear saw {rows.shape[0]} rows but the step's mapping has {mapping.num_rows}")
        flat = output.reshape(-1, self.out_features)
        self.step.kernel.add_lora(flat, rows, self.lora_a, self.lora_b, self.step.scalings, mapping)
        return flat.view(output.shape) if flat.data_ptr() != output.data_ptr() else output
