"""Weight-only int8: the products equal a float reference on the de-quantised weights; engines run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from patchbay.worker.quantization import Int8Linear, quantize_int8, quantize_linears_int8


def test_quantization_is_symmetric_per_row_and_within_half_a_step():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    quantized, scales = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (48,)
    assert quantized.abs().amax(dim=1).eq(127).all()  # each row's largest weight maps to +-127
    dequantized = quantized.float() * scales[:, None]
    assert (dequantized - weight).abs().le(scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_an_int8_linear_computes_the_product_with_the_dequantised_weight(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(64, 96, dtype=dtype)
    inputs = torch.randn(2, rows, 64, generator=generator).to(dtype)
    int8 = Int8Linear(linear, max_rows=32)
    got = int8(inputs)
    if rows * 2 > 32:  # above the limit the float weight runs
        torch.testing.assert_close(got, F.linear(inputs, linear.weight, linear.bias))
        return
    reference = F.linear(inputs.double(), (int8.qweight.double() * int8.scales.double()[:, None]),
                         linear.bias.double())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


def test_every_plain_linear_is_quantised_and_others_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[2].forward = lambda x: x  # a linear with a forward of its own (a fused projection, say)
    assert quantize_linears_int8(model) == 1
    assert isinstance(vars(model[0])["forward"], Int8Linear)


def test_an_engine_with_int8_weights_decodes_close_to_float(tiny_llama):
    import patchbay
    from patchbay.sampling_params import SamplingParams

    prompts = [list(range(10, 40)), [7, 8, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    float_run = patchbay.LLM(model__path=str(tiny_llama), model__dtype="bfloat16").generate(prompts, params)
    int8_llm = patchbay.LLM(model__path=str(tiny_llama), model__dtype="bfloat16", model__quantization="int8")
    assert int8_llm.engine.int8_linears > 0
    int8_run = int8_llm.generate(prompts, params)
    for float_output, int8_output in zip(float_run, int8_run, strict=True):
        assert len(int8_output.token_ids) == 8
        # The prefill step (33 rows) keeps float weights; only the LM head at the 2 sampled rows runs int8,
        # whose error (half a step per weight) does not flip this model's first choices.
        assert int8_output.token_ids[0] == float_output.token_ids[0]
