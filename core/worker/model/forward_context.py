"""What the attention layers of one forward pass need, set by the runner around the pass.

transformers calls patchbay's registered attention function once per layer
with only the layer module and its tensors; the function finds the layer's
backend implementation, KV-cache tensor and the step's attention metadata
here, and the KV connector's worker side, if any, to wait for each layer's
load before its attention and to save its KV after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from patchbay.interfaces import AttentionImpl, KVConnectorWorker


@dataclass
class LayerBinding:
    """One attention layer's implementation, cache tensor and KV-cache group."""

    impl: AttentionImpl
    kv_cache: torch.Tensor
    group: int
    layer_name: str = ""
    """The layer's module name, the key of its KV cache for a KV connector."""


@dataclass
class ForwardContext:
    """Per-step state shared by every attention layer: bindings by layer index, metadata by group."""

    layers: dict[int, LayerBinding]
    group_metadata: list[Any]
    kv_connector: KVConnectorWorker | None = None
    """Called around each layer's attention (``wait_for_layer_load``, ``save_kv_layer``); ``None``: no connector."""


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``context`` current for the duration of one forward pass."""
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous


def current_forward_context() -> ForwardContext:
    """The current context; calling attention outside a patchbay forward pass is an error."""
    if _current is None:
        raise RuntimeError(
            "patchbay attention was called outside a patchbay forward pass; a model loaded with "
            "attn_implementation='patchbay' only runs inside patchbay's model runner"
        )
    return _current


def attend(layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Layer ``layer_idx``'s queries, keys and values (``[tokens, heads, head_size]``, any strides) through the
    current step's backend over the paged cache, between the connector's load and save of the layer; returns
    ``[tokens, heads, head_size]``."""
    context = current_forward_context()
    binding = context.layers[layer_idx]
    metadata = context.group_metadata[binding.group]
    connector = context.kv_connector
    if connector is not None:
        connector.wait_for_layer_load(binding.layer_name)
    output = binding.impl.forward(query, key, value, binding.kv_cache, metadata)
    if connector is not None:
        connector.save_kv_layer(binding.layer_name, binding.kv_cache, metadata)
    return output
