"""``example_gpt_neo``: GPT-Neo, an architecture transformers' generic path refuses, run over patchbay's cache.

transformers' GPT-Neo classes do not take its AttentionInterface, so patchbay's built-in ``transformers``
architecture cannot route their attention.  This plugin loads transformers' modules as they are
(``source.load_transformers(attention="eager")``) and gives each self-attention module a ``forward`` that
projects, splits heads and calls :func:`patchbay.toolkit.forward_context.attend`; it declares each layer's spec
itself: GPT-Neo does not scale its scores (scale 1), and its ``local`` layers see a window of ``window_size``
keys.  Everything else (learned position embeddings, LayerNorms, the MLP) stays transformers'.
"""

from __future__ import annotations

from typing import Any, ClassVar

from patchbay.interfaces import (
    Architecture,
    ArchitectureCapabilities,
    ArchitectureModel,
    AttentionLayerSpec,
    ModelSource,
)
from patchbay.toolkit.forward_context import attend


TINY_GPT_NEO = (
    "GPTNeoConfig",
    {"num_layers": 4, "num_heads": 4, "attention_types": [[["global", "local"], 2]], "window_size": 20},
)
"""The recipe of a tiny random GPT-Neo for the kit (:func:`patchbay.testing.tiny_models.tiny_checkpoint`): the kit
has no tiny config of an architecture only a third party serves."""


class PagedSelfAttention:
    """The ``forward`` of one ``GPTNeoSelfAttention``: its projections, then patchbay's attention."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False, **kwargs):
        module = self.module
        batch, tokens = hidden_states.shape[:-1]
        heads = (tokens, module.num_heads, module.head_dim)
        query = module.q_proj(hidden_states)[0].view(heads)
        key = module.k_proj(hidden_states)[0].view(heads)
        value = module.v_proj(hidden_states)[0].view(heads)
        output = attend(module.layer_id, query, key, value)
        return module.out_proj(output.reshape(batch, tokens, -1)), None


class ExampleGPTNeoArchitecture(Architecture):
    """GPT-Neo: transformers' modules, each self-attention through patchbay (unscaled scores, local windows)."""

    contract_version = "1.1"
    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(
        devices=("cpu", "cuda"),
        architectures=("GPTNeoForCausalLM",),
        priority=10,
    )

    def load(self, source: ModelSource) -> ArchitectureModel:
        """transformers builds the model; each ``GPTNeoSelfAttention`` gets a :class:`PagedSelfAttention` forward."""
        model = source.load_transformers(attention="eager")
        config = model.config
        specs = {}
        for name, module in model.named_modules():
            if type(module).__name__ != "GPTNeoSelfAttention":
                continue
            module.forward = PagedSelfAttention(module)
            specs[module.layer_id] = AttentionLayerSpec(
                layer_name=name,
                num_heads=module.num_heads,
                num_kv_heads=module.num_heads,
                head_size=module.head_dim,
                scale=1.0,
                sliding_window=config.window_size if module.attention_type == "local" else None,
            )
        return ArchitectureModel(model, specs)
