"""Projections that read the same input, computed as one matrix product (q/k/v, gate/up).

transformers' decoder layers call ``q_proj``, ``k_proj`` and ``v_proj`` (and
``gate_proj``, ``up_proj``) one after another on the same hidden states.  One
product with the concatenated weight does the same arithmetic in fewer, larger
calls: fewer thread wake-ups per step (each parallel region costs tens of
microseconds when OpenMP threads sleep between regions, see
``patchbay/__init__.py``) and better-shaped matrix products.  The model's code
is untouched: the first projection called computes all of the group's outputs
and keeps the others for their own calls, which hand them back only when
called on the very same input tensor (and, outside inference mode, not
written in place since); any other input is computed on its own, so a model
that uses the projections differently stays correct.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of linears that transformers' decoder layers apply to one input."""

FUSE_MAX_ROWS = 16
"""Above this many rows each projection runs alone, unless the machine's tuning (:mod:`patchbay.worker.cpu.tuning`)
measured another limit: on the first development machine one product over the concatenated weight (plus
copying its parts out) stopped paying beyond about 16 rows."""

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class SharedInputProjections:
    """A group of linears with one concatenated weight; each linear's weight becomes a view of it."""

    def __init__(self, linears: list[nn.Linear], product: Product = F.linear, max_rows: int = FUSE_MAX_ROWS) -> None:
        self.product = product
        self.max_rows = max_rows
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        with torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears])
            has_bias = [linear.bias is not None for linear in linears]
            self.bias = torch.cat([linear.bias for linear in linears]) if all(has_bias) else None
        start = 0
        for index, linear in enumerate(linears):
            end = start + linear.out_features
            linear.weight = nn.Parameter(self.weight[start:end], requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias[start:end], requires_grad=False)
            linear.forward = Member(self, index)  # type: ignore[method-assign]
            start = end
        self._source: torch.Tensor | None = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, index: int, inputs: torch.Tensor) -> torch.Tensor:
        """Projection ``index`` of ``inputs``: kept from the group's product, or the whole group computed now."""
        if index in self._pending and inputs is self._source and _version(inputs) == self._version:
            found = self._pending.pop(index)
            if not self._pending:
                self._source = None
            return found
        if inputs.numel() // self.weight.shape[1] > self.max_rows:
            linear = self.linears[index]
            return self.product(inputs, linear.weight, linear.bias)
        parts = self.product(inputs, self.weight, self.bias).split(self.sizes, dim=-1)
        self._pending = {i: part.contiguous() for i, part in enumerate(parts) if i != index}
        self._source, self._version = inputs, _version(inputs)
        return parts[index].contiguous()


def _version(tensor: torch.Tensor) -> int:
    """The in-place-write counter (inference tensors have none: identity alone must do for them)."""
    return -1 if tensor.is_inference() else tensor._version


class Member:
    """One linear's forward inside a :class:`SharedInputProjections` group (``group`` is public: quantization
    swaps the group's product for one over integer weights)."""

    def __init__(self, group: SharedInputProjections, index: int) -> None:
        self.group = group
        self.index = index

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, input)


def fuse_shared_input_projections(model: nn.Module, product: Product = F.linear, max_rows: int = FUSE_MAX_ROWS) -> int:
    """Group every module's q/k/v and gate/up linears (same input size, dtype, device); return the group count.

    Steps of more than ``max_rows`` rows run each projection alone.
    """
    count = 0
    for module in model.modules():
        for names in SHARED_INPUT_GROUPS:
            found = [getattr(module, name, None) for name in names]
            linears = [linear for linear in found if isinstance(linear, nn.Linear) and "forward" not in vars(linear)]
            if len(linears) != len(names):
                continue
            first = linears[0].weight
            if any(
                linear.in_features != linears[0].in_features
                or linear.weight.dtype != first.dtype
                or linear.weight.device != first.device
                for linear in linears
            ):
                continue
            SharedInputProjections(linears, product, max_rows)  # the linears keep it alive through their forwards
            count += 1
    return count
