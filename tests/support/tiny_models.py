"""Tiny random-weight Hugging Face models for tests, with the bundled model's tokenizer: variants the tests name,
built as the kit builds its own (:mod:`patchbay.testing.tiny_models`, whose ``transformers_greedy`` they use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from patchbay.testing.tiny_models import save_tiny_model, transformers_greedy

__all__ = ["ARCHITECTURES", "build_tiny_model", "transformers_greedy"]

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
    """Save a 4-layer, 64-wide random model of ``architecture`` (a key of :data:`ARCHITECTURES`) to ``directory``,
    as the kit builds its tiny checkpoints (:func:`patchbay.testing.tiny_models.save_tiny_model`).

    A large initializer range makes the logits peaky, so greedy choices are
    not decided by rounding noise.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_class, extra = ARCHITECTURES[architecture]
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[getattr(transformers, config_class).model_type]
    return save_tiny_model(directory, causal_lm, (config_class, extra))
