"""W8A8 tiles: int8 weights per output row times activations rounded to int8 per row.  The products equal,
bit for bit, a torch reference built from the documented rounding (exact integer sums, then one scaling), and
engines whose decoder layers run fused over the tiles give the tokens of the same modules run one by one."""

from __future__ import annotations

import pytest
import torch

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.sampling_params import SamplingParams
from patchbay.plugins.attention._cpu_kernel import load_kernel as load_attention_kernel
from patchbay.worker import runner_build
from patchbay.toolkit import fused_ops
from patchbay.worker.cpu import fused_layer
from patchbay.toolkit.native_build import build_unavailable
from patchbay.worker.cpu.onednn import PackedLinear
from patchbay.worker.cpu.quantization import (
    W8A8TileLayout,
    quantize_int8,
    use_w8a8_amx_from,
    w8a8_amx_available,
    w8a8_tiles,
    w8a8_tiles_unavailable,
)
from patchbay.toolkit.tiles import load_tile_kernels

needs_w8a8 = pytest.mark.skipif(
    build_unavailable() is not None or w8a8_tiles_unavailable() is not None,
    reason=f"no W8A8 tiles here: {build_unavailable() or w8a8_tiles_unavailable()}",
)


def read_tiles(tiles: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(int8 weight [N, K], float32 scales [N], int32 offsets [N])`` read back from the documented layout."""
    count, lines, width = tiles.shape
    weights = tiles[:, : lines - 2].reshape(count, lines - 2, 16, 4).permute(0, 2, 1, 3).reshape(count * 16, -1)
    scales = tiles[:, lines - 2].contiguous().view(torch.float32).reshape(-1)
    offsets = tiles[:, lines - 1].contiguous().view(torch.int32).reshape(-1)
    return weights[:out_features], scales[:out_features], offsets[:out_features]


def test_the_tiles_hold_the_int8_weights_their_scales_and_offsets():
    weight = torch.randn(20, 36, generator=torch.Generator().manual_seed(0))  # a partial last tile of 16
    tiles = w8a8_tiles(weight)
    assert tiles.dtype == torch.int8 and tiles.shape == (2, 36 // 4 + 2, 64)
    levels, scales, offsets = read_tiles(tiles, 20)
    expected_levels, expected_scales = quantize_int8(weight)
    assert torch.equal(levels, expected_levels) and torch.equal(scales, expected_scales)
    assert torch.equal(offsets, 128 * expected_levels.sum(dim=1, dtype=torch.int32))
    assert not tiles[1, :, 4 * 4 :].any()  # lanes 4..15 of the last tile are padding: zero weights and scales


def w8a8_reference(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The product the kernel promises: each row rounded to int8 levels ``round(x * (127 / max|x|))`` (halves to
    even), exact integer sums with :func:`quantize_int8`'s weights, times ``max|x| / 127`` times the weight's
    scale plus the bias in one fused multiply-add (float64 holds the float32 product exactly), rounded to float32
    and then to the inputs' dtype."""
    levels, w_scales = quantize_int8(weight.float())
    x = inputs.float()
    top = x.abs().amax(dim=1)
    # A tensor divided by a tensor is IEEE's division; torch turns ``127.0 / top`` into a multiply by 1 / top.
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0)
    x_levels = torch.round(x * inverse[:, None])
    sums = x_levels.to(torch.int64) @ levels.to(torch.int64).T
    scales = (top / 127.0)[:, None] * w_scales[None, :]
    return (sums.double() * scales.double() + bias.double()).float().to(inputs.dtype)


@needs_w8a8
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_equals_the_int8_reference_bit_for_bit(rows, dtype):
    out_features, in_features = 200, 100  # 13 tiles (blocks of 4 and a remainder); 100 features: a partial register
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    inputs = torch.randn(rows, in_features, generator=generator).to(dtype)
    inputs[-1] = 0  # a row of zeros: scale 0, no division by it
    bias = torch.randn(out_features, generator=generator).to(dtype)
    got = load_tile_kernels().tiled_linear(inputs, w8a8_tiles(weight), bias, out_features, 2)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert torch.equal(got, w8a8_reference(inputs, weight, bias))
    assert not got[-1].sub(bias).any()


@needs_w8a8
def test_many_rows_quantized_over_the_helpers_give_the_same_bits():
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 128, generator=generator).bfloat16()
    inputs = torch.randn(70, 128, generator=generator).bfloat16()
    bias = torch.zeros(64, dtype=torch.bfloat16)
    tiles = w8a8_tiles(weight)
    together = load_tile_kernels().tiled_linear(inputs, tiles, None, 64, 2)
    one_by_one = torch.cat([load_tile_kernels().tiled_linear(row[None], tiles, None, 64, 1) for row in inputs])
    assert torch.equal(together, one_by_one)
    assert torch.equal(together, w8a8_reference(inputs, weight, bias))


@needs_w8a8
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 70])  # whole and partial 16-row slices, one or two at once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_through_amx_equal_the_int8_reference_bit_for_bit(rows, dtype):
    if not w8a8_amx_available():
        pytest.skip("W8A8 through AMX needs a CPU with AMX-INT8 (and Linux's leave to use it)")
    out_features, in_features = 200, 192  # 13 tiles: pairs of them and one alone; 3 blocks of 64 input features
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    inputs = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    tiles = w8a8_tiles(weight)
    previous = use_w8a8_amx_from(1)
    try:
        got = load_tile_kernels().tiled_linear(inputs, tiles, bias, out_features, 3)
        with pytest.raises(RuntimeError, match="row count of 0 or more"):
            use_w8a8_amx_from(-1)
    finally:
        use_w8a8_amx_from(previous)
    assert torch.equal(got, w8a8_reference(inputs, weight, bias))


@needs_w8a8
def test_amx_products_cut_into_passes_over_the_depth_equal_the_int8_reference():
    # One thread's ranges of 32 tiles of 1,088 features (548 KiB) outgrow a single pass: 17 operands in passes,
    # the tiles in groups of 16, and 300 rows in blocks of 256 and 44; the last range, 17 tiles, runs in one.
    if not w8a8_amx_available():
        pytest.skip("W8A8 through AMX needs a CPU with AMX-INT8 (and Linux's leave to use it)")
    out_features, in_features, rows = 3856, 1088, 300
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    inputs = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    tiles = w8a8_tiles(weight)
    previous = use_w8a8_amx_from(1)
    try:
        got = load_tile_kernels().tiled_linear(inputs, tiles, bias, out_features, 1)
    finally:
        use_w8a8_amx_from(previous)
    assert torch.equal(got, w8a8_reference(inputs, weight, bias))


@needs_w8a8
def test_the_layout_refuses_weights_it_cannot_hold():
    layout = W8A8TileLayout(threads=2)
    assert layout.supports(torch.randn(8, 64)) and layout.supports(torch.randn(8, 64).bfloat16())
    assert not layout.supports(torch.randn(8, 30))  # input features not in whole groups of 4
    assert not layout.supports(torch.randn(8, 64, dtype=torch.float64))


def w8a8_llm(model_dir, **settings) -> patchbay.LLM:
    fused_ops.load_fused_ops()
    load_attention_kernel()
    return patchbay.LLM(
        model__path=str(model_dir),
        model__dtype="bfloat16",
        model__weight_format={"name": "w8a8", "options": {"products": "tiles"}},
        **settings,
    )


@needs_w8a8
def test_a_w8a8_engine_runs_every_linear_and_whole_layers_over_w8a8_tiles(tiny_llama, monkeypatch):
    fused = w8a8_llm(tiny_llama)
    model = fused.engine.model.model
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    products = [vars(linear).get("forward") for linear in linears]
    assert any(isinstance(p, PackedLinear) and isinstance(p.layout, W8A8TileLayout) for p in products)
    assert fused.engine.quantized_linears == len(linears)
    assert fused.engine.fused_modules.layers == model.config.num_hidden_layers
    assert all(isinstance(vars(layer).get("forward"), fused_layer.FusedDecoderLayer) for layer in model.model.layers)

    prompts = [[5, 9, 11, 3, 7], list(range(20, 90)), [42]]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    with_layers = fused.generate(prompts, params)
    monkeypatch.setattr(runner_build, "use_fused_layers", lambda model: 0)
    modules_only = w8a8_llm(tiny_llama)
    assert modules_only.engine.fused_modules.layers == 0
    for a, b in zip(with_layers, modules_only.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_w8a8_on_a_cpu_without_vnni_is_a_config_error(tiny_llama, monkeypatch):
    monkeypatch.setattr(runner_build, "w8a8_tiles_unavailable", lambda: "W8A8 tiles need AVX512-VNNI (faked)")
    with pytest.raises(ConfigError) as raised:
        patchbay.LLM(
            model__path=str(tiny_llama),
            model__dtype="float32",
            model__weight_format={"name": "w8a8", "options": {"products": "tiles"}},
        )
    assert "model.weight_format" in str(raised.value) and "AVX512-VNNI (faked)" in str(raised.value)
