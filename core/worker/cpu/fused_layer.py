"""Llama-style decoder layers as two C++ calls around the attention backend, where every product is tiled.

Once a layer's norms, attention and MLP run through the fused kernels
(:mod:`patchbay.worker.cpu.fused_modules`) and its four products over tiled weights
(:mod:`patchbay.toolkit.tiles`), what is left of a decode step's
time outside the products is Python: transformers' module calls, patchbay's
wrappers around each kernel, the views between them: about 80 us per layer
on the development machine, a third of a one-request decode step.  This
module replaces such a layer's ``forward`` by two calls into the fused-ops
extension, which run the same kernels in the same order without returning to
Python between them:

1. the input norm, the fused q/k/v product and the rotation of queries and
   keys (:func:`decoder_attention_inputs` in the extension);
2. the attention, through the step's backend as every layer's
   (:func:`patchbay.toolkit.forward_context.attend`);
3. the output projection and residual add, the post-attention norm, the fused
   gate/up product, SiLU-and-multiply, the down projection and residual add
   (each add rounds once, as the model's own torch adds).

The norms, rotations, activations and adds between the products run on the
products' helper threads (:func:`patchbay.toolkit.tiles.chunk_runner`),
which are awake: over OpenMP, a torch add took ~55 us at 64 rows, most of it
waking a sleeping thread (a 64-request bfloat16 decode step ran ~5% faster on
the helpers).

The results are those of the layer's fused modules, bit for bit.  A layer
qualifies when its class's ``forward`` has the source of transformers' Llama
decoder layer (Qwen2's and Mistral's are the same), all four of its modules
were fused, its products are tiled, and none of its modules has a forward hook
(a tensor-parallel rank's all-reduce is one) — anything else keeps its modules'
forwards.  Inputs the kernels do not take (angles in another dtype, a
transformers cache) run the layer's own ``forward``.

A decoder whose every layer is fused runs as a plain loop over them
(:class:`FusedDecoderLoop`), without transformers' wrappers around its forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from patchbay.toolkit.forward_context import attend
from patchbay.worker.model.hf_model import LlamaStyleModule
from patchbay.worker.cpu.fused_modules import FusedGatedMLP, FusedRMSNorm, FusedRopeAttention
from patchbay.worker.cpu.onednn import PackedGroupProduct, PackedLinear
from patchbay.toolkit.tiles import TileLayout, chunk_runner, tiled_product_entry


@functools.cache
def _llama_source(class_name: str) -> str:
    """The source of the ``forward`` of transformers' Llama class ``class_name``."""
    from transformers.models.llama import modeling_llama

    return inspect.getsource(getattr(modeling_llama, class_name).forward)


@functools.cache
def _has_llama_forward(cls: type[nn.Module], class_name: str) -> bool:
    """Whether ``cls.forward`` has the source of Llama's ``class_name`` (Qwen2's and Mistral's are the same)."""
    try:
        return inspect.getsource(cls.forward) == _llama_source(class_name)
    except (OSError, TypeError):
        return False


def _own_forward(module: nn.Module) -> Any:
    return vars(module).get("forward")


def _tiled_group(fused: FusedRopeAttention | FusedGatedMLP) -> PackedGroupProduct | None:
    """The fused module's projection group's product, if it multiplies by tiled weights."""
    product = getattr(fused.group, "product", None)
    return product if isinstance(product, PackedGroupProduct) and isinstance(product.layout, TileLayout) else None


def _tiled_linear(linear: nn.Module) -> PackedLinear | None:
    product = _own_forward(linear)
    return product if isinstance(product, PackedLinear) and isinstance(product.layout, TileLayout) else None


def _parts(layer: LlamaStyleModule) -> tuple[Any, ...] | None:
    """The fused pieces a qualifying layer is made of, or ``None`` if it does not qualify."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    if not _has_llama_forward(type(layer), "LlamaDecoderLayer"):  # type: ignore[arg-type]
        return None
    norm_in, norm_post = _own_forward(layer.input_layernorm), _own_forward(layer.post_attention_layernorm)
    attention, mlp = _own_forward(layer.self_attn), _own_forward(layer.mlp)
    if not (
        isinstance(norm_in, FusedRMSNorm)
        and isinstance(norm_post, FusedRMSNorm)
        and isinstance(attention, FusedRopeAttention)
        and attention.kind == "llama"  # the C++ layer has no per-head norms nor one q/k/v product of its own
        and isinstance(mlp, FusedGatedMLP)
        and mlp.activation == "silu"  # the C++ layer's MLP is SiLU's
    ):
        return None
    qkv, gate_up = _tiled_group(attention), _tiled_group(mlp)
    o_proj, down_proj = _tiled_linear(layer.self_attn.o_proj), _tiled_linear(layer.mlp.down_proj)
    if qkv is None or gate_up is None or o_proj is None or down_proj is None:
        return None
    if any(module._forward_hooks or module._forward_pre_hooks for module in layer.modules() if module is not layer):
        return None
    return norm_in, norm_post, attention, mlp, qkv, gate_up, o_proj, down_proj


class FusedDecoderLayer:
    """The ``forward`` of one qualifying decoder layer (see the module's docstring)."""

    def __init__(self, layer: LlamaStyleModule, parts: tuple[Any, ...]) -> None:
        norm_in, norm_post, attention, mlp, qkv, gate_up, o_proj, down_proj = parts
        self.layer = layer
        self.build = attention.build
        self.layer_idx = layer.self_attn.layer_idx
        self.width = int(norm_in.module.weight.shape[0])
        self.dtype = qkv.packed.dtype
        self.layout: TileLayout = qkv.layout
        q_size, k_size, v_size = attention.group.sizes
        self.attention_inputs = (
            norm_in.module.weight,
            norm_in.eps,
            qkv.packed.tiles,
            attention.group.bias,
            q_size,
            k_size,
            v_size,
        )
        self.head_size = attention.head_size
        self.rest = (
            o_proj.packed.tiles,
            o_proj.bias,
            norm_post.module.weight,
            norm_post.eps,
            gate_up.packed.tiles,
            mlp.group.bias,
            gate_up.packed.out_features // 2,
            down_proj.packed.tiles,
            down_proj.bias,
        )
        self.product = tiled_product_entry()
        self.helpers = chunk_runner()  # the layer's tiled products put the helpers to use, so this is non-zero

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        ops = self.build.ready()
        if (
            ops is None
            or cache is not None
            or kwargs.get("past_key_values") is not None
            or position_embeddings is None
            or hidden_states.dtype != self.dtype
            or position_embeddings[0].dtype != self.dtype
            or position_embeddings[1].dtype != self.dtype
        ):
            return type(self.layer).forward(
                self.layer,
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        rows = hidden_states.reshape(-1, self.width).contiguous()
        cos, sin = position_embeddings
        threads = self.layout.threads
        query, key, value = ops.decoder_attention_inputs(
            self.product, self.helpers, rows, *self.attention_inputs, cos, sin, self.head_size, threads
        )
        attended = attend(self.layer_idx, query, key, value)
        output = ops.decoder_attention_output_and_mlp(
            self.product, self.helpers, attended.reshape(rows.shape[0], -1), rows, *self.rest, threads
        )
        return output.view(hidden_states.shape)


class FusedDecoderLoop:
    """The ``forward`` of a Llama-style decoder whose every layer is a :class:`FusedDecoderLayer`.

    transformers' decoder forward wraps each call in decorators for deprecated arguments, config defaults and
    captured outputs, and builds a causal mask the fused layers never read.  Outside its layers, a one-request
    int4 decode step of ~7 ms spent 0.81-0.97 ms in the decoder (the caches cold from the weights streamed
    between calls), and 0.60-0.68 ms with this loop, which embeds, rotates, calls the layers and normalizes,
    the same ops in the same order.  The layers are still called as modules, so hooks registered later (a
    drafter's on the layers it reads) run.  Any argument the loop does not take (a transformers cache, an
    attention mask, outputs to capture) runs the decoder's own ``forward``.
    """

    def __init__(self, decoder: nn.Module, layers: list[nn.Module]) -> None:
        self.decoder: Any = decoder  # a Llama-style decoder: embed_tokens, rotary_emb, norm
        self.layers = layers

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        if (
            kwargs
            or cache is not None
            or use_cache
            or attention_mask is not None
            or position_ids is None
            or (input_ids is None) == (inputs_embeds is None)
        ):
            return type(self.decoder).forward(
                self.decoder,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        from transformers.modeling_outputs import BaseModelOutputWithPast

        decoder = self.decoder
        hidden_states = decoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_embeddings = decoder.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids=position_ids, position_embeddings=position_embeddings)
        return BaseModelOutputWithPast(last_hidden_state=decoder.norm(hidden_states))


def _fused_loop_layers(decoder: nn.Module) -> list[nn.Module] | None:
    """``decoder``'s layers, if it is a Llama-style decoder whose every layer is fused."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    if "forward" in vars(decoder) or not _has_llama_forward(type(decoder), "LlamaModel"):  # type: ignore[arg-type]
        return None
    config = getattr(decoder, "config", None)
    stack: Any = decoder.layers
    layers = list(stack[: config.num_hidden_layers]) if config is not None else []
    if not layers or not all(isinstance(_own_forward(layer), FusedDecoderLayer) for layer in layers):
        return None
    return layers


def use_fused_decoder_loops(model: nn.Module) -> int:
    """Give every Llama-style decoder of ``model`` whose layers are all fused a :class:`FusedDecoderLoop`
    forward; say how many.  Run after :func:`use_fused_layers`."""
    count = 0
    for module in list(model.modules()):
        layers = _fused_loop_layers(module) if hasattr(module, "layers") else None
        if layers is not None:
            module.forward = FusedDecoderLoop(module, layers)
            count += 1
    return count


def use_fused_layers(model: nn.Module) -> int:
    """Give every qualifying decoder layer of ``model`` a :class:`FusedDecoderLayer` forward; say how many.

    Run after :func:`patchbay.worker.cpu.fused_modules.use_fused_ops` (it fuses the layers' modules this builds on).
    """
    count = 0
    for module in model.modules():
        if "forward" in vars(module):
            continue
        parts = _parts(module) if hasattr(module, "self_attn") and hasattr(module, "mlp") else None
        if parts is not None:
            module.forward = FusedDecoderLayer(module, parts)
            count += 1
    return count
