"""Tiny random checkpoints of Hugging Face architectures, and transformers' own greedy tokens for them.

The architecture kit proves a plugin against transformers on these: 4 decoder layers, 64 wide, the bundled
model's tokenizer, each architecture's distinctive features switched on (a sliding window shorter than the
prompts, soft-capping, partial rotary, q/k norms, experts with shared ones, MLA's compressed latent, ...).  A
large initializer range makes the logits peaky, so a greedy choice is not decided by rounding noise.  Nothing is
downloaded: configs come from transformers' classes, weights from a seeded random init.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
"""What every tiny checkpoint shares (an entry of :data:`TINY_CONFIGS` may override any of it)."""

_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    **_MOE,
}

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "MistralForCausalLM": ("MistralConfig", {"num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 20}),
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    ),
    "Qwen3ForCausalLM": ("Qwen3Config", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),
    "GemmaForCausalLM": ("GemmaConfig", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}),
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 20,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 16,
        },
    ),
    "Phi3ForCausalLM": ("Phi3Config", {"num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0}),
    "GraniteForCausalLM": (
        "GraniteConfig",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    ),
    "Olmo2ForCausalLM": ("Olmo2Config", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "GPTNeoXForCausalLM": (
        "GPTNeoXConfig",
        {"num_attention_heads": 4, "partial_rotary_factor": 0.25, "use_parallel_residual": True},
    ),
    "MixtralForCausalLM": (
        "MixtralConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "shared_expert_intermediate_size": 64}
        | _MOE,
    ),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4} | _MOE,
    ),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", {"q_lora_rank": None, "topk_method": "greedy"} | _MLA),
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        {"q_lora_rank": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5} | _MLA,
    ),
    "StableLmForCausalLM": (
        "StableLmConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "use_qkv_bias": True},
    ),
}
"""Hugging Face architecture name -> its transformers config class and what the tiny checkpoint sets besides
:data:`SHAPE`."""


Recipe = tuple[str, dict[str, Any]]
"""A transformers config class name and the values a tiny checkpoint sets besides :data:`SHAPE`."""


def tiny_config(architecture: str, tokenizer: Any, recipe: Recipe | None = None) -> Any:
    """The transformers config of ``architecture``'s tiny checkpoint: its entry of :data:`TINY_CONFIGS`, or
    ``recipe`` for an architecture the kit has none of (a third party's)."""
    import transformers

    if recipe is None and architecture not in TINY_CONFIGS:
        raise KeyError(
            f"the kit has no tiny config of {architecture}; it builds {', '.join(sorted(TINY_CONFIGS))} "
            "(give a recipe: a config class name and its values)"
        )
    config_class, extra = recipe or TINY_CONFIGS[architecture]
    return getattr(transformers, config_class)(
        **{
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "architectures": [architecture],
            **SHAPE,
            **extra,
        }
    )


def save_tiny_model(directory: Path, architecture: str, recipe: Recipe | None = None) -> Path:
    """Save a seeded random float32 model of ``architecture`` (its tiny config, or ``recipe``'s) and the bundled
    model's tokenizer to ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    config = tiny_config(architecture, tokenizer, recipe)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_checkpoint(architecture: str, recipe: Recipe | None = None) -> Path:
    """``architecture``'s tiny checkpoint (its entry of :data:`TINY_CONFIGS`, or ``recipe``), built once into
    patchbay's cache folder and reused.

    Its directory name holds a digest of its config and of the transformers version, so a change of either
    builds a new one.
    """
    import transformers

    from patchbay.toolkit.paths import cache_dir

    what = [architecture, recipe or TINY_CONFIGS.get(architecture), SHAPE, transformers.__version__]
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    directory = cache_dir() / "conformance" / f"tiny-{architecture}-{digest[:12]}"
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        save_tiny_model(staging, architecture, recipe)
        os.replace(staging, directory)  # atomic: a concurrent builder's directory wins, ours is dropped
    except OSError:
        if not (directory / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], num_tokens: int, dtype: Any = None
) -> list[list[int]]:
    """What transformers' own ``generate`` produces for each prompt alone, greedily, exactly ``num_tokens`` long.

    As patchbay's ``ignore_eos``: the end-of-sequence token may be chosen and generation goes on past it
    (``min_new_tokens`` would forbid choosing it). Every prompt position is attended, token 0 included
    (``generate`` would otherwise mask the positions holding its pad token).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).eval()
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


def transformers_next_logprobs(model_dir: Path, prompts: list[list[int]], dtype: Any = None) -> list[Any]:
    """transformers' log-probabilities of the token after each prompt (``[vocab]`` float32 each): the logits its
    own ``forward`` returns, every transform after the LM head included (Gemma 2's soft cap, Granite's scaling)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), dim=-1) for p in prompts]
