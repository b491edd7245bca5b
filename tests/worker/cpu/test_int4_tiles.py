"""int4 weights in the tiled kernel's blocks: the Q4_1 grid kept exactly, products equal to a float64 reference
built from the grid itself, and engines whose decoder layers still run fused over them."""

from __future__ import annotations

import pytest
import torch

import patchbay
from patchbay.sampling_params import SamplingParams
from patchbay.plugins.attention._cpu_kernel import load_kernel as load_attention_kernel
from patchbay.worker import runner_build
from patchbay.toolkit import fused_ops
from patchbay.worker.cpu import fused_layer
from patchbay.toolkit.native_build import build_unavailable
from patchbay.worker.cpu.onednn import PackedLinear
from patchbay.worker.cpu.quantization import Int4TileLayout, dequantize_int4_tiles, int4_tiles, int4_tiles_unavailable
from patchbay.toolkit.tiles import load_tile_kernels

pytestmark = pytest.mark.skipif(
    build_unavailable() is not None or int4_tiles_unavailable() is not None,
    reason=f"no int4 tiles here: {build_unavailable() or int4_tiles_unavailable()}",
)


def q4_1_grid(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(levels, scales, minimums)`` of a weight on Q4_1's grid: each 32-wide group spans levels 0..15, its scale
    and minimum are float16 values (as a Q4_1 file stores them)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    levels = torch.randint(0, 16, (out_features, groups, 32), generator=generator)
    levels[..., 3], levels[..., 17] = 0, 15
    scales = (torch.rand(out_features, groups, generator=generator) * 0.01 + 1e-3).half().float()
    minimums = (torch.randn(out_features, groups, generator=generator) * 0.05).half().float()
    return levels, scales, minimums


def grid_weight(levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    return (levels * scales[..., None] + minimums[..., None]).reshape(levels.shape[0], -1)


def test_a_weight_on_the_q4_1_grid_is_kept_exactly():
    levels, scales, minimums = q4_1_grid(20, 96, seed=0)  # 20 outputs: a partial last tile of 8
    weight = grid_weight(levels, scales, minimums)
    tiles = int4_tiles(weight)
    assert tiles.dtype == torch.uint8 and tiles.shape == (3, 3, load_tile_kernels().int4_block_bytes())
    assert tiles.numel() * 8 == 24 * 96 * 5  # five bits per weight, padding included
    torch.testing.assert_close(dequantize_int4_tiles(tiles, 20), weight, rtol=0, atol=0)


def test_any_weight_lands_within_half_a_step_of_its_group():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    dequantized = dequantize_int4_tiles(int4_tiles(weight), 16)
    groups = weight.view(16, 2, 32)
    step = (groups.amax(dim=-1) - groups.amin(dim=-1)) / 15
    error = (dequantized - weight).view(16, 2, 32).abs().amax(dim=-1)
    assert (error <= step * 0.5 + step * 2e-3 + 1e-4).all()  # half a step, and float16's rounding of the pair


def int8_activations_reference(
    inputs: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The product the kernel promises, in float64: activations rounded to int8 per group of 32 (scale
    ``max|x| / 127``, halves to even), times ``level * scale``, plus ``minimum`` times the group's exact sum."""
    rows, in_features = inputs.shape
    groups = inputs.double().view(rows, in_features // 32, 32)
    x_scales = groups.abs().amax(dim=-1, keepdim=True) / 127
    rounded = torch.round(groups / torch.where(x_scales > 0, x_scales, 1)) * x_scales
    scaled = levels.double() * scales.double()[..., None]  # [out, groups, 32]
    sums = torch.einsum("rgk,ogk->ro", rounded, scaled)
    return sums + groups.sum(dim=-1) @ minimums.double().T + bias.double()


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_int8_activations_times_the_grid(rows, dtype):
    out_features, in_features = 200, 128  # 25 tiles: blocks of 4 tiles and a remainder, over several chunks
    levels, scales, minimums = q4_1_grid(out_features, in_features, seed=rows)
    tiles = int4_tiles(grid_weight(levels, scales, minimums))
    generator = torch.Generator().manual_seed(100 + rows)
    inputs = torch.randn(rows, in_features, generator=generator).to(dtype)
    inputs[0, 32:64] = 0  # a group of zeros: scale 0, no division by it
    bias = torch.randn(out_features, generator=generator).to(dtype)
    got = load_tile_kernels().tiled_linear(inputs, tiles, bias, out_features, 2)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    reference = int8_activations_reference(inputs, levels, scales, minimums, bias)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


def test_the_layout_refuses_weights_it_cannot_hold():
    layout = Int4TileLayout(threads=2)
    assert layout.supports(torch.randn(8, 64))
    assert not layout.supports(torch.randn(8, 48))  # input features not in whole groups of 32
    assert not layout.supports(torch.full((8, 64), 1e6))  # beyond float16's range for the scales
    assert not layout.supports(torch.randn(8, 64, dtype=torch.float64))


def int4_llm(model_dir, **settings) -> patchbay.LLM:
    # Both kernels loaded, so every step runs them: an early step attended by SDPA rounds differently, and int8
    # activations can turn such a last-bit difference into a different level.
    fused_ops.load_fused_ops()
    load_attention_kernel()
    return patchbay.LLM(
        model__path=str(model_dir),
        model__dtype="float32",
        model__weight_format={"name": "int4", "options": {"products": "tiles"}},
        **settings,
    )


def test_an_int4_engine_runs_every_linear_and_whole_layers_over_int4_tiles(tiny_llama, monkeypatch):
    fused = int4_llm(tiny_llama)
    model = fused.engine.model.model
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    products = [vars(linear).get("forward") for linear in linears]
    # q/k/v and gate/up each run as one group product; o_proj, down_proj and the LM head as int4 linears
    assert all(isinstance(p, PackedLinear) for p in products if not hasattr(p, "group"))
    assert any(isinstance(p, PackedLinear) and isinstance(p.layout, Int4TileLayout) for p in products)
    assert fused.engine.quantized_linears == len(linears)
    layers = model.config.num_hidden_layers
    assert fused.engine.fused_modules.layers == layers
    assert all(isinstance(vars(layer).get("forward"), fused_layer.FusedDecoderLayer) for layer in model.model.layers)

    prompts = [[5, 9, 11, 3, 7], list(range(20, 90)), [42]]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    with_layers = fused.generate(prompts, params)
    # The fused layers run the modules' kernels in their order: the same tokens and log-probabilities.
    monkeypatch.setattr(runner_build, "use_fused_layers", lambda model: 0)
    modules_only = int4_llm(tiny_llama)
    assert modules_only.engine.fused_modules.layers == 0
    without_layers = modules_only.generate(prompts, params)
    for a, b in zip(with_layers, without_layers, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
