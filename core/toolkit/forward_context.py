"""What the attention layers of one forward pass need, set by the runner around the pass.

An attention layer (transformers' through patchbay's registered attention
function, or an architecture plugin's own) calls :func:`attend` with its
layer index and its tensors; the call finds the layer's backend
implementation, KV-cache tensor and the step's attention metadata here, and
the KV connector's worker side, if any, to wait for each layer's load before
its attention and to save its KV after.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from patchbay.interfaces import AttentionImpl, KVConnectorWorker

__all__ = ["ForwardContext", "LayerBinding", "attend", "current_forward_context", "forward_context"]


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


_local = threading.local()
"""The current context, per thread: two engines stepping at once in one process (two servers, ``LLM`` objects on
threads of their own) each see their own step's, never the other's."""


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``context`` current in this thread for the duration of one forward pass."""
    previous = getattr(_local, "current", None)
    _local.current = context
    try:
        yield context
    finally:
        _local.current = previous


def current_forward_context() -> ForwardContext:
    """This thread's current context; calling attention outside a patchbay forward pass is an error."""
    current: ForwardContext | None = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError(
            "patchbay attention was called outside a patchbay forward pass; a model loaded with "
            "attn_implementation='patchbay' only runs inside patchbay's model runner"
        )
    return current


def attend(layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Layer ``layer_idx``'s queries, keys and values (``[tokens, heads, head_size]``, any strides) through the
    current step's backend over the paged cache, between the connector's load and save of the layer; returns
    ``[tokens, heads, head_size]``.

    A latent (MLA) layer passes its one key row per token (``[tokens, 1, head_size]``) and, as ``value``, the
    view ``key[..., :value_size]``; it gets ``[tokens, heads, value_size]`` back
    (:attr:`patchbay.interfaces.AttentionLayerSpec.value_size`).
    """
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
