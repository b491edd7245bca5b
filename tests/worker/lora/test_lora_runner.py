"""LoRA in the engine: one batch mixing three adapters and base requests gives PEFT's own greedy tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from lora_adapters import ADAPTER_SPECS, make_peft_adapter, peft_greedy

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import ConfigError, Settings

NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(tiny_llama, folder / name, seed=index, **spec)
        for index, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(25)
    return [[rng.randrange(1, 2000) for _ in range(length)] for length in (5, 19, 33, 8, 26, 12, 40, 3)]


def _llm(tiny_llama: Path, adapters: dict[str, Path], **lora) -> patchbay.LLM:
    settings = Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime={"threads": 2},
        cache={"block_size": 16},
        scheduler={"max_num_batched_tokens": 64},
        lora={"adapters": {name: str(path) for name, path in adapters.items()}, "max_lora_rank": 8, **lora},
    )
    return patchbay.LLM(settings)


def _expected(tiny_llama, adapters, prompts, names, num_tokens=NUM_NEW_TOKENS):
    found = {}
    for name in set(names):
        chosen = [p for p, n in zip(prompts, names, strict=True) if n == name]
        found[name] = iter(peft_greedy(tiny_llama, adapters.get(name) if name else None, chosen, num_tokens))
    return [next(found[name]) for name in names]


NAMES = [None, "attn-r4", "mlp-r8", "all-r2-rslora", "attn-r4", None, "all-r2-rslora", "mlp-r8"]


@pytest.mark.slow
@pytest.mark.parametrize("max_loras", [3, 2])
def test_a_mixed_batch_gives_peft_s_tokens_for_every_adapter_and_the_base(tiny_llama, adapters, prompts, max_loras):
    """Three adapters (ranks 4, 8, 2; attention, MLP, all targets; rslora) and base requests in one batch;
    with max_loras 2 the scheduler holds one adapter's requests back and the slots are reused."""
    llm = _llm(tiny_llama, adapters, max_loras=max_loras, max_cpu_loras=max_loras)
    params = [SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, lora=name) for name in NAMES]
    outputs = llm.generate(prompts, params)
    expected = _expected(tiny_llama, adapters, prompts, NAMES)
    base = _expected(tiny_llama, adapters, prompts, [None] * len(NAMES))
    for name, output, want, plain in zip(NAMES, outputs, expected, base, strict=True):
        assert output.token_ids == want, name
        if name is not None:
            assert want != plain, f"{name} must change the greedy tokens, or this test proves little"


@pytest.mark.slow
def test_adapters_stay_exact_through_the_fused_cpu_ops(tiny_llama, adapters, prompts):
    """The fused norms, rotary and SiLU stay on with a lora: section; they must call the wrapped projections."""
    from patchbay.toolkit.fused_ops import FusedOpsBuild

    if FusedOpsBuild.shared().wait(timeout=600) is None:
        pytest.skip("the fused CPU kernels cannot be built here")
    llm = _llm(tiny_llama, adapters)
    fused = llm.engine.fused_modules
    assert fused.mlps > 0 and fused.attentions > 0 and fused.layers == 0, fused
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, lora=n) for n in NAMES])
    assert [o.token_ids for o in outputs] == _expected(tiny_llama, adapters, prompts, NAMES)


@pytest.mark.slow
def test_the_prefix_cache_never_shares_blocks_between_adapters(tiny_llama, adapters, prompts):
    llm = _llm(tiny_llama, adapters)
    prompt = prompts[6]  # 40 tokens: two full blocks to reuse
    order = [None, "attn-r4", "mlp-r8", None, "attn-r4"]
    got = [
        llm.generate([prompt], SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, lora=name))[0].token_ids
        for name in order
    ]
    expected = _expected(tiny_llama, adapters, [prompt] * len(order), order)
    assert got == expected
    # The repeats of the base model and of attn-r4 found their own earlier blocks (and only those).
    assert llm.engine.kv_cache_manager.prefix_cache_hits == 2 * 32


def test_a_request_naming_an_unknown_adapter_is_refused_naming_it(tiny_llama, adapters):
    llm = _llm(tiny_llama, {"attn-r4": adapters["attn-r4"]})
    with pytest.raises(
        ValueError,
        match=r"request '0': unknown LoRA adapter 'nope': not in lora.adapters "
        r"\(known: attn-r4\)",
    ):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, lora="nope"))
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, lora="attn-r4"))[0].token_ids


def test_a_run_without_a_lora_section_refuses_adapter_requests(tiny_llama):
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2)
    with pytest.raises(ValueError, match="uses LoRA adapter 'attn-r4' but this run has no lora: section"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, lora="attn-r4"))


def test_a_bad_listed_adapter_fails_the_run_at_start_naming_it(tiny_llama, adapters):
    with pytest.raises(
        ConfigError,
        match=r"lora.adapters.mlp-r8: LoRA adapter 'mlp-r8': rank 8 exceeds "
        r"lora.max_lora_rank \(4\)",
    ):
        patchbay.LLM(
            Settings(
                model={"path": str(tiny_llama), "dtype": "float32"},
                runtime={"threads": 2},
                lora={"adapters": {"mlp-r8": str(adapters["mlp-r8"])}, "max_lora_rank": 4},
            )
        )


@pytest.mark.slow
def test_the_server_s_model_field_picks_the_adapter(tiny_llama, adapters, prompts):
    import httpx
    import openai
    from serving import running_server

    settings = Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime={"threads": 2},
        cache={"num_blocks": 256},
        server={"served_model_name": "tiny"},
        lora={"adapters": {name: str(path) for name, path in adapters.items()}, "max_lora_rank": 8},
    )
    offline = patchbay.LLM(settings)
    with running_server(settings) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        listed = {model.id: model for model in client.models.list().data}
        assert set(listed) == {"tiny", *ADAPTER_SPECS}
        assert all(getattr(listed[name], "parent", None) == "tiny" for name in ADAPTER_SPECS)
        texts, counts = {}, {}
        for name in [None, *ADAPTER_SPECS]:
            served = client.completions.create(model=name or "tiny", prompt=prompts[1], max_tokens=8, temperature=0)
            want = offline.generate([prompts[1]], SamplingParams(max_tokens=8, lora=name))[0]
            assert served.choices[0].text == want.text, name
            texts[name] = want.text
            counts[name] = len(want.token_ids)
        assert len(set(texts.values())) == len(texts), "each adapter answers differently from the base model"
        metrics = server.wait_until_idle()
        for name in ADAPTER_SPECS:
            assert metrics[f'patchbay_lora_requests_total{{lora_name="{name}"}}'] == 1
            assert metrics[f'patchbay_lora_generation_tokens_total{{lora_name="{name}"}}'] == counts[name]
        missing = httpx.post(
            f"{server.url}/v1/completions", json={"model": "nope", "prompt": "a", "max_tokens": 2}, timeout=60
        )
        assert missing.status_code == 404 and "'nope' does not exist" in missing.json()["error"]["message"]


@pytest.mark.slow
def test_ngram_speculative_decoding_stays_lossless_with_adapters(tiny_llama, adapters, prompts):
    """Drafts are verified by the adapter model itself: the tokens are PEFT's, as without drafts."""
    settings = Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime={"threads": 2},
        cache={"block_size": 16},
        spec_decode={"name": "ngram", "num_speculative_tokens": 3},
        lora={"adapters": {name: str(path) for name, path in adapters.items()}, "max_lora_rank": 8},
    )
    llm = patchbay.LLM(settings)
    # Repetitive prompts, so the n-gram drafter finds matches and proposes.
    looped = [(p[:6] * 4)[:24] for p in prompts[:4]]
    names = [None, "attn-r4", "mlp-r8", "all-r2-rslora"]
    # Long enough that the random models' greedy outputs repeat themselves, which the drafter then proposes.
    outputs = llm.generate(looped, [SamplingParams(max_tokens=48, ignore_eos=True, lora=n) for n in names])
    assert [o.token_ids for o in outputs] == _expected(tiny_llama, adapters, looped, names, num_tokens=48)
    assert llm.engine.spec_stats.num_draft_tokens > 0, "the drafter proposed nothing, so this proves nothing"


@pytest.mark.slow
def test_tensor_parallel_shards_give_peft_s_tokens_for_every_adapter(tiny_llama, adapters, prompts):
    """Two ranks: each keeps its part of every adapter (B's rows of its q/k/v/gate/up outputs, A's columns of its
    o/down inputs), and the partial products are summed with the base output's own."""
    settings = Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime={"threads": 2, "tensor_parallel_size": 2},
        cache={"block_size": 16},
        scheduler={"max_num_batched_tokens": 64},
        lora={"adapters": {name: str(path) for name, path in adapters.items()}, "max_lora_rank": 8},
    )
    llm = patchbay.LLM(settings)
    try:
        outputs = llm.generate(
            prompts, [SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, lora=n) for n in NAMES]
        )
    finally:
        llm.engine.close()
    assert [o.token_ids for o in outputs] == _expected(tiny_llama, adapters, prompts, NAMES)


@pytest.mark.parametrize(
    ("runtime", "lora", "key"),
    [
        ({"pipeline_parallel_size": 2}, {}, "runtime.pipeline_parallel_size"),
        ({"tensor_parallel_size": 2}, {"allow_runtime_updates": True}, "lora.allow_runtime_updates"),
    ],
)
def test_layouts_lora_cannot_serve_are_refused_naming_the_key(tiny_llama, adapters, runtime, lora, key):
    settings = Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime=runtime,
        lora={"adapters": {name: str(path) for name, path in adapters.items()}, "max_lora_rank": 8, **lora},
    )
    with pytest.raises(ConfigError, match=key):
        patchbay.LLM(settings)
