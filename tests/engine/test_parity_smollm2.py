"""Greedy parity with transformers' own generate on the bundled SmolLM2-135M-Instruct, in float32.

32 prompts of mixed lengths (8 to 1,000 tokens) run as one batch; the
tokens must be identical to transformers generating each prompt alone, also
with a token budget that forces chunked prefill, a KV pool so small that
preemption must happen, and with prefix caching on and off.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from bundled_model import FLOAT_WEIGHTS, float_model_dir
import torch

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 10
PROMPT_LENGTHS = [8, 1000] + [int(8 * (1000 / 8) ** (i / 29)) for i in range(30)]


def _corpus_token_ids(tokenizer) -> list[int]:
    # Real text: patchbay's own sources, always present wherever the tests run.
    root = Path(patchbay.__file__).parent
    text = "\n".join(path.read_text() for path in sorted(root.rglob("*.py")))
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def llm_default(shared_engines, request):
    with shared_engines.loans(request.node.nodeid) as borrow:
        yield borrow(runtime__threads=2, model__weight_format=FLOAT_WEIGHTS)


@pytest.fixture(scope="module")
def prompts(llm_default) -> list[list[int]]:
    corpus = _corpus_token_ids(llm_default.tokenizer)
    rng = random.Random(1234)
    found = []
    for index, length in enumerate(PROMPT_LENGTHS):
        if index % 4 == 3:
            # Every fourth prompt extends the previous one, so prefix caching has real hits.
            found.append(found[-1] + corpus[: length // 4 + 1])
            continue
        start = rng.randrange(0, len(corpus) - length)
        found.append(corpus[start : start + length])
    assert len(found) >= 32 and min(map(len, found)) >= 8 and max(map(len, found)) >= 1000
    return found


@pytest.fixture(scope="module")
def expected(llm_default, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_model_dir(), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NUM_NEW_TOKENS,
                pad_token_id=0,
            )
            results.append(generated[0, len(prompt) :].tolist())
    return results


def _generate(llm, prompts):
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, params)]


def _assert_same(actual, expected, prompts):
    mismatched = [(len(p), e, a) for p, e, a in zip(prompts, expected, actual, strict=True) if e != a]
    assert not mismatched, (
        f"{len(mismatched)} of {len(prompts)} prompts differ (length, expected, got): {mismatched[:3]}"
    )


def test_one_batch_matches_transformers(llm_default, prompts, expected):
    hits_before = llm_default.engine.kv_cache_manager.prefix_cache_hits  # a shared engine: earlier hits count too
    _assert_same(_generate(llm_default, prompts), expected, prompts)
    assert llm_default.engine.kv_cache_manager.prefix_cache_hits > hits_before


def test_chunked_prefill_matches_transformers(prompts, expected):
    llm = patchbay.LLM(runtime__threads=2, scheduler__max_num_batched_tokens=256, scheduler__max_num_seqs=32)
    _assert_same(_generate(llm, prompts), expected, prompts)
    assert llm.engine.stats.num_steps > sum(map(len, prompts)) // 256


def test_preemption_matches_transformers(prompts, expected):
    # 1,200 tokens of model length need 75 blocks of 16; 96 blocks cannot hold 32 requests at once.
    llm = patchbay.LLM(runtime__threads=2, cache__num_blocks=96, model__max_model_len=1200)
    _assert_same(_generate(llm, prompts), expected, prompts)
    assert llm.engine.stats.num_preemptions > 0


def test_without_prefix_caching_matches_transformers(prompts, expected):
    llm = patchbay.LLM(runtime__threads=2, cache__prefix_caching=False)
    _assert_same(_generate(llm, prompts), expected, prompts)
    assert llm.engine.kv_cache_manager.prefix_cache_hits == 0
