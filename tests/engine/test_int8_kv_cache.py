"""The int8 KV cache (``cache.dtype: int8``): its row format, the pool it buys, and an engine that uses it.

The attention backends' numerics with int8 caches are the conformance suite's (``test_int8_cache*`` in
tests/plugins/attention/test_attention_backends.py, against the dense oracle over the rows the cache holds);
the C++ kernel's are in tests/plugins/attention/test_int8_kv_kernel.py.
"""

from __future__ import annotations

import pytest
import torch

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.interfaces.int8_kv import SCALE_BYTES, row_size
from patchbay.toolkit.int8_kv import dequantize_rows, quantize_rows, row_scales
from patchbay.scheduling.kv_cache_spec import KVCacheSpec, cache_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_each_feature_to_its_rows_127_levels(dtype):
    generator = torch.Generator().manual_seed(0)
    rows = (torch.randn(50, 3, 64, generator=generator) * torch.rand(50, 3, 1, generator=generator) * 8).to(dtype)
    rows[7, 1] = 0.0
    cache_rows = quantize_rows(rows)
    assert cache_rows.dtype == torch.int8 and cache_rows.shape == (50, 3, 64 + SCALE_BYTES)
    exact = rows.double()
    scale = exact.abs().amax(-1) / 127
    torch.testing.assert_close(row_scales(cache_rows).double(), scale, rtol=1e-6, atol=0.0)
    levels = cache_rows[..., :64].double()
    assert levels.abs().max() == 127  # each nonzero row's largest feature takes the top level
    nonzero = scale > 0
    want = (exact[nonzero] / scale[nonzero, None]).round()
    assert (levels[nonzero] - want).abs().max() <= 1  # float32 division may land a tie on the other side
    error = (dequantize_rows(cache_rows).double() - exact).abs()
    assert (error <= scale[..., None] * 0.5 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(cache_rows[7, 1], torch.zeros(64 + SCALE_BYTES, dtype=torch.int8))
    assert dequantize_rows(cache_rows, dtype).dtype == dtype


def test_a_zeroed_block_reads_as_zeros_and_rows_on_the_grid_are_kept_exactly():
    assert torch.equal(dequantize_rows(torch.zeros(2, 16, 4, 68, dtype=torch.int8)), torch.zeros(2, 16, 4, 64))
    rows = quantize_rows(torch.randn(30, 2, 64, generator=torch.Generator().manual_seed(1)))
    again = quantize_rows(dequantize_rows(rows))
    assert (again[..., :64].int() - rows[..., :64].int()).abs().max() <= 1
    torch.testing.assert_close(row_scales(again), row_scales(rows), rtol=1e-6, atol=0.0)


def test_an_int8_block_takes_the_rows_features_and_scales():
    assert row_size(64, "int8") == 68 and row_size(64, "float32") == 64 and row_size(64, None) == 64
    assert cache_dtype("auto", "bfloat16") == "bfloat16" and cache_dtype("int8", "float32") == "int8"
    float32 = KVCacheSpec(16, 3, 64, "float32")
    int8 = KVCacheSpec(16, 3, 64, "int8")
    assert int8.row_size == 68 and float32.row_size == 64
    assert int8.page_size_bytes == 2 * 16 * 3 * 68
    assert float32.page_size_bytes / int8.page_size_bytes == pytest.approx(256 / 68)


def test_a_backend_without_int8_caches_is_refused_by_name(tiny_llama):
    with pytest.raises(ConfigError, match=r"attention.name \(plugin attention:flex\): int8 KV cache not supported"):
        patchbay.LLM(model__path=str(tiny_llama), attention__name="flex", cache__dtype="int8")


@pytest.fixture(scope="module")
def engines(shared_engines):
    """SmolLM2 in float32 with a float32 cache and with an int8 one, on the same pool budget."""
    with shared_engines.loans(__name__) as borrow:
        common = {"runtime__threads": 2, "model__dtype": "float32", "cache__memory": "384MiB"}
        yield borrow(**common), borrow(**common, cache__dtype="int8")


TEXT = (
    "The river rose through the night, and by morning the lower streets of the town were under water. "
    "Boats moved between the houses, carrying bread and blankets to the families who had stayed upstairs. "
    "Nobody could remember a flood like it, although the oldest people spoke of one their grandparents saw."
)


def test_an_int8_cache_holds_about_four_times_the_blocks_in_keys_and_values_rounded_to_int8(engines):
    float_llm, int8_llm = engines
    float_engine, int8_engine = float_llm.engine, int8_llm.engine
    caches = int8_engine.runner.kv_caches
    assert {cache.dtype for cache in caches.values()} == {torch.int8}
    assert int8_engine.num_blocks >= 3.7 * float_engine.num_blocks


def test_int8_cache_log_probs_stay_near_float32s_and_greedy_text_follows_it(engines):
    float_llm, int8_llm = engines
    params = patchbay.SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=0)
    prompts = [TEXT, "The capital of France is", "def fibonacci(n):"]
    want, got = float_llm.generate(prompts, params), int8_llm.generate(prompts, params)
    # Teacher-forced: each prompt token's log-prob given the same prefix (the prompt's keys come from the cache
    # for every token after the first chunk's).
    float_lp = _prompt_log_probs(want[0])
    int8_lp = _prompt_log_probs(got[0])
    difference = (torch.tensor(int8_lp) - torch.tensor(float_lp)).abs()
    # Measured on SmolLM2-135M: mean 0.043, largest 0.26 (a key scale off by 10 % moves them several times more).
    assert difference.mean() < 0.08 and difference.max() < 0.5, (float(difference.mean()), float(difference.max()))
    for reference, output in zip(want, got, strict=True):
        assert output.token_ids[:12] == reference.token_ids[:12]


def _prompt_log_probs(output) -> list[float]:
    """The log-prob of each prompt token after the first, as the engine scored it."""
    entries = output.prompt_logprobs[1:]
    assert [entry.token_ids[0] for entry in entries] == output.prompt_token_ids[1:]
    return [entry.logprobs[0] for entry in entries]


def test_int8_tokens_do_not_depend_on_which_path_attends(tiny_llama):
    """SDPA prefills a prompt from its fresh keys, the C++ kernel from the cache: with an int8 cache both must
    attend the keys rounded (the first steps of an engine run SDPA while the kernel loads)."""
    prompts = [[1000 + 7 * i + j for j in range(40 + 30 * i)] for i in range(3)]
    params = patchbay.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for kernel in ("sdpa", "paged_cpp"):
        llm = patchbay.LLM(
            model__path=str(tiny_llama),
            attention__name="torch_sdpa",
            attention__options__decode_kernel=kernel,
            cache__dtype="int8",
            runtime__threads=2,
        )
        outputs[kernel] = [output.token_ids for output in llm.generate(prompts, params)]
        llm.engine.close()
    assert outputs["sdpa"] == outputs["paged_cpp"]
