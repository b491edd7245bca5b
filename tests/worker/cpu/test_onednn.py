"""Linears over oneDNN-packed weights: torch's products (bit for bit in bfloat16), with the plain weights released."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.sampling_params import SamplingParams
from patchbay.worker.cpu.fused_projections import fuse_shared_input_projections
from patchbay.worker.cpu.onednn import PackedLinear, packed_linear, pack, packing_supported, use_packed_linears
from tiny_models import transformers_greedy

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="this torch cannot pack for oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (1, 3, 48), (2, 5, 48), (300, 48)])
def test_a_packed_product_is_torch_s_product(shape, bias, dtype):
    if not packing_supported(dtype):
        pytest.skip(f"no packed {dtype} products here")
    torch.manual_seed(0)
    linear = nn.Linear(48, 96, bias=bias, dtype=dtype)
    inputs = torch.randn(*shape, dtype=dtype)
    expected = F.linear(inputs, linear.weight, linear.bias)
    got = packed_linear(inputs, pack(linear.weight), linear.bias)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.bfloat16 and not bias:
        assert torch.equal(got, expected)  # the same oneDNN kernel, without the per-call reorder
    elif dtype == torch.bfloat16:
        # With a bias, torch's own call may take another oneDNN kernel (an Intel Xeon with AMX did from 10 rows):
        # the same products, each output at most one bfloat16 rounding step from torch's.
        steps = (got.detach().view(torch.int16).int() - expected.detach().view(torch.int16).int()).abs()
        assert steps.max() <= 1 and torch.equal(torch.sign(got), torch.sign(expected))
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Non-contiguous inputs (a slice of a wider tensor) are multiplied as their values.
    wide = torch.randn(5, 96, dtype=dtype)[:, ::2]
    torch.testing.assert_close(
        packed_linear(wide, pack(linear.weight), linear.bias), F.linear(wide, linear.weight, linear.bias)
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.o_proj = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied, as small language models do


def test_packing_releases_plain_weights_but_keeps_tied_ones():
    torch.manual_seed(0)
    block = _Block()
    inputs = torch.randn(3, 16)
    expected = {
        name: getattr(block, name)(inputs).detach() for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head")
    }
    other = torch.randn(2, 16)
    expected_other = block.k_proj(other).detach()
    assert fuse_shared_input_projections(block, max_rows=1 << 62) == 1
    assert use_packed_linears(block) == 5
    for name, want in expected.items():
        torch.testing.assert_close(getattr(block, name)(inputs), want, rtol=1e-5, atol=1e-5)
    # Plain weights live only packed now: same shape and dtype, no data; the tied head keeps the embedding's.
    assert all(getattr(block, name).weight.is_meta for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert block.q_proj.weight.shape == (16, 16) and block.q_proj.weight.dtype == torch.float32
    assert not block.embed.weight.is_meta and block.head.weight is block.embed.weight
    assert isinstance(vars(block.head)["forward"], PackedLinear)
    # A member asked alone (on another input) still gets its own projection, computed with the whole group.
    torch.testing.assert_close(block.k_proj(other), expected_other, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not packing_supported(torch.bfloat16),
    reason="this CPU cannot pack bfloat16 weights for oneDNN (as on AVX2-only CPUs)",
)
def test_quantized_linears_keep_integer_products_for_few_rows_and_run_packed_ones_above():
    from patchbay.worker.cpu.quantization import quantize_linears

    torch.manual_seed(0)
    block = _Block().to(torch.bfloat16)
    few, many = torch.randn(3, 16).to(torch.bfloat16), torch.randn(40, 16).to(torch.bfloat16)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "head")
    plain = {name: getattr(block, name)(many).detach() for name in names}
    assert fuse_shared_input_projections(block, max_rows=16) == 1
    quantize_linears(block, "int8")
    integer = {name: getattr(block, name)(few) for name in names}
    assert use_packed_linears(block) == 5
    assert block.q_proj.weight.is_meta and not block.embed.weight.is_meta
    for name in names:
        assert torch.equal(getattr(block, name)(few), integer[name])  # still the integer products
        assert torch.equal(getattr(block, name)(many), plain[name])  # packed bfloat16: torch's own products


def test_greedy_tokens_with_packed_linears_match_transformers(tiny_llama):
    prompts = [[5, 9, 11, 3, 7], list(range(20, 60)), [42]]
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2, runtime__linear_kernel="onednn")
    assert llm.engine.linear_paths.packed > 0 and llm.engine.linear_paths.fused_groups > 0
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] == transformers_greedy(tiny_llama, prompts, 12)


def test_bfloat16_logits_are_the_same_packed_or_not(tiny_llama):
    if not packing_supported(torch.bfloat16):
        pytest.skip("no packed bfloat16 products here")
    prompts = [list(range(20, 60)), [42, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    results = {}
    for kernel in ("torch", "onednn"):
        llm = patchbay.LLM(
            model__path=str(tiny_llama),
            model__dtype="bfloat16",
            runtime__linear_kernel=kernel,
            runtime__fuse_projections=False,
        )
        results[kernel] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert results["onednn"] == results["torch"]


def test_onednn_on_a_dtype_it_cannot_pack_is_refused_naming_the_setting(tiny_llama):
    with pytest.raises(ConfigError, match="runtime.linear_kernel"):
        patchbay.LLM(model__path=str(tiny_llama), model__dtype="float16", runtime__linear_kernel="onednn")


def test_row_counts_run_in_buckets_and_padding_never_shows():
    from patchbay.worker.cpu.onednn import row_bucket

    assert [row_bucket(rows) for rows in (1, 7, 16, 17, 32, 33, 256, 257, 320, 2000)] == [
        1,
        7,
        16,
        32,
        32,
        48,
        256,
        320,
        320,
        2048,
    ]
    assert len({row_bucket(rows) for rows in range(1, 2049)}) <= 16 + 15 + 28  # kernels built per weight shape
    torch.manual_seed(0)
    weight = torch.randn(24, 40)
    packed = pack(weight)
    for rows in (17, 33, 257):
        inputs = torch.randn(1, rows, 40)
        got = packed_linear(inputs, packed, None)
        assert got.shape == (1, rows, 24)
        torch.testing.assert_close(got, F.linear(inputs, weight), rtol=1e-5, atol=1e-5)
