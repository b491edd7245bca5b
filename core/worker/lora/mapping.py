"""Building a step's :class:`~patchbay.interfaces.LoRAMapping` from its rows' slots, vectorised."""

from __future__ import annotations

import torch

from patchbay.interfaces import LoRAMapping


def build_lora_mapping(slots: torch.Tensor) -> LoRAMapping:
    """The mapping of ``slots`` (``int64 [num_rows]``; ``-1`` for rows without an adapter).

    One stable sort groups the adapter rows by slot, keeping row order within a slot.
    """
    slots = slots.to(torch.int64)
    rows = torch.nonzero(slots >= 0, as_tuple=True)[0]
    sorted_slots, permutation = torch.sort(slots[rows], stable=True)
    active, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = [0]
    for count in counts.tolist():
        starts.append(starts[-1] + count)
    return LoRAMapping(
        slots=slots, order=rows[permutation], active_slots=tuple(active.tolist()), segment_starts=tuple(starts)
    )
