"""Linear products over weights stored in output tiles, at every row count where the tuning measured them fastest.

A decode step multiplies a handful of rows by every weight of the model, so its
products are bound by how fast the weights stream from memory, not by
arithmetic.  oneDNN's packed products (:mod:`patchbay.worker.cpu.onednn`)
reach about 24 GB/s on one core of the development machine (AMD EPYC, AVX-512
with AVX512-BF16) for one row; a loop that reads each weight once, in the order
it lies in memory, reaches about 41 GB/s on one core and 79 GB/s on two.

The weights are reordered once, at load, into tiles of output features whose
weights lie contiguously: bfloat16 in pairs of input features for AVX512-BF16's
pair dot product (``[N/16][K/2][16][2]``; on CPUs where that product is slow,
widened to float32 in registers instead, :data:`BFLOAT16_KERNELS`), float32 as ``[N/L][K][L]`` for L-lane
multiply-adds (AVX-512: 16, AVX2: 8), int8 weights
(:class:`patchbay.worker.cpu.quantization.TiledInt8Linear`) in float32's layout,
widened in registers and scaled per output feature, and int4 weights
(:class:`patchbay.worker.cpu.quantization.Int4TileLayout`) in tiles of 8 output
features, per 32 input features with their scales and minimums, multiplied as
bytes by activations rounded to int8; W8A8 weights
(:class:`patchbay.worker.cpu.quantization.W8A8TileLayout`) lie in tiles of 16
features, four input features per lane, with their scales at the tile's end.  The kernel computes blocks of up to six
rows by up to four tiles in registers (float32 accumulation, one rounding to the
output dtype), so many-row products reuse each tile from cache as well.

Two cores only pay on a product of tens of microseconds if the second one
starts at once: OpenMP's sleeping threads take longer to wake than that, and
its spinning ones make every product wait for a thread a busy neighbour has
descheduled.  So the products have their own helper threads (``ChunkPool``):
chunks of tiles are claimed from one counter by the caller and the helpers
alike, the caller never waits for a helper to start, and helpers spin only
briefly between products.  An idle helper prefetches into its L2 the weights
that followed the last product the time before, and takes its chunks from the
front, where it read ahead (the caller takes them from the back): through a
one-request decode's attention and Python the second core keeps streaming
weights.  Where the CPU has AMX, products of many rows run
through its tile product over the same tiles (bfloat16 and W8A8), from a row
count the tuning measures; whether tiles beat oneDNN on a machine is measured
there too (:mod:`patchbay.worker.cpu.tuning`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from patchbay.toolkit.native_build import CSRC, NATIVE_CFLAGS, NativeExtension, build_at_install

__all__ = [
    "BFLOAT16_KERNELS",
    "TileLayout",
    "TiledWeight",
    "bfloat16_amx_available",
    "bfloat16_products_widened",
    "chunk_runner",
    "chunk_threads",
    "load_tile_kernels",
    "note_tiles_in_use",
    "tile",
    "tiled_product_entry",
    "tiles_unavailable",
    "use_bfloat16_amx_from",
    "use_bfloat16_kernel",
    "use_bfloat16_pairs_up_to",
]

EXTENSION = NativeExtension("patchbay_tiles", (CSRC / "tiles.cpp", CSRC / "block_tiles.cpp"), NATIVE_CFLAGS)


@functools.cache
def load_tile_kernels() -> Any:
    """Build the extension (once per installation and CPU) and import it."""
    return EXTENSION.load()


def tile(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """``weight`` (``[N, K]``) reordered into output tiles: bfloat16 ``[N/16][K/2][16][2]``, float32
    ``[N/lanes][K][lanes]``; the last tile padded with zero weights."""
    weight = weight.detach()
    out_features, in_features = weight.shape
    if weight.dtype == torch.bfloat16:
        lanes = 16
    padded = F.pad(weight, (0, 0, 0, -out_features % lanes))
    if weight.dtype == torch.bfloat16:
        return padded.reshape(-1, lanes, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.reshape(-1, lanes, in_features).permute(0, 2, 1).contiguous()


_helper_threads = 0  # the most threads tiled products run on in this process; 0 until a weight is tiled


def note_tiles_in_use(threads: int) -> None:
    """Record that this process multiplies by tiled weights on ``threads`` threads (so :func:`chunk_runner`
    hands out the helpers and :func:`chunk_threads` says how many threads they make)."""
    global _helper_threads
    _helper_threads = max(_helper_threads, threads)


def chunk_runner() -> int:
    """The address of the product helpers' C entry point, for plugins' native kernels that run between a decode
    step's products (0: none, run over OpenMP).

    The function is ``void run(int threads, int64_t chunks, void (*work)(const void* context, int64_t chunk),
    const void* context)``: it calls ``work`` once for every chunk in ``[0, chunks)``, on the calling thread and
    up to ``threads - 1`` helpers, and returns when all are done; ``work`` must not throw.  It is non-zero once
    this process multiplies by tiled weights: then the helpers are awake between products, where OpenMP's
    sleeping threads would have to be woken and would then contend with them for the cores.
    """
    return load_tile_kernels().chunk_runner() if _helper_threads else 0


def chunk_threads() -> int:
    """How many threads to hand :func:`chunk_runner`'s function: as many as the tiled products run on (0 before
    any weight is tiled).  Not torch's thread count, which a step of a few tokens sets to one for its small ops:
    the helpers are awake all the same, so a kernel between the products gains the second core at no wake-up."""
    return _helper_threads


def tiled_product_entry() -> int:
    """The address of the tiled product for other extensions' kernels (the fused decoder layer's):
    ``void product(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor* bias, int64_t out_features,
    int64_t threads, at::Tensor& out)``, :func:`tiled_linear`'s arguments with its result stored in ``out``."""
    return load_tile_kernels().tiled_product()


@functools.cache
def tiles_unavailable(dtype: torch.dtype) -> str | None:
    """Why this machine cannot run tiled products of ``dtype`` (None: it can); builds the extension if needed."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"tiled products run on float32 or bfloat16, not {dtype}"
    try:
        kernels = load_tile_kernels()
    except (RuntimeError, OSError, ImportError) as error:
        return f"the tiled-product kernels could not be built: {error}"
    if dtype == torch.bfloat16 and not kernels.bfloat16_supported():
        return "tiled bfloat16 products need AVX512-BF16"
    if dtype == torch.float32 and not kernels.float32_lanes():
        return "tiled float32 products need AVX-512 or AVX2"
    return None


BFLOAT16_KERNELS = ("pairs", "fma")
"""How bfloat16 tiles multiply: ``pairs``, AVX512-BF16's pair dot product (``vdpbf16ps``, two multiply-adds per
lane and instruction); ``fma``, each weight widened to float32 in registers and multiplied by float32 FMA, for
CPUs that issue the pair product at under half their FMA rate.  Both sum exact products in float32; which runs
faster is measured per CPU (:mod:`patchbay.worker.cpu.tuning`)."""


_bfloat16_kernel = BFLOAT16_KERNELS[0]
_bfloat16_amx_from = 0


def use_bfloat16_kernel(name: str) -> str:
    """Multiply every bfloat16 tile of this process with kernel ``name`` (one of :data:`BFLOAT16_KERNELS`) from
    now on; returns the kernel that ran before.  Process-wide: the choice belongs to the CPU, not to one model."""
    global _bfloat16_kernel
    if name not in BFLOAT16_KERNELS:
        raise ValueError(f"bfloat16 tile kernels are {', '.join(BFLOAT16_KERNELS)}, not {name!r}")
    previous = str(load_tile_kernels().use_bfloat16_kernel(name))
    _bfloat16_kernel = name
    return previous


def use_bfloat16_pairs_up_to(rows: int) -> int:
    """Run products of at most ``rows`` rows through ``pairs`` even where the kernel is ``fma`` (0: none), from now
    on; returns the limit that held before.  At a row or two a product streams its weights, and the pair product
    reads them in fewer instructions; the tuning measures where that pays (process-wide, like the kernel)."""
    return int(load_tile_kernels().use_bfloat16_pairs_up_to(rows))


def bfloat16_amx_available() -> bool:
    """Whether bfloat16 tiles can run through AMX here: the kernels were built for a CPU with AMX-BF16 and
    Linux lets this process use its tile registers."""
    return tiles_unavailable(torch.bfloat16) is None and bool(load_tile_kernels().bfloat16_amx_supported())


def use_bfloat16_amx_from(rows: int) -> int:
    """Run bfloat16 tile products of at least ``rows`` rows through AMX's tile product (0: never), from now on,
    where :func:`bfloat16_amx_available`; returns the row count that held before.

    AMX multiplies 16 rows by
    16 features by 32 inputs per instruction, straight from the tiles' layout: far ahead of the kernels above
    once a product has enough rows to be bound by arithmetic, not by reading its weights.  Process-wide, like
    the kernel; the tuning measures from how many rows it pays."""
    global _bfloat16_amx_from
    previous = int(load_tile_kernels().use_bfloat16_amx_from(rows))
    _bfloat16_amx_from = rows
    return previous


def bfloat16_products_widened() -> bool:
    """Whether this process multiplies many-row bfloat16 products through float32 FMA: the kernel is ``fma`` (the
    tuning measured this CPU's bfloat16 dot products slower than widening) and no AMX takes those products, so
    other many-row bfloat16 products (attention over long chunks) may widen too."""
    return _bfloat16_kernel == "fma" and not (_bfloat16_amx_from and bfloat16_amx_available())


@dataclass(frozen=True)
class TiledWeight:
    """A weight in output tiles (:func:`tile`, or int4 blocks) and its shape (the last tile is padded)."""

    tiles: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype
    """The plain weight's dtype, which the product's inputs and outputs have (int4 tiles are bytes)."""

    @property
    def shape(self) -> tuple[int, int]:
        """The plain weight's shape, ``[out_features, in_features]``."""
        return self.out_features, self.in_features


class TileLayout:
    """Weights in output tiles, multiplied by the extension's kernel on ``threads`` threads (the calling thread
    and ``threads - 1`` helpers, whatever torch's thread count is when a product runs)."""

    name = "output tiles"

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def supports(self, weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu" or weight.dim() != 2 or tiles_unavailable(weight.dtype) is not None:
            return False
        return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0  # bfloat16 tiles pair input features

    def pack(self, weight: torch.Tensor) -> TiledWeight:
        note_tiles_in_use(self.threads)
        return TiledWeight(
            tile(weight, load_tile_kernels().float32_lanes()), weight.shape[0], weight.shape[1], weight.dtype
        )

    def product(self, inputs: torch.Tensor, packed: TiledWeight, bias: torch.Tensor | None) -> torch.Tensor:
        in_features = inputs.shape[-1]
        flat = inputs.reshape(-1, in_features)
        if flat.stride(-1) != 1 or flat.stride(0) % 2:
            flat = flat.contiguous()
        output = load_tile_kernels().tiled_linear(flat, packed.tiles, bias, packed.out_features, self.threads)
        return output.view(*inputs.shape[:-1], packed.out_features)


def main() -> int:
    """Build the kernels now (the Makefile runs this at install time); exit 0 also where they cannot be built."""
    return build_at_install(load_tile_kernels, "the tiled linear kernels", EXTENSION.build_directory)


if __name__ == "__main__":
    raise SystemExit(main())
