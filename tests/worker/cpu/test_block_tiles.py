"""GGUF blocks as tiles: dequantized exactly as the ``gguf`` package dequantizes the file, products equal to a
float64 product of those weights and the int8-rounded activations, rows, shards, the bundled file, the AVX2 path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from patchbay.toolkit import block_tiles, fused_ops
from patchbay.toolkit import tiles as streaming_linear
from patchbay.toolkit.block_tiles import (
    BLOCK_FORMATS,
    TILE_WIDTH,
    block_format,
    block_linear,
    concatenate_outputs,
    dequantize,
    dequantize_rows,
    pack_gguf,
    slice_inputs,
    slice_outputs,
    tiled_weight,
)
from patchbay.toolkit.native_build import build_unavailable
from patchbay.toolkit.tiles import TileLayout, load_tile_kernels
from patchbay.toolkit.model_files import bundled_gguf

pytestmark = pytest.mark.skipif(
    build_unavailable() is not None or block_tiles.block_tiles_unavailable() is not None,
    reason=f"no block tiles here: {build_unavailable() or block_tiles.block_tiles_unavailable()}",
)

FORMATS = list(BLOCK_FORMATS)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""The types the gguf package quantizes itself; the k-quants' blocks are made of random bytes."""


def gguf_blocks(name: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Valid blocks of a ``[out_features, in_features]`` GGUF tensor of type ``name``, as GGUFReader maps them."""
    rng = np.random.default_rng(seed)
    if name in QUANTIZABLE:
        weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
        weight[:, :32] *= 40  # one block of large weights per row: scales of different sizes
        return gguf_quantize(weight, GGMLQuantizationType[name])
    format = BLOCK_FORMATS[name]
    blocks = rng.integers(0, 256, (out_features, in_features // format.block_inputs, format.block_bytes), np.uint8)
    for at in format.float16_at:  # random bytes there could be inf or NaN
        scales = (rng.standard_normal(blocks.shape[:2]) * 1e-2).astype(np.float16)
        blocks[..., at : at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)


def uniform_blocks(name: str, out_features: int, in_features: int, byte: int) -> np.ndarray:
    """Blocks of one repeated byte (0x00: every level 0; 0xFF: every level at its top; Q8_0's 0x80: -128), with
    float16 scales of 0.5."""
    format = BLOCK_FORMATS[name]
    blocks = np.full((out_features, in_features // format.block_inputs, format.block_bytes), byte, np.uint8)
    for at in format.float16_at:
        blocks[..., at : at + 2] = np.array([0.5], np.float16).view(np.uint8)
    return blocks.reshape(out_features, -1)


def shape_for(name: str) -> tuple[int, int]:
    """40 outputs (two whole tiles and a half one) by two k-quant super-blocks or five legacy blocks."""
    return 40, 512 if BLOCK_FORMATS[name].block_inputs == 256 else 160


def reference_weight(name: str, raw: np.ndarray) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[name])


def rounded_activations(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, scales)`` as llama.cpp's Q8 activations, in float32: per 32 inputs ``scale = max|x| / 127`` and
    ``levels = round(x * (127 / max|x|))``, halves to even; float64 ``[rows, K]`` and ``[rows, K]`` (scales
    repeated over their group)."""
    rows, in_features = inputs.shape
    groups = inputs.float().view(rows, in_features // 32, 32)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(127.0) / largest, torch.zeros(()))
    levels = torch.round(groups * inverse)
    scales = (largest / 127).expand_as(groups)
    return levels.reshape(rows, -1).double(), scales.reshape(rows, -1).double()


def test_the_formats_are_gguf_s():
    for name, format in BLOCK_FORMATS.items():
        ggml = GGMLQuantizationType[name]
        assert format.ggml_type == ggml.value
        assert (format.block_inputs, format.block_bytes) == gguf.GGML_QUANT_SIZES[ggml]
    kernels = [(name, inputs, file_bytes) for name, inputs, file_bytes, _ in load_tile_kernels().block_tile_formats()]
    assert kernels == [(f.name, f.block_inputs, f.block_bytes) for f in BLOCK_FORMATS.values()]
    assert block_format(GGMLQuantizationType.Q4_K) is block_format("q4_k") is block_format(12) is BLOCK_FORMATS["Q4_K"]


@pytest.mark.parametrize("name", FORMATS)
def test_the_tiles_dequantize_to_gguf_s_weights_bit_for_bit(name):
    out_features, in_features = shape_for(name)
    raw = gguf_blocks(name, out_features, in_features, seed=1)
    weight = pack_gguf(name, raw, out_features, in_features)
    assert weight.tiles.dtype == torch.uint8 and weight.tiles.shape[:3] == (
        3,
        in_features // BLOCK_FORMATS[name].block_inputs,
        TILE_WIDTH,
    )
    expected = reference_weight(name, raw)
    got = dequantize(weight).numpy()
    assert got.shape == expected.shape and np.isfinite(expected).all()
    np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))
    # Every bit kept in at most 5 % more bytes than the file (the last tile's padding aside).
    assert weight.tiles[:2].numel() <= 1.05 * raw[:32].nbytes


@pytest.mark.parametrize("name", FORMATS)
def test_levels_at_their_extremes_survive_packing(name):
    in_features = BLOCK_FORMATS[name].block_inputs
    for byte in (0x00, 0xFF, 0x80):
        raw = uniform_blocks(name, 16, in_features, byte)
        np.testing.assert_array_equal(
            dequantize(pack_gguf(name, raw, 16, in_features)).numpy(), reference_weight(name, raw)
        )


def product_tolerances(
    weight: np.ndarray, inputs: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(exact, tight, loose)``: the float64 product of the weights and the rounded activations plus the bias;
    its tolerance, float32 summation (1e-5 of the sum of the terms' magnitudes) and, for bfloat16 inputs, the
    output's rounding; and the tolerance against the plain activations, each of which rounding moves by at most
    half its group's step."""
    levels, scales = rounded_activations(inputs)
    w = torch.from_numpy(weight).double()
    exact = (levels * scales) @ w.T
    if bias is not None:
        exact = exact + bias.double()
    tight = 1e-5 * ((levels * scales).abs() @ w.abs().T) + 1e-30
    if inputs.dtype == torch.bfloat16:
        tight = tight + exact.abs() * 2**-8
    loose = tight + (scales / 2) @ w.abs().T
    return exact, tight, loose


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_file_s_weights_times_int8_activations(name, rows, dtype):
    out_features, in_features = shape_for(name)
    raw = gguf_blocks(name, out_features, in_features, seed=rows)
    weight = pack_gguf(name, raw, out_features, in_features)
    generator = torch.Generator().manual_seed(rows)
    inputs = torch.randn(rows, in_features, generator=generator).to(dtype)
    inputs[0, 32:64] = 0  # a group of zeros: scale 0, no division by it
    bias = torch.randn(out_features, generator=generator).to(dtype) if rows % 2 else None
    got = block_linear(inputs, weight, bias, threads=2)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    exact, tight, loose = product_tolerances(reference_weight(name, raw), inputs, bias)
    error = (got.double() - exact).abs()
    assert (error <= tight).all(), f"{name}: {(error / tight).max():.3g} times the float32 summation tolerance"
    plain = inputs.double() @ torch.from_numpy(reference_weight(name, raw)).double().T
    if bias is not None:
        plain = plain + bias.double()
    assert ((got.double() - plain).abs() <= loose).all()


def test_the_product_takes_any_leading_shape_and_refuses_other_input_sizes():
    raw = gguf_blocks("Q4_K", 32, 256, seed=0)
    weight = pack_gguf("Q4_K", raw, 32, 256)
    inputs = torch.randn(2, 3, 256)
    torch.testing.assert_close(block_linear(inputs, weight), block_linear(inputs.view(6, 256), weight).view(2, 3, 32))
    with pytest.raises(ValueError, match="inputs of 128 features for a Q4_K weight of shape \\[32, 256\\]"):
        block_linear(torch.randn(1, 128), weight)


def test_tile_layout_products_and_the_tiled_product_dispatch_reach_block_tiles():
    raw = gguf_blocks("Q6_K", 48, 256, seed=2)
    weight = pack_gguf("Q6_K", raw, 48, 256)
    inputs = torch.randn(5, 256).bfloat16()
    expected = block_linear(inputs, weight, threads=2)
    assert torch.equal(TileLayout(threads=2).product(inputs, tiled_weight(weight, torch.bfloat16), None), expected)
    assert torch.equal(load_tile_kernels().tiled_linear(inputs, weight.tiles, None, 48, 1), expected)


def test_a_fused_decoder_layer_multiplies_by_block_tiles():
    """The fused layer's C++ reaches its products through tiled_product_entry(): block tiles run there as here."""
    ops = fused_ops.load_fused_ops()
    rows, width, intermediate = 3, 256, 512
    o_proj = pack_gguf("Q4_K", gguf_blocks("Q4_K", width, width, seed=3), width, width)
    gate_up = pack_gguf("Q4_K", gguf_blocks("Q4_K", 2 * intermediate, width, seed=4), 2 * intermediate, width)
    down = pack_gguf("Q6_K", gguf_blocks("Q6_K", width, intermediate, seed=5), width, intermediate)
    generator = torch.Generator().manual_seed(6)
    hidden, attended = torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)
    norm_weight = 1 + 0.1 * torch.randn(width, generator=generator)

    def normed(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rms_norm(x, norm_weight, 1e-5, out)
        return out

    residual = hidden + block_linear(attended, o_proj, threads=2)
    activated = torch.empty(rows, intermediate)
    ops.silu_and_mul(block_linear(normed(residual), gate_up, threads=2), activated)
    expected = residual + block_linear(activated, down, threads=2)
    got = ops.decoder_attention_output_and_mlp(
        streaming_linear.tiled_product_entry(),
        0,
        attended,
        hidden,
        o_proj.tiles,
        None,
        norm_weight,
        1e-5,
        gate_up.tiles,
        None,
        intermediate,
        down.tiles,
        None,
        2,
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["Q8_0", "Q3_K"])
def test_rows_come_back_as_gguf_reads_them(name):
    out_features, in_features = shape_for(name)
    raw = gguf_blocks(name, out_features, in_features, seed=7)
    weight = pack_gguf(name, raw, out_features, in_features)
    ids = [39, 0, 17, 17, 32, 5]
    expected = reference_weight(name, raw)[ids]
    np.testing.assert_array_equal(dequantize_rows(weight, ids).numpy().view(np.int32), expected.view(np.int32))
    many = torch.randint(0, out_features, (100,), generator=torch.Generator().manual_seed(0))  # over the pool
    np.testing.assert_array_equal(dequantize_rows(weight, many, threads=2).numpy(), reference_weight(name, raw)[many])
    assert dequantize_rows(weight, []).shape == (0, in_features)
    with pytest.raises(ValueError, match="row 40 of a .* weight of 40 output features"):
        dequantize_rows(weight, [40])


@pytest.mark.parametrize("name", ["Q4_0", "Q5_K"])
def test_shards_recombine_into_the_whole(name):
    out_features, in_features = 40, 1024 if name == "Q5_K" else 256
    raw = gguf_blocks(name, out_features, in_features, seed=8)
    weight = pack_gguf(name, raw, out_features, in_features)
    whole = reference_weight(name, raw)
    # By output features, at tile boundaries (a column-parallel rank's shard), and stacked back.
    parts = [slice_outputs(weight, 0, 16), slice_outputs(weight, 16, 32), slice_outputs(weight, 32, 40)]
    assert [part.out_features for part in parts] == [16, 16, 8]
    np.testing.assert_array_equal(dequantize(parts[2]).numpy(), whole[32:])
    assert torch.equal(concatenate_outputs(parts).tiles, weight.tiles)
    assert torch.equal(pack_gguf(name, raw[16:32], 16, in_features).tiles, parts[1].tiles)
    # By input features, at block boundaries (a row-parallel rank's shard): each rank's partial products add up.
    half = in_features // 2
    left, right = slice_inputs(weight, 0, half), slice_inputs(weight, half, in_features)
    np.testing.assert_array_equal(dequantize(right).numpy(), whole[:, half:])
    inputs = torch.randn(4, in_features)
    summed = block_linear(inputs[:, :half], left) + block_linear(inputs[:, half:], right)
    torch.testing.assert_close(summed, block_linear(inputs, weight), rtol=1e-5, atol=1e-4)


def test_shards_that_cut_a_tile_or_a_block_are_refused_saying_why():
    weight = pack_gguf("Q4_K", gguf_blocks("Q4_K", 40, 512, seed=9), 40, 512)
    with pytest.raises(ValueError, match="tiles hold 16 output features"):
        slice_outputs(weight, 8, 40)
    with pytest.raises(ValueError, match="tiles hold 16 output features"):
        slice_outputs(weight, 0, 24)
    with pytest.raises(ValueError, match="non-empty and within"):
        slice_outputs(weight, 32, 48)
    with pytest.raises(ValueError, match="Q4_K blocks hold 256 inputs with one set of scales"):
        slice_inputs(weight, 0, 128)
    with pytest.raises(ValueError, match="weight 0 has 40 output features; all but the last must fill whole tiles"):
        concatenate_outputs([weight, weight])
    other = pack_gguf("Q6_K", gguf_blocks("Q6_K", 16, 512, seed=9), 16, 512)
    with pytest.raises(ValueError, match="weight 1 is Q6_K of 512 inputs, weight 0 Q4_K of 512"):
        concatenate_outputs([slice_outputs(weight, 0, 16), other])


def test_bad_tensors_are_refused_naming_tensor_type_and_shape():
    raw = gguf_blocks("Q4_K", 16, 512, seed=10)
    with pytest.raises(ValueError, match="do not hold the GGUF type 'IQ2_XXS'.*Q4_0, Q4_1"):
        pack_gguf(GGMLQuantizationType.IQ2_XXS, raw, 16, 512)
    with pytest.raises(ValueError, match="do not hold the GGUF type 'F16'"):
        pack_gguf("F16", raw, 16, 512)
    with pytest.raises(
        ValueError, match="Q4_K tensor 'blk.0.attn_q.weight' of shape \\[16, 500\\]: Q4_K blocks hold 256"
    ):
        pack_gguf("Q4_K", raw, 16, 500, name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="truncated: 4464 bytes where 16 rows of 288 bytes \\(4608\\) were expected"):
        pack_gguf("Q4_K", raw.reshape(-1)[:-144], 16, 512)
    with pytest.raises(ValueError, match="too long"):
        pack_gguf("Q4_K", raw, 8, 512)  # a mislabelled shape
    with pytest.raises(ValueError, match="raw bytes \\(numpy uint8\\), not float32"):
        pack_gguf("Q4_K", raw.view(np.float32), 16, 512)
    with pytest.raises(ValueError, match="tile products take float32 or bfloat16"):
        tiled_weight(pack_gguf("Q4_K", raw, 16, 512), torch.float16)


@pytest.mark.slow
def test_every_tensor_of_the_bundled_gguf_file_packs_losslessly():
    """SmolLM2-135M-Instruct as shipped: Q4_1 linears and a Q8_0 token embedding (the tied LM head)."""
    reader = gguf.GGUFReader(bundled_gguf())
    packed = 0
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_FORMATS:
            continue
        in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the innermost dimension first
        weight = pack_gguf(tensor.tensor_type, tensor.data, out_features, in_features, name=tensor.name)
        assert weight.tiles.numel() <= -(-out_features // TILE_WIDTH) * TILE_WIDTH * tensor.data.shape[1]
        expected = gguf_dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(dequantize(weight).numpy().view(np.int32), expected.view(np.int32))
        packed += 1
        if tensor.name in ("blk.0.ffn_down.weight", "token_embd.weight"):
            inputs = torch.randn(3, in_features)
            exact, tight, _ = product_tolerances(expected, inputs)
            assert ((block_linear(inputs, weight).double() - exact).abs() <= tight).all()
    assert packed == 211


@pytest.mark.slow
def test_the_avx2_build_multiplies_like_the_reference():
    """CPUs without AVX-512 multiply as bytes with vpmaddubsw (pairs widened before int16 overflows, Q8_0 as signed
    bytes); built here with AVX-512 turned off, and run at the levels that would overflow."""
    try:
        kernels = streaming_linear.EXTENSION.without_avx512().load()
    except RuntimeError as error:
        pytest.skip(f"no AVX2 build here: {error}")
    assert kernels.block_tiles_kernel() in ("avx2", "avx2-vnni")
    for name in FORMATS:
        out_features, in_features = shape_for(name)
        top = uniform_blocks(name, 16, in_features, 0x80 if name == "Q8_0" else 0xFF)  # levels at their extremes
        for raw, rows in ((gguf_blocks(name, out_features, in_features, seed=11), 5), (top, 1), (top, 6)):
            weight = pack_gguf(name, raw, raw.shape[0], in_features)
            inputs = torch.randn(rows, in_features)
            inputs[0] = 1.0  # every activation at +127
            got = kernels.tiled_linear(inputs, weight.tiles, None, raw.shape[0], 2)
            exact, tight, _ = product_tolerances(reference_weight(name, raw), inputs)
            assert ((got.double() - exact).abs() <= tight).all(), name
