"""Tiny random-weight Hugging Face models for tests, with the bundled model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from patchbay.worker.model.model_loader import bundled_gguf, convert_gguf

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa4": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2-mixed-window": (
        "Qwen2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "qwen3-head128": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=20)),
    # A vocabulary no rank count divides (ids past 1000 of the tokenizer never come out), tied to the LM head.
    "llama-odd-vocab-tied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=True),
    ),
    # Heads, KV heads and MLP features that three ranks divide.
    "llama-tp3": (
        "LlamaConfig",
        dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3),
    ),
}


def build_tiny_model(directory: Path, architecture: str) -> Path:
    """Save a 4-layer, 64-wide random model of ``architecture`` (a key of :data:`ARCHITECTURES`) to ``directory``.

    A large initializer range makes the logits peaky, so greedy choices are
    not decided by rounding noise.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, extra = ARCHITECTURES[architecture]
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    config = getattr(transformers, config_class)(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "max_position_embeddings": 512,
            "initializer_range": 0.2,
            "tie_word_embeddings": False,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            **extra,
        }
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], num_tokens: int, dtype: torch.dtype = torch.float32
) -> list[list[int]]:
    """What transformers' own ``generate`` produces for each prompt alone, greedily, exactly ``num_tokens`` long.

    As patchbay's ``ignore_eos``: the end-of-sequence token may be chosen and generation goes on past it
    (``min_new_tokens`` would forbid choosing it). Every prompt position is attended, token 0 included
    (``generate`` would otherwise mask the positions holding its pad token).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
