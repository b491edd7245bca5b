"""The torch_sdpa backend's C++ decode kernel: against dense attention, in the engine, and when it cannot build."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import patchbay
from patchbay.plugins.attention import _cpu_kernel, torch_sdpa
from patchbay.sampling_params import SamplingParams
from tiny_models import transformers_greedy

pytestmark = pytest.mark.skipif(_cpu_kernel.kernel_unavailable() is not None,
                                reason=f"kernel cannot build here: {_cpu_kernel.kernel_unavailable()}")


@pytest.mark.parametrize("window", [0, 37])
def test_kernel_matches_dense_attention_over_the_gathered_blocks(window):
    generator = torch.Generator().manual_seed(0)
    num_reqs, heads, kv_heads, head_size, block_size, num_blocks = 7, 8, 2, 16, 4, 128
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=generator)
    seq_lens = torch.tensor([1, 3, 4, 5, 17, 40, 63], dtype=torch.int32)
    block_table = torch.randperm(num_blocks, generator=generator)[: num_reqs * 16].view(num_reqs, 16).to(torch.int32)
    rows = torch.tensor([6, 0, 3, 1, 5, 2, 4])  # queries sit in any row order
    query = torch.randn(num_reqs, heads, head_size, generator=generator)
    output = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    _cpu_kernel.load_kernel().paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, rows,
                                                     scale, window, output)
    for request in range(num_reqs):
        length = int(seq_lens[request])
        blocks = block_table[request, : -(-length // block_size)].long()
        first = max(0, length - window) if window else 0
        keys = key_cache[blocks].reshape(-1, kv_heads, head_size)[first:length].double()
        values = value_cache[blocks].reshape(-1, kv_heads, head_size)[first:length].double()
        row = int(rows[request])
        expected = F.scaled_dot_product_attention(
            query[row].double()[:, None], keys.transpose(0, 1), values.transpose(0, 1), scale=scale, enable_gqa=True)
        torch.testing.assert_close(output[row], expected[:, 0].float(), rtol=1e-5, atol=1e-5)


def test_an_explicit_kernel_that_cannot_build_is_an_error_naming_why(monkeypatch):
    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: "no C++ compiler (test)")
    with pytest.raises(RuntimeError, match="paged_cpp is unavailable: no C\\+\\+ compiler"):
        torch_sdpa.DecodeKernel("paged_cpp").get()


def test_auto_without_the_kernel_says_so_and_uses_sdpa(monkeypatch, caplog):
    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: "no C++ compiler (test)")
    with caplog.at_level(logging.WARNING):
        assert torch_sdpa.DecodeKernel("auto").get() is None
    assert "no C++ compiler (test)" in caplog.text


def test_greedy_tokens_are_the_same_with_the_kernel_and_with_sdpa(tiny_llama):
    prompts = [[5, 9, 11, 3, 7], list(range(20, 90)), [42], list(range(300, 333))]
    tokens = {}
    for choice in ("sdpa", "paged_cpp"):
        llm = patchbay.LLM(model__path=str(tiny_llama), attention__backend="torch_sdpa",
                           attention__options={"decode_kernel": choice}, cache__block_size=4)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        tokens[choice] = [o.token_ids for o in outputs]
    assert tokens["paged_cpp"] == tokens["sdpa"] == transformers_greedy(tiny_llama, prompts, 16)
