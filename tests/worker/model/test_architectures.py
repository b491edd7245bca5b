"""Greedy parity with transformers for more architectures, on tiny random-weight models built here.

Covers grouped-query attention with another ratio (Llama), sliding-window
layers mixed with full-attention layers, which gives two KV-cache groups
(Qwen2), a head size that is not hidden_size / num_heads plus q/k norms
(Qwen3), and sliding window on every layer (Mistral).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams
from tiny_models import ARCHITECTURES, build_tiny_model, transformers_greedy

NUM_NEW_TOKENS = 8
PROMPT_LENGTHS = [5, 17, 33, 48, 64, 90, 120, 7]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_model(request, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in PROMPT_LENGTHS]


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", "flex"])
def test_greedy_matches_transformers(tiny_model: Path, backend: str):
    llm = patchbay.LLM(
        model__path=str(tiny_model),
        attention__name=backend,
        cache__block_size=16,
        scheduler__max_num_batched_tokens=64,
        runtime__threads=2,
    )
    prompts = _prompts(llm.engine.model.shape.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    expected = transformers_greedy(tiny_model, prompts, NUM_NEW_TOKENS)
    for prompt, output, want in zip(prompts, outputs, expected, strict=True):
        assert output.token_ids == want, f"prompt of {len(prompt)} tokens"


def test_mixed_window_model_has_two_cache_groups(tmp_path):
    llm = patchbay.LLM(model__path=str(build_tiny_model(tmp_path, "qwen2-mixed-window")), attention__name="reference")
    windows = sorted((g.spec.sliding_window or 0, len(g.layer_names)) for g in llm.engine.groups)
    assert windows == [(0, 2), (24, 2)]


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import T5Config

    T5Config(vocab_size=100, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32).save_pretrained(tmp_path)
    with pytest.raises(patchbay.toolkit.model_files.ModelLoadError, match="T5"):
        patchbay.LLM(model__path=str(tmp_path))
