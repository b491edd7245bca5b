"""Linear layers whose weights are packed once, at load, into the layout their product reads fastest.

Two layouts (:class:`WeightLayout`) exist: oneDNN's blocked layout (:data:`ONEDNN`, below) and patchbay's output
tiles (:mod:`patchbay.toolkit.tiles`); the machine's tuning chooses between them per dtype.

``F.linear`` on CPU hands each product to oneDNN (bfloat16) or MKL (float32)
with the weight in PyTorch's plain row-major layout, and oneDNN reorders the
weight into its blocked layout on every call.  For the few-row products of
decoding that reorder costs more than the product: on the development machine
(AMD EPYC, AVX-512 with AVX512-BF16, 2 threads) a decoder layer's q/k/v in
bfloat16 ran in 81 us with ``F.linear`` and 25 us packed once and run as one
product; float32, which oneDNN computes with its own kernels instead of MKL's,
went from 126 to 46 us, and still ran twice as fast at 1,024 rows.

Packed bfloat16 products without a bias are bit-identical to ``F.linear``
(the same oneDNN kernel, minus the per-call reorder); with a bias, on an
Intel Xeon with AMX from 10 rows, torch's own call took another kernel and an
output could land one bfloat16 rounding step away.  Packed float32 products
round differently from MKL's, like any other float32 GEMM.  Whether packing pays is
measured per machine (:mod:`patchbay.worker.cpu.tuning`).

The packed copy replaces the plain weight: the module's ``weight`` parameter
becomes a tensor on the ``meta`` device with the same shape and dtype, so the
model's memory does not double and code that reads a weight's metadata still
works, while code that would compute with the plain weight fails loudly.
Weights shared with another module (an LM head tied to the input embedding)
are packed as a copy and kept.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from patchbay.worker.cpu.fused_projections import Member, SharedInputProjections
from patchbay.worker.cpu.quantization import FusedIntegerProduct, IntegerLinear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes whose packed products oneDNN runs on CPU."""


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack and multiply ``dtype`` weights with oneDNN on this CPU (tried once)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(16, 32, dtype=dtype)
        output = packed_linear(torch.ones(2, 32, dtype=dtype), pack(weight), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.all(output == 32))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out_features, in_features]``, CPU) reordered into oneDNN's layout for linear products."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` with ``packed = pack(weight)``; ``inputs`` of any leading shape.

    The rows are padded with zeros up to :func:`row_bucket` (see there why) and the padding's rows dropped.
    """
    in_features = inputs.shape[-1]
    rows = inputs.numel() // in_features
    bucket = row_bucket(rows)
    flat = inputs.reshape(rows, in_features)
    if bucket != rows:
        flat = F.pad(flat, (0, 0, 0, bucket - rows))
    output = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, bias, "none", [], "")
    return output[:rows].view(*inputs.shape[:-1], output.shape[-1])


def row_bucket(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: ``rows`` up to 16, then multiples of 16, then of 64.

    oneDNN builds (JIT-compiles) a kernel for each new row count, which costs far more than a small product
    (about 0.4-0.7 ms on the development machine, against 25-130 us for the product itself) and its cache of
    kernels is bounded.  A serving engine meets every row count from 1 to its token budget as requests come
    and go, so the row counts are bucketed: at most 16 + 15 + a few dozen kernels per weight shape, for at most
    15 padded rows below 256 rows (where products are bound by reading the weights, not by arithmetic) and
    under a quarter more arithmetic above.
    """
    if rows <= 16:
        return rows
    if rows <= 256:
        return -(-rows // 16) * 16
    return -(-rows // 64) * 64


class WeightLayout(Protocol):
    """A layout weights are packed into once, at load, and the product that reads it."""

    name: str
    """How the run summary names it."""

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` (``[out_features, in_features]``, CPU) can be packed into this layout."""

    def pack(self, weight: torch.Tensor) -> Any:
        """``weight`` packed (an opaque value :meth:`product` takes)."""

    def product(self, inputs: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(inputs, weight, bias)`` with ``packed = self.pack(weight)``; ``inputs`` of any leading shape."""


class OneDnnLayout:
    """oneDNN's blocked layout: :func:`pack` and :func:`packed_linear`."""

    name = "oneDNN blocks"

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and packing_supported(weight.dtype)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack(weight)

    def product(self, inputs: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(inputs, packed, bias)


ONEDNN = OneDnnLayout()


class PackedLinear:
    """The forward of one ``nn.Linear`` whose weight is packed."""

    def __init__(self, linear: nn.Linear, shared: bool, layout: WeightLayout = ONEDNN) -> None:
        self.layout = layout
        self.packed = layout.pack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        if not shared:
            _release(linear, "weight")

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return self.layout.product(input, self.packed, self.bias)


class PackedGroupProduct:
    """A fused projection group's product (:mod:`patchbay.worker.cpu.fused_projections`) over its packed weight.

    The group computes every step whole (its row limit is lifted), so the members' own weights are never
    multiplied and are released with the concatenated one.
    """

    def __init__(self, group: SharedInputProjections, layout: WeightLayout = ONEDNN) -> None:
        self.layout = layout
        self.packed = layout.pack(group.weight)
        group.max_rows = 1 << 62
        for linear in group.linears:
            _release(linear, "weight")
        group.weight = self.weight = torch.empty_like(group.weight, device="meta")

    def __call__(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight is not self.weight:
            raise RuntimeError("a packed projection group was asked for a product with another weight")
        return self.layout.product(inputs, self.packed, bias)


def _release(module: nn.Module, name: str) -> None:
    """Replace a parameter by an empty tensor of its shape and dtype on the meta device (its data lives packed)."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False))


def use_packed_linears(model: nn.Module, layout: WeightLayout = ONEDNN) -> int:
    """Pack every CPU linear of ``model`` that ``layout`` supports, fused projection groups whole; return how many.

    Quantized linears and groups (:mod:`patchbay.worker.cpu.quantization`) keep their integer products for few
    rows and run the packed float product above; row-split linears and groups are left alone.
    """
    shared = _shared_parameters(model)
    count = 0
    groups: set[int] = set()
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, Member):
            group = forward.group
            if id(group) in groups or not layout.supports(group.weight):
                continue
            groups.add(id(group))
            if group.product is F.linear:
                group.product = PackedGroupProduct(group, layout)
            elif isinstance(group.product, FusedIntegerProduct):
                packed = PackedGroupProduct(group, layout)
                group.product.use_float_product(packed, packed.weight)
            else:  # another path (row-split) chose its product
                continue
            count += len(group.linears)
        elif isinstance(module, nn.Linear) and layout.supports(module.weight):
            if forward is None:
                module.forward = PackedLinear(module, id(module.weight) in shared, layout)  # type: ignore[method-assign]
            elif isinstance(forward, IntegerLinear):
                forward.float_forward = PackedLinear(module, id(module.weight) in shared, layout)
            else:
                continue
            count += 1
    return count


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (tied embeddings)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, holders in seen.items() if holders > 1}
