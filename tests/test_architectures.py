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
import torch

import patchbay
from patchbay.model_loader import bundled_gguf, convert_gguf
from patchbay.sampling_params import SamplingParams

NUM_NEW_TOKENS = 8
PROMPT_LENGTHS = [5, 17, 33, 48, 64, 90, 120, 7]

ARCHITECTURES = {
    "llama-gqa4": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2-mixed-window": ("Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=24,
        max_window_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "qwen3-head128": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=20)),
}


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return convert_gguf(bundled_gguf())


def _build(tmp_path_factory, tokenizer_dir: Path, name: str) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, extra = ARCHITECTURES[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_model(request, tmp_path_factory, tokenizer_dir) -> Path:
    return _build(tmp_path_factory, tokenizer_dir, request.param)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in PROMPT_LENGTHS]


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                           do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", "flex"])
def test_greedy_matches_transformers(tiny_model: Path, backend: str):
    llm = patchbay.LLM(model__path=str(tiny_model), attention__backend=backend, cache__block_size=16,
                       scheduler__max_num_batched_tokens=64, runtime__threads=2)
    prompts = _prompts(llm.engine.model.shape.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    expected = _reference(tiny_model, prompts)
    for prompt, output, want in zip(prompts, outputs, expected, strict=True):
        assert output.token_ids == want, f"prompt of {len(prompt)} tokens"


def test_mixed_window_model_has_two_cache_groups(tmp_path_factory, tokenizer_dir):
    llm = patchbay.LLM(model__path=str(_build(tmp_path_factory, tokenizer_dir, "qwen2-mixed-window")),
                       attention__backend="reference")
    windows = sorted((g.spec.sliding_window or 0, len(g.layer_names)) for g in llm.engine.groups)
    assert windows == [(0, 2), (24, 2)]


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import T5Config

    T5Config(vocab_size=100, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32).save_pretrained(tmp_path)
    with pytest.raises(patchbay.model_loader.ModelLoadError, match="T5"):
        patchbay.LLM(model__path=str(tmp_path))
