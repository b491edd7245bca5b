"""Weight-only int8 and int4: products equal a float reference on the de-quantised weights; engines run them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from patchbay.worker.cpu.quantization import (
    Int4Linear,
    Int8Linear,
    TiledInt8Linear,
    int4_tiles_unavailable,
    integer_linear_class,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)
from patchbay.toolkit.tiles import tiles_unavailable

TILED = [
    pytest.param(
        TiledInt8Linear,
        marks=pytest.mark.skipif(tiles_unavailable(torch.float32) is not None, reason="no tiled kernels here"),
    )
]


def test_int8_is_symmetric_per_row_and_within_half_a_step():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    quantized, scales = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (48,)
    assert quantized.abs().amax(dim=1).eq(127).all()  # each row's largest weight maps to +-127
    dequantized = quantized.float() * scales[:, None]
    assert (dequantized - weight).abs().le(scales[:, None] / 2 + 1e-7).all()


def test_int4_groups_reproduce_a_q4_1_grid_exactly():
    # Weights already on a Q4_1-style grid (levels 0..15 spanning each 32-wide group): re-quantising recovers them.
    generator = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (8, 64), generator=generator)
    levels[:, 0], levels[:, 1], levels[:, 32], levels[:, 33] = 0, 15, 0, 15
    scale = torch.rand(8, 2, generator=generator) + 0.1
    minimum = torch.randn(8, 2, generator=generator)
    weight = (levels.view(8, 2, 32) * scale[..., None] + minimum[..., None]).view(8, 64)
    got_levels, scales_and_zeros = quantize_int4(weight)
    assert torch.equal(got_levels, levels.to(torch.int32))
    scales, zeros = scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()
    dequantized = ((got_levels.view(8, 2, 32) - 8) * scales[..., None] + zeros[..., None]).view(8, 64)
    torch.testing.assert_close(dequantized, weight)


def _dequantised(module) -> torch.Tensor:
    if isinstance(module, Int8Linear):
        quantized, scales = quantize_int8(module.linear.weight)
        return quantized.double() * scales.double()[:, None]
    levels, scales_and_zeros = quantize_int4(module.linear.weight)
    scales, zeros = scales_and_zeros[..., 0].t().double(), scales_and_zeros[..., 1].t().double()
    out_features, in_features = levels.shape
    return ((levels.double().view(out_features, -1, 32) - 8) * scales[..., None] + zeros[..., None]).view(
        out_features, in_features
    )


@pytest.mark.parametrize("linear_class", [Int8Linear, Int4Linear, *TILED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_an_integer_linear_computes_the_product_with_the_dequantised_weight(linear_class, dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(64, 96, dtype=dtype)
    inputs = torch.randn(2, rows, 64, generator=generator).to(dtype)
    module = linear_class(linear, max_rows=32)
    got = module(inputs)
    if rows * 2 > 32:  # above the limit the float weight runs
        torch.testing.assert_close(got, F.linear(inputs, linear.weight, linear.bias))
        return
    reference = F.linear(inputs.double(), _dequantised(module), linear.bias.double())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("linear_class", [Int8Linear, Int4Linear])
def test_a_large_weight_runs_as_slices_over_the_threads_with_the_same_result(linear_class, monkeypatch):
    from patchbay.worker.cpu import quantization

    linear = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    inputs = torch.randn(3, 64).to(torch.bfloat16)
    whole = linear_class(linear, max_rows=16)
    monkeypatch.setattr(quantization, "SPLIT_MIN_WEIGHTS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    sliced = linear_class(linear, max_rows=16)
    assert len(whole.slices) == 1 and len(sliced.slices) == 2
    torch.testing.assert_close(sliced(inputs), whole(inputs), rtol=0, atol=0)


@pytest.mark.parametrize("linear_class", TILED)
def test_tiled_int8_is_chosen_where_it_runs_and_keeps_one_slice_over_all_threads(linear_class, monkeypatch):
    from patchbay.worker.cpu import quantization

    assert integer_linear_class("int8") is linear_class and integer_linear_class("int4") is Int4Linear
    monkeypatch.setattr(quantization, "SPLIT_MIN_WEIGHTS", 1)
    linear = nn.Linear(64, 200, bias=False, dtype=torch.bfloat16)  # 200 outputs: a partial last tile
    module = linear_class(linear, max_rows=16)
    assert len(module.slices) == 1  # the kernel spreads one product over the threads itself
    inputs = torch.randn(3, 64).to(torch.bfloat16)
    reference = F.linear(inputs.double(), _dequantised(module), None)
    torch.testing.assert_close(module(inputs).double(), reference, rtol=3e-2, atol=3e-2)


def test_every_plain_linear_is_quantised_and_others_are_left_alone():
    model = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(64, 4))
    model[3].forward = lambda x: x  # a linear with a forward of its own (a fused projection, say)
    assert quantize_linears(model, "int8") == 2
    assert isinstance(vars(model[0])["forward"], integer_linear_class("int8"))
    fresh = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 32), nn.Linear(64, 8))
    # 16 input features do not split into groups of 32; 8 outputs do not pack into torch's int4 layout
    assert quantize_linears(fresh, "int4") == 1


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_an_engine_with_integer_weights_runs_them_in_decode_steps(tiny_llama, scheme):
    import patchbay
    from patchbay.sampling_params import SamplingParams

    if scheme == "int4" and int4_tiles_unavailable() is None:
        pytest.skip("int4 runs over int4 tiles here (tests/worker/cpu/test_int4_tiles.py)")
    prompts = [list(range(10, 40)), [7, 8, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        model__dtype="bfloat16",
        model__weight_format=({"name": scheme, "options": {"products": "tiles"}} if scheme == "int4" else scheme),
    )
    assert llm.engine.quantized_linears > 0
    calls = []
    linear = next(
        m for m in llm.engine.model.model.modules() if isinstance(vars(m).get("forward"), Int8Linear | Int4Linear)
    )
    product = vars(linear)["forward"].product
    vars(linear)["forward"].product = lambda flat: calls.append(flat.shape[0]) or product(flat)
    outputs = llm.generate(prompts, params)
    # Decode steps (2 rows) go through the integer weights, the 33-row prefill through the float ones; the
    # products themselves are checked above, their effect on the real model's text by `patchbay bench`.
    assert calls and max(calls) <= 16
    assert [len(output.token_ids) for output in outputs] == [8, 8]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_projections_run_one_integer_product_over_their_concatenated_weight(scheme):
    from patchbay.worker.cpu.fused_projections import fuse_shared_input_projections

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (
                nn.Linear(64, width, bias=False, dtype=torch.bfloat16) for width in (64, 32, 32)
            )

    layer = Attention()
    inputs = torch.randn(1, 2, 64).to(torch.bfloat16)
    separate = Attention()
    separate.load_state_dict(layer.state_dict())
    assert fuse_shared_input_projections(layer, max_rows=1) == 1
    assert quantize_linears(layer, scheme) == 3
    quantize_linears(separate, scheme)
    group = vars(layer.q_proj)["forward"].group
    assert group.max_rows == 16  # quantization widens the fused steps to the integer path's limit
    calls = []
    integer = group.product.integer
    original = integer.product
    integer.product = lambda flat: calls.append(flat.shape) or original(flat)
    fused_outputs = [layer.q_proj(inputs), layer.k_proj(inputs), layer.v_proj(inputs)]
    assert calls == [torch.Size([2, 64])]  # one product for the three projections
    # Each projection's rows were quantized on their own (per row, or per row's groups): the same numbers.
    for got, linear in zip(fused_outputs, (separate.q_proj, separate.k_proj, separate.v_proj), strict=True):
        torch.testing.assert_close(got, linear(inputs), rtol=1e-2, atol=1e-2)
