"""Reading a transformers model's attention layers as patchbay's layer specs, for architecture plugins.

An architecture plugin built on transformers' model code declares each attention layer's
:class:`~patchbay.interfaces.AttentionLayerSpec`; for models whose attention modules follow transformers'
conventions (a ``layer_idx``, a ``scaling``, a ``sliding_window`` where the layer has one, the heads and head size
of the config), :func:`attention_layer_specs` reads them off the loaded model.
"""

from __future__ import annotations

from typing import Any

from patchbay.interfaces import AttentionLayerSpec
from patchbay.toolkit.model_files import ModelLoadError

__all__ = ["architecture_name", "attention_layer_specs", "text_config"]


def architecture_name(config: Any) -> str:
    """The name a model is served by: its config's first ``architectures`` entry (the config class's name when
    the list is missing)."""
    return str((getattr(config, "architectures", None) or [type(config).__name__])[0])


def text_config(config: Any) -> Any:
    """The language model's config: a vision-language model's ``text_config``, else ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_layer_specs(model: Any, architecture: str) -> dict[int, AttentionLayerSpec]:
    """Each attention module of ``model`` (a transformers ``PreTrainedModel``) as a layer spec, by layer index.

    A module counts when it has a ``layer_idx`` and a ``scaling``; its window is its own ``sliding_window``, else
    the config's ``layer_types`` entry, else the config's ``sliding_window`` (where ``use_sliding_window`` is not
    off).  Raises :class:`ModelLoadError` when the count differs from ``num_hidden_layers``: the modules do not
    follow transformers' conventions.
    """
    config = text_config(model.config)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    layer_types = getattr(config, "layer_types", None)
    soft_cap = getattr(config, "attn_logit_softcapping", None)
    specs: dict[int, AttentionLayerSpec] = {}
    for name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None or not hasattr(module, "scaling") or layer_idx in specs:
            continue
        window = getattr(module, "sliding_window", None)
        if window is None and not hasattr(module, "sliding_window"):
            if layer_types is not None:
                window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
            elif getattr(config, "use_sliding_window", True):
                window = getattr(config, "sliding_window", None)
        specs[layer_idx] = AttentionLayerSpec(
            layer_name=name,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=float(module.scaling),
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )
    if len(specs) != config.num_hidden_layers:
        raise ModelLoadError(
            f"{architecture}: found {len(specs)} attention layers with a layer_idx, expected "
            f"{config.num_hidden_layers}; its attention modules do not follow transformers' conventions"
        )
    return specs
