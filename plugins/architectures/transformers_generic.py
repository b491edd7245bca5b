"""The ``transformers`` architecture: transformers' own model classes, every attention layer routed to patchbay.

This is patchbay's generic path and the default of ``model.architecture: auto``
for any decoder no other plugin serves: the model is built by transformers from
its directory, and each attention layer's call through transformers'
``AttentionInterface`` reaches the run's backend over the paged cache.  It runs
any architecture whose transformers class takes that interface; the ones listed
in its capabilities are proven against transformers' own ``generate`` by the
architecture kit on tiny random checkpoints.
"""

from __future__ import annotations

from typing import Any, ClassVar

from patchbay.interfaces import Architecture, ArchitectureCapabilities, ArchitectureModel, ModelSource
from patchbay.toolkit.transformers_layers import attention_layer_specs, text_config

PROVEN = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "GPTNeoXForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""Architectures whose tiny random checkpoints give transformers' greedy tokens (the kit's checks).  Vision-language
models (Qwen2-VL, LLaVA) run through this plugin too, their language model as any other; their images are proven by
the engine's multimodal tests, not by the kit."""

SHARDED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "GPTNeoXForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""Architectures whose decoder layers tensor-parallel ranks shard (heads, MLP features, each expert's features;
not OLMo 2, whose q/k norms normalize all heads at once)."""


class TransformersArchitecture(Architecture):
    """transformers' own model classes with their attention through patchbay: any decoder whose class takes the
    AttentionInterface."""

    contract_version = "1.1"
    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(
        devices=("cpu", "cuda", "mps"),
        architectures=PROVEN,
        other_transformers_architectures=True,
        tensor_parallel=SHARDED,
        priority=0,
    )

    def load(self, source: ModelSource) -> ArchitectureModel:
        """transformers builds the model (``source.load_transformers``); its attention modules give the specs."""
        module = source.load_transformers()
        specs = attention_layer_specs(module, source.architecture)
        return ArchitectureModel(module, specs, logits_scale=logits_scale(text_config(module.config)))


def logits_scale(config: Any) -> float:
    """What the family's own forward multiplies the LM head's output by: Granite's ``1 / logits_scaling``,
    Cohere's ``logit_scale`` (1 for the others)."""
    if config.model_type.startswith("granite") and getattr(config, "logits_scaling", None):
        return 1.0 / float(config.logits_scaling)
    if config.model_type.startswith("cohere") and getattr(config, "logit_scale", None):
        return float(config.logit_scale)
    return 1.0
