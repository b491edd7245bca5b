"""GGUF's quantized blocks as tiles the CPU multiplies by: no float copy, every bit of the file kept.

A GGUF file stores a weight ``[out_features, in_features]`` as rows of blocks
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 32 inputs each; the k-quants Q2_K to Q6_K:
super-blocks of 256).  :func:`pack_gguf` repacks those blocks, as
``gguf.GGUFReader`` maps them, into tiles of :data:`TILE_WIDTH` output
features: per block, the tile's levels interleaved four inputs to a 32-bit
lane, then its scales (layout: ``csrc/block_tiles.cpp``).  Every level and
scale bit is kept, so the tiles dequantize (:func:`dequantize`,
:func:`dequantize_rows`) to exactly what ``gguf.quants.dequantize`` gives for
the file's bytes; they take the file's bytes, or 2-4 % more for Q3_K, Q4_K
and Q5_K, whose 6-bit scales take a byte each.

The product (:func:`block_linear`) rounds the activations to int8 per 32
inputs (scale ``max|x| / 127``, as llama.cpp's Q8 activations), multiplies
them by the levels as bytes (AVX512-VNNI, or AVX2's byte pair product) and
scales each sub-block's integer sum once; the offsets of the formats with a
minimum use the integer sum of the rounded activations, as llama.cpp does.
So the result is the file's weights times the rounded activations up to
float32 summation.  It runs through the tiled products' dispatch
(``tiled_linear``), so a fused decoder layer whose products are block tiles
reaches it too.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from patchbay.toolkit.tiles import TiledWeight, load_tile_kernels

__all__ = [
    "BLOCK_FORMATS",
    "TILE_WIDTH",
    "BlockFormat",
    "BlockTiles",
    "block_format",
    "block_linear",
    "block_tiles_unavailable",
    "concatenate_outputs",
    "dequantize",
    "dequantize_rows",
    "pack_gguf",
    "slice_inputs",
    "slice_outputs",
    "tiled_weight",
]

TILE_WIDTH = 16
"""Output features per tile: one 512-bit register of int32 sums (two 256-bit ones with AVX2)."""


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF quantized type: its name, its ``ggml_type`` number, the inputs and bytes of one block in the
    file, and where in a block its float16 scales lie (d, and dmin or m)."""

    name: str
    ggml_type: int
    block_inputs: int
    block_bytes: int
    float16_at: tuple[int, ...]


BLOCK_FORMATS: dict[str, BlockFormat] = {
    format.name: format
    for format in (
        BlockFormat("Q4_0", 2, 32, 18, (0,)),
        BlockFormat("Q4_1", 3, 32, 20, (0, 2)),
        BlockFormat("Q5_0", 6, 32, 22, (0,)),
        BlockFormat("Q5_1", 7, 32, 24, (0, 2)),
        BlockFormat("Q8_0", 8, 32, 34, (0,)),
        BlockFormat("Q2_K", 10, 256, 84, (80, 82)),
        BlockFormat("Q3_K", 11, 256, 110, (108,)),
        BlockFormat("Q4_K", 12, 256, 144, (0, 2)),
        BlockFormat("Q5_K", 13, 256, 176, (0, 2)),
        BlockFormat("Q6_K", 14, 256, 210, (208,)),
    )
}
"""The GGUF types block tiles hold, by name (GGML's numbering and block sizes)."""


def block_format(ggml_type: str | int | Any) -> BlockFormat:
    """The format of a GGUF type given by name (``"Q4_K"``), number, or ``gguf.GGMLQuantizationType``; a
    ValueError names the type and the supported ones where block tiles cannot hold it."""
    name = getattr(ggml_type, "name", ggml_type)
    if isinstance(name, str) and name.upper() in BLOCK_FORMATS:
        return BLOCK_FORMATS[name.upper()]
    for format in BLOCK_FORMATS.values():
        if isinstance(name, int) and not isinstance(name, bool) and name == format.ggml_type:
            return format
    raise ValueError(
        f"block tiles do not hold the GGUF type {name!r}; they hold {', '.join(BLOCK_FORMATS)}"
        " (F32, F16 and BF16 tensors load as plain weights)"
    )


@dataclass(frozen=True)
class BlockTiles:
    """A weight ``[out_features, in_features]`` as block tiles: ``tiles`` is ``uint8 [ceil(out_features / 16),
    in_features / block_inputs, 16, bytes per lane and block]`` (the last tile padded with zero weights)."""

    tiles: torch.Tensor
    format: BlockFormat
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape, ``[out_features, in_features]``."""
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes the tiles take."""
        return self.tiles.numel()


@functools.cache
def block_tiles_unavailable() -> str | None:
    """Why this machine cannot multiply by block tiles (None: it can); builds the tiled kernels if needed."""
    try:
        kernels = load_tile_kernels()
    except (RuntimeError, OSError, ImportError) as error:
        return f"the tiled-product kernels could not be built: {error}"
    if not kernels.block_tiles_kernel():
        return "block tile products need AVX2 with FMA and F16C"
    return None


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def _raw_rows(raw_blocks: Any, format: BlockFormat, out_features: int, in_features: int, name: str) -> torch.Tensor:
    """The file's bytes as ``uint8 [out_features, row bytes]``, sharing their memory (a memory map stays one)."""
    where = f"{format.name} tensor {name!r} of shape [{out_features}, {in_features}]"
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"{where}: a weight needs at least one output and one input feature")
    if in_features % format.block_inputs:
        raise ValueError(
            f"{where}: {format.name} blocks hold {format.block_inputs} inputs, and {in_features} is no multiple of that"
        )
    array = np.asarray(raw_blocks)
    if array.dtype != np.uint8:
        raise ValueError(f"{where}: its blocks are raw bytes (numpy uint8), not {array.dtype}")
    row_bytes = in_features // format.block_inputs * format.block_bytes
    expected = out_features * row_bytes
    if array.size != expected:
        state = "truncated" if array.size < expected else "too long"
        raise ValueError(
            f"{where}: its blocks are {state}: {array.size} bytes where {out_features} rows of {row_bytes} bytes"
            f" ({expected}) were expected"
        )
    array = array.reshape(out_features, row_bytes)
    if array.strides[1] != 1:
        array = np.ascontiguousarray(array)
    with warnings.catch_warnings():
        # A read-only memory map: torch warns that writes would fail, and nothing here writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def pack_gguf(
    ggml_type: str | int | Any,
    raw_blocks: Any,
    out_features: int,
    in_features: int,
    *,
    name: str = "weight",
    threads: int | None = None,
) -> BlockTiles:
    """The GGUF tensor whose blocks are ``raw_blocks`` as block tiles.

    ``raw_blocks`` is the file's bytes for a weight ``[out_features, in_features]`` (GGUF lists the shape the
    other way round), as ``gguf.GGUFReader`` gives them in ``tensor.data``: ``uint8 [out_features, row bytes]``,
    typically a read-only memory map.  The blocks are read in place, tile by tile on ``threads`` threads (torch's
    count by default), into the tiles; nothing of the size of the weight but the tiles is allocated.  Errors name
    ``name``, the type and the shape: an unsupported type, inputs that do not divide into blocks, a buffer of the
    wrong size (a truncated file, or a mislabelled type or shape).
    """
    format = block_format(ggml_type)
    raw = _raw_rows(raw_blocks, format, out_features, in_features, name)
    tiles = load_tile_kernels().block_tiles_pack(raw, format.name, out_features, in_features, _threads(threads))
    return BlockTiles(tiles, format, out_features, in_features)


def block_linear(
    inputs: torch.Tensor, weight: BlockTiles, bias: torch.Tensor | None = None, *, threads: int | None = None
) -> torch.Tensor:
    """``inputs @ W.T + bias`` for ``inputs`` float32 or bfloat16 ``[..., in_features]``, in the inputs' dtype.

    Activations are rounded to int8 per 32 inputs (scale ``max|x| / 127``, halves to even) and multiplied by the
    levels as bytes, on ``threads`` threads (torch's count by default): the result is the file's weights times
    the rounded activations, summed in float32.
    """
    if inputs.shape[-1] != weight.in_features:
        raise ValueError(
            f"block_linear: inputs of {inputs.shape[-1]} features for a {weight.format.name} weight of shape "
            f"{list(weight.shape)}"
        )
    flat = inputs.reshape(-1, weight.in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    output = load_tile_kernels().tiled_linear(flat, weight.tiles, bias, weight.out_features, _threads(threads))
    return output.view(*inputs.shape[:-1], weight.out_features)


def dequantize_rows(
    weight: BlockTiles, row_ids: torch.Tensor | Sequence[int], *, threads: int | None = None
) -> torch.Tensor:
    """Output features ``row_ids`` of the weight as float32 ``[len(row_ids), in_features]``: each value exactly as
    ``gguf.quants.dequantize`` computes it from the file (an embedding lookup in a ``token_embd`` kept as tiles)."""
    ids = torch.as_tensor(row_ids, dtype=torch.int64).reshape(-1)
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < weight.out_features:
        outside = ids[(ids < 0) | (ids >= weight.out_features)][0]
        raise ValueError(
            f"dequantize_rows: row {int(outside)} of a {weight.format.name} weight of {weight.out_features} output "
            "features"
        )
    return load_tile_kernels().block_tiles_rows(weight.tiles, ids, weight.out_features, _threads(threads))


def dequantize(weight: BlockTiles, *, threads: int | None = None) -> torch.Tensor:
    """The whole weight as float32 ``[out_features, in_features]`` (for tests and references: a float copy)."""
    return dequantize_rows(weight, torch.arange(weight.out_features), threads=threads)


def slice_outputs(weight: BlockTiles, start: int, stop: int) -> BlockTiles:
    """Output features ``[start, stop)`` of the weight, a copy (a tensor-parallel rank's column shard).

    Tiles hold 16 features, so ``start`` must be a multiple of 16, and ``stop`` too unless it is the end.  (Slicing
    the file's rows before :func:`pack_gguf` gives the same tiles without packing the rest.)
    """
    where = f"slice_outputs: features [{start}, {stop}) of a {weight.format.name} weight of shape {list(weight.shape)}"
    if not 0 <= start < stop <= weight.out_features:
        raise ValueError(f"{where}: the range must be non-empty and within the weight")
    if start % TILE_WIDTH or (stop % TILE_WIDTH and stop != weight.out_features):
        raise ValueError(
            f"{where}: tiles hold {TILE_WIDTH} output features, so a slice starts at a multiple of {TILE_WIDTH} "
            f"and stops at one or at the end"
        )
    tiles = weight.tiles[start // TILE_WIDTH : -(-stop // TILE_WIDTH)].clone()
    return BlockTiles(tiles, weight.format, stop - start, weight.in_features)


def slice_inputs(weight: BlockTiles, start: int, stop: int) -> BlockTiles:
    """Input features ``[start, stop)`` of the weight, a copy (a tensor-parallel rank's row shard): both ends on
    block boundaries (32 inputs; 256 for the k-quants' super-blocks)."""
    block = weight.format.block_inputs
    where = f"slice_inputs: inputs [{start}, {stop}) of a {weight.format.name} weight of shape {list(weight.shape)}"
    if not 0 <= start < stop <= weight.in_features:
        raise ValueError(f"{where}: the range must be non-empty and within the weight")
    if start % block or stop % block:
        raise ValueError(
            f"{where}: {weight.format.name} blocks hold {block} inputs with one set of scales, so a slice starts and "
            f"stops at multiples of {block}"
        )
    tiles = weight.tiles[:, start // block : stop // block].contiguous()
    return BlockTiles(tiles, weight.format, weight.out_features, stop - start)


def concatenate_outputs(weights: Sequence[BlockTiles]) -> BlockTiles:
    """The weights stacked along their output features (a fused q/k/v or gate/up product): one format and one
    input size, and every weight but the last a whole number of tiles."""
    if not weights:
        raise ValueError("concatenate_outputs: no weights to concatenate")
    first = weights[0]
    for index, weight in enumerate(weights):
        if weight.format != first.format or weight.in_features != first.in_features:
            raise ValueError(
                f"concatenate_outputs: weight {index} is {weight.format.name} of {weight.in_features} inputs, weight 0 "
                f"{first.format.name} of {first.in_features}: one tile product takes one format and input size"
            )
        if index < len(weights) - 1 and weight.out_features % TILE_WIDTH:
            raise ValueError(
                f"concatenate_outputs: weight {index} has {weight.out_features} output features; all but the last "
                f"must fill whole tiles of {TILE_WIDTH}"
            )
    tiles = torch.cat([weight.tiles for weight in weights])
    return BlockTiles(tiles, first.format, sum(weight.out_features for weight in weights), first.in_features)


def tiled_weight(weight: BlockTiles, dtype: torch.dtype) -> TiledWeight:
    """The weight as a :class:`TiledWeight` whose products take and give ``dtype`` (float32 or bfloat16), for
    :class:`patchbay.toolkit.tiles.TileLayout`'s products and the fused decoder layer."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"block tile products take float32 or bfloat16 activations, not {dtype}")
    return TiledWeight(weight.tiles, weight.out_features, weight.in_features, dtype)
