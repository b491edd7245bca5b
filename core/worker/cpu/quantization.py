"""int8 and int4 weights with scales for the CPU's products, and int8 activations for W8A8.

A decode step reads every weight once for a handful of rows, so it is bound
by memory bandwidth: int8 weights halve the bytes of bfloat16 and quarter
those of float32. Where patchbay's tiled kernels run (AVX-512 or AVX2),
int8 weights lie in output tiles and are widened in registers on every
thread (:class:`TiledInt8Linear`); elsewhere torch's CPU kernel
(``aten._weight_int8pack_mm``, one thread) multiplies activations of the
model's dtype by int8 weights and per-row scales. Both are fast for few rows
(torch's, with bfloat16 activations, measured ~10x bfloat16 ``F.linear`` at
one row on an AVX512-BF16 CPU) and slow for many, so
steps of more than :data:`INT8_MAX_ROWS` rows (prefill chunks, large batches)
keep the float weight (``IntegerLinear.float_forward``, which oneDNN packing
replaces where it runs). int8 is symmetric per output row:
``scale = max|w_row| / 127``, ``q = round(w / scale)``. int4 (torch's
``aten._weight_int4pack_mm_for_cpu``) is asymmetric per group of
:data:`INT4_GROUP_SIZE` input features, the layout of llama.cpp's Q4_1:
``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15, ``scale = (max - min) / 15``
and ``zero = min + 8 * scale``; on weights de-quantised from a Q4_1 file, whose
blocks are the same 32-feature groups, it lands back on the file's own grid
wherever a block spans all 16 levels.

W8A8 (:class:`W8A8TileLayout`) keeps int8's weights for every step and rounds
each step's activations to int8 per row, so both sides multiply as bytes
(AVX512-VNNI) into exact integer sums.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchbay.worker.cpu.fused_projections import Member, SharedInputProjections
from patchbay.toolkit.tiles import (
    TiledWeight,
    TileLayout,
    load_tile_kernels,
    note_tiles_in_use,
    tile,
    tiles_unavailable,
)

INT8_MAX_ROWS = 16
"""Above this many rows the float weight runs (torch's int8 kernel falls behind its GEMM; measured at 8-64 rows)."""
INT4_GROUP_SIZE = 32
"""Input features sharing one int4 scale and zero point (Q4_1's block size)."""
SPLIT_MIN_WEIGHTS = 1 << 23
"""Integer products of at least this many weights (an LM head) run as one slice of output rows per thread: torch's
few-row integer kernels use one core, and for a small product handing slices to threads costs more than it saves."""


@functools.cache
def _slice_pool(threads: int) -> ThreadPoolExecutor:
    # torch ops release the GIL, so Python threads run the slices' products in parallel.
    return ThreadPoolExecutor(threads, thread_name_prefix="patchbay-int-slices")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight, per-row scales)`` with ``weight ~= q * scales[:, None]``, scales in the weight's dtype."""
    rows = weight.detach().float()
    scales = rows.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    quantized = torch.round(rows / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return quantized, scales.to(weight.dtype)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels 0..15 as int32 [out, in], scales_and_zeros [in / group, out, 2])`` with
    ``weight ~= (levels - 8) * scale + zero`` per group of ``group_size`` input features."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    levels = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    zeros = low + 8.0 * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return levels.view(out_features, in_features).to(torch.int32), scales_and_zeros


class IntegerLinear:
    """The forward of one ``nn.Linear`` with integer weights for steps of few rows, the float weight above.

    Subclasses quantize one slice of output rows (:meth:`quantize`) and multiply by it (:meth:`multiply`); a
    large weight is cut into one slice per thread, run in parallel and concatenated.
    """

    splits_over_threads = True
    """Whether a large weight is cut into one slice per thread (False: the product uses every thread itself)."""

    def __init__(self, linear: nn.Linear, max_rows: int) -> None:
        self.linear = linear
        self.max_rows = max_rows
        self.activation_dtype = linear.weight.dtype
        out_features = linear.out_features
        threads = self.threads = torch.get_num_threads()
        parts = (
            threads
            if (
                self.splits_over_threads
                and linear.weight.numel() >= SPLIT_MIN_WEIGHTS
                and out_features % (16 * threads) == 0
            )
            else 1
        )
        size = out_features // parts
        self.slices = [self.quantize(linear.weight[start : start + size]) for start in range(0, out_features, size)]
        self.float_forward: Callable[[torch.Tensor], torch.Tensor] = functools.partial(_float_product, linear)
        """The product for steps above ``max_rows`` rows: ``F.linear`` with the float weight, unless another
        float path (oneDNN packing, :mod:`patchbay.worker.cpu.onednn`) replaced it."""

    def quantize(self, weight: torch.Tensor) -> Any:
        """The integer form of ``weight`` (some output rows of the linear's weight)."""
        raise NotImplementedError

    def multiply(self, flat: torch.Tensor, quantized: Any) -> torch.Tensor:
        """``flat @ weight.T`` for one quantized slice, ``flat`` of ``[rows, in_features]``."""
        raise NotImplementedError

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat @ weight.T`` with the integer weights, every slice."""
        if len(self.slices) == 1:
            return self.multiply(flat, self.slices[0])
        pool = _slice_pool(len(self.slices))
        parts = [pool.submit(self.multiply, flat, quantized) for quantized in self.slices]
        return torch.cat([part.result() for part in parts], dim=-1)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        in_features, out_features = self.linear.in_features, self.linear.out_features
        rows = input.numel() // in_features
        if rows > self.max_rows or rows == 0 or input.dtype != self.activation_dtype:
            return self.float_forward(input)
        output = self.product(input.reshape(rows, in_features).contiguous()).view(*input.shape[:-1], out_features)
        return output if self.linear.bias is None else output + self.linear.bias


def _float_product(linear: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    return F.linear(inputs, linear.weight, linear.bias)


class Int4Linear(IntegerLinear):
    """int4 weights in groups of :data:`INT4_GROUP_SIZE` (see :func:`quantize_int4`)."""

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        levels, scales_and_zeros = quantize_int4(weight, INT4_GROUP_SIZE)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        return packed, scales_and_zeros.to(weight.dtype)

    def multiply(self, flat: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        packed, scales_and_zeros = quantized
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, INT4_GROUP_SIZE, scales_and_zeros)


class Int8Linear(IntegerLinear):
    """int8 weights with one scale per output row (see :func:`quantize_int8`)."""

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(weight)

    def multiply(self, flat: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, *quantized)


class TiledInt8Linear(Int8Linear):
    """int8 weights in output tiles, multiplied by patchbay's tiled kernel (:mod:`patchbay.toolkit.tiles`)
    on all the threads there were at load: the weights widen to float32 in registers, so a decode step reads one
    byte per weight and keeps both cores busy, where torch's int8 kernel runs on one."""

    splits_over_threads = False

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quantized, scales = quantize_int8(weight)
        lanes = load_tile_kernels().float32_lanes()
        return tile(quantized, lanes), F.pad(scales.float(), (0, -len(scales) % lanes))

    def multiply(self, flat: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tiles, scales = quantized
        return load_tile_kernels().tiled_int8_linear(flat, tiles, scales, self.linear.out_features, self.threads)


def int4_tiles_unavailable() -> str | None:
    """Why this machine cannot run int4 tiles (None: it can); builds the tiled kernels if needed."""
    reason = tiles_unavailable(torch.float32)
    if reason is not None:
        return reason
    if not load_tile_kernels().int4_block_bytes():
        return "int4 tiles need AVX2 with FMA and F16C"
    return None


INT4_LANES = 8
"""Output features per int4 tile (one 256-bit register of int32 sums)."""


def int4_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[N, K]``, K a multiple of :data:`INT4_GROUP_SIZE`) as the tiled kernel's int4 blocks.

    Each group of 32 input features of one output feature gets ``scale = (max - min) / 15`` and ``min``, both
    rounded to float16 (Q4_1 stores the same pair), and levels ``round((w - min) / scale)`` in 0..15.  The result
    is ``uint8 [N / 8][K / 32][160]``: per tile of 8 output features and group, four steps of 32 bytes (byte
    ``4i + j`` of step ``s``: feature ``8s + j`` of lane ``i`` in the low nibble, ``8s + 4 + j`` in the high one),
    then the lanes' scales, then their minimums.
    """
    out_features, in_features = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -out_features % INT4_LANES))
    tiles, groups = padded.shape[0] // INT4_LANES, in_features // INT4_GROUP_SIZE
    values = padded.view(tiles, INT4_LANES, groups, INT4_GROUP_SIZE)
    low, high = values.amin(dim=-1), values.amax(dim=-1)
    scales, minimums = ((high - low) / 15.0).half(), low.half()
    divisors = scales.float().clamp(min=torch.finfo(torch.float16).tiny)
    levels = torch.round((values - minimums.float()[..., None]) / divisors[..., None]).clamp(0, 15).to(torch.uint8)
    halves = levels.view(tiles, INT4_LANES, groups, 4, 2, 4)  # [tile, lane, group, step, half, j]
    steps = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, step, lane, j]
    blocks = torch.cat(
        [
            steps.reshape(tiles, groups, -1),
            scales.transpose(1, 2).contiguous().view(torch.uint8),
            minimums.transpose(1, 2).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )
    return blocks.contiguous()


def dequantize_int4_tiles(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight ``[out_features, K]`` that :func:`int4_tiles` blocks stand for."""
    count, groups, _ = tiles.shape
    steps = tiles[..., : 16 * INT4_LANES].reshape(count, groups, 4, INT4_LANES, 4)
    halves = torch.stack([steps & 15, steps >> 4], dim=3)  # [tile, group, step, half, lane, j]
    levels = halves.permute(0, 4, 1, 2, 3, 5).reshape(count, INT4_LANES, groups, INT4_GROUP_SIZE).float()
    scales = tiles[..., 16 * INT4_LANES : 18 * INT4_LANES].contiguous().view(torch.float16).float()
    minimums = tiles[..., 18 * INT4_LANES :].contiguous().view(torch.float16).float()  # [tile, group, lane]
    weights = levels * scales.transpose(1, 2)[..., None] + minimums.transpose(1, 2)[..., None]
    return weights.reshape(count * INT4_LANES, groups * INT4_GROUP_SIZE)[:out_features]


class Int4TileLayout(TileLayout):
    """int4 weights in the tiled kernel's blocks (:func:`int4_tiles`), every step on ``threads`` threads.

    A decode step reads 5 bits per weight (levels, plus a float16 scale and minimum per 32), a sixth of
    float32's bytes.  Activations are rounded to int8 per group of 32 (as llama.cpp rounds them for Q4_1) and
    multiplied by the levels as bytes, 64 weights per instruction pair, so prefill runs on the int4 weights too:
    no float copy is kept.
    As a tile layout, decoder layers whose products are int4 tiles still run fused
    (:mod:`patchbay.worker.cpu.fused_layer`).
    """

    name = "int4 output tiles"

    def supports(self, weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.shape[1] % INT4_GROUP_SIZE == 0
            and int4_tiles_unavailable() is None
            and bool(weight.detach().abs().amax() < torch.finfo(torch.float16).max)
        )

    def pack(self, weight: torch.Tensor) -> TiledWeight:
        note_tiles_in_use(self.threads)
        return TiledWeight(int4_tiles(weight), weight.shape[0], weight.shape[1], weight.dtype)


def w8a8_tiles_unavailable() -> str | None:
    """Why this machine cannot run W8A8 tiles (None: it can); builds the tiled kernels if needed."""
    reason = tiles_unavailable(torch.float32)
    if reason is not None:
        return reason
    if not load_tile_kernels().w8a8_lanes():
        return "W8A8 tiles need AVX512-VNNI and AVX512-BW (this CPU lacks them; int8 weights alone run here)"
    return None


def w8a8_amx_available() -> bool:
    """Whether W8A8 tiles can run through AMX here: the kernels were built for a CPU with AMX-INT8 and Linux
    lets this process use its tile registers."""
    return w8a8_tiles_unavailable() is None and bool(load_tile_kernels().w8a8_amx_supported())


def use_w8a8_amx_from(rows: int) -> int:
    """Run W8A8 products of at least ``rows`` rows through AMX's byte product (0: never), from now on, where
    :func:`w8a8_amx_available`; returns the row count that held before.  AMX reads the tiles as they lie and
    sums the same bytes exactly, so its outputs equal VNNI's; it multiplies 16 rows at a time, so it pays once
    a product has enough rows.  Process-wide; the tuning measures from how many rows."""
    return int(load_tile_kernels().use_w8a8_amx_from(rows))


def rounds_activations_to_int8(scheme: str) -> bool:
    """Whether every product under quantization ``scheme`` runs this machine's integer tiles, which round each
    product's activations to int8 themselves: the model's dtype then leaves the products' speed unchanged."""
    unavailable = {"w8a8": w8a8_tiles_unavailable, "int4": int4_tiles_unavailable}.get(scheme)
    return unavailable is not None and unavailable() is None


W8A8_LANES = 16
"""Output features per W8A8 tile (one 512-bit register of int32 sums)."""


def w8a8_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[N, K]``, K a multiple of 4) as the tiled kernel's W8A8 tiles: ``int8 [N/16][K/4 + 2][64]``.

    The weights are :func:`quantize_int8`'s (symmetric, one float32 scale per output feature).  Line ``q`` of a
    tile holds input features ``4q..4q+3`` of its 16 features (byte ``4i + j``: feature ``4q + j`` of lane
    ``i``); then come the lanes' float32 scales and their int32 offsets, 128 times each lane's weight sum, which
    the kernel subtracts because it adds 128 to the activations' int8 levels to multiply them as unsigned bytes.
    """
    out_features, in_features = weight.shape
    quantized, scales = quantize_int8(weight.detach().float())
    padding = -out_features % W8A8_LANES
    quantized = F.pad(quantized, (0, 0, 0, padding))
    scales = F.pad(scales, (0, padding))
    tiles = quantized.shape[0] // W8A8_LANES
    lines = quantized.view(tiles, W8A8_LANES, in_features // 4, 4).permute(0, 2, 1, 3).reshape(tiles, -1, 64)
    offsets = (128 * quantized.sum(dim=1, dtype=torch.int32)).view(tiles, 1, W8A8_LANES)
    tail = torch.cat([scales.view(tiles, 1, W8A8_LANES).view(torch.int8), offsets.view(torch.int8)], dim=1)
    return torch.cat([lines, tail], dim=1).contiguous()


class W8A8TileLayout(TileLayout):
    """int8 weights (:func:`w8a8_tiles`) times activations rounded to int8 per row, every step on ``threads``
    threads.

    A decode step reads one byte per weight, and a many-row step multiplies 64 byte pairs per AVX512-VNNI
    instruction, twice the pairs of bfloat16's dot product, with exact int32 sums scaled once per output.  No
    float copy is kept.  As a tile layout, decoder layers whose products are W8A8 tiles still run fused.
    """

    name = "W8A8 output tiles"

    def supports(self, weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.shape[1] % 4 == 0
            and weight.shape[1] < 1 << 16
            and w8a8_tiles_unavailable() is None
        )

    def pack(self, weight: torch.Tensor) -> TiledWeight:
        note_tiles_in_use(self.threads)
        return TiledWeight(w8a8_tiles(weight), weight.shape[0], weight.shape[1], weight.dtype)


def integer_linear_class(scheme: str) -> type[IntegerLinear]:
    """The integer forward for ``scheme``: int8 over tiles where the tiled kernel runs here, else torch's kernels."""
    if scheme == "int8" and tiles_unavailable(torch.float32) is None:
        return TiledInt8Linear
    return QUANTIZED_LINEARS[scheme]


QUANTIZED_LINEARS: dict[str, type[IntegerLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


class FusedIntegerProduct:
    """A fused projection group's product: integer weights for the group's concatenated weight, float otherwise."""

    def __init__(self, group: SharedInputProjections, scheme: str, max_rows: int) -> None:
        weight = group.weight
        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=group.bias is not None, device="meta")
        holder.weight = nn.Parameter(weight, requires_grad=False)
        if group.bias is not None:
            holder.bias = nn.Parameter(group.bias, requires_grad=False)
        self.weight = weight
        self.integer = integer_linear_class(scheme)(holder, max_rows)
        self.fallback = group.product

    def __call__(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.integer(inputs) if weight is self.weight else self.fallback(inputs, weight, bias)

    def use_float_product(self, product: Callable[..., torch.Tensor], weight: torch.Tensor) -> None:
        """Run steps above the integer row limit through ``product`` over ``weight`` (the group's new weight)."""
        bias = self.integer.linear.bias
        self.weight = weight
        self.fallback = product
        self.integer.float_forward = lambda inputs: product(inputs, weight, bias)


def _packable(weight: torch.Tensor, scheme: str) -> bool:
    """int4 needs whole input groups and output rows in multiples of 16 (torch's packing); int8 takes any."""
    out_features, in_features = weight.shape
    return weight.device.type == "cpu" and (
        scheme != "int4" or (in_features % INT4_GROUP_SIZE == 0 and out_features % 16 == 0)
    )


def quantize_linears(model: nn.Module, scheme: str, max_rows: int = INT8_MAX_ROWS) -> int:
    """Give every CPU ``nn.Linear`` of ``model`` (the LM head included) the integer forward of ``scheme``.

    Returns how many.  Fused q/k/v and gate/up groups (:mod:`patchbay.worker.cpu.fused_projections`) get one integer
    product over their concatenated weight, computed whole for steps of up to ``max_rows`` rows.  Other linears
    with a forward of their own, and (for int4) weights whose input size does not split into groups or whose
    output size is not a multiple of 16 (torch's packing), are left alone.
    """
    linear_class = integer_linear_class(scheme)
    count = 0
    groups: set[int] = set()
    for module in model.modules():
        member = vars(module).get("forward")
        if isinstance(member, Member) and id(member.group) not in groups and _packable(member.group.weight, scheme):
            # q/k/v or gate/up fused into one product: one integer product over the concatenated weight.
            groups.add(id(member.group))
            member.group.product = FusedIntegerProduct(member.group, scheme, max_rows)
            member.group.max_rows = max(member.group.max_rows, max_rows)
            count += len(member.group.linears)
            continue
        if not isinstance(module, nn.Linear) or "forward" in vars(module) or module.weight.device.type != "cpu":
            continue
        if not _packable(module.weight, scheme):
            continue
        module.forward = linear_class(module, max_rows)  # type: ignore[method-assign]
        count += 1
    return count
