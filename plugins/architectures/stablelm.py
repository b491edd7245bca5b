"""The ``stablelm`` architecture: StableLM (and its partial-rotary kin) with patchbay's attention in each layer.

transformers' StableLM class does not declare transformers' AttentionInterface, so the generic path refuses
it.  This plugin loads transformers' modules as they are and replaces each attention module's ``forward`` with
the same steps ending in :func:`patchbay.toolkit.forward_context.attend`: the q/k/v projections (with their
biases), the per-head LayerNorms of ``qk_layernorm`` models, the rotary embedding over the first
``partial_rotary_factor`` of each head (``rotary_ndims``) with the model's own ``apply_rotary_pos_emb``, the
rest of each head passed through, then ``o_proj``.  Norms (LayerNorm), the parallel residual of
``use_parallel_residual`` models and the MLP stay transformers'.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import torch

from patchbay.interfaces import Architecture, ArchitectureCapabilities, ArchitectureModel, ModelSource
from patchbay.toolkit.forward_context import attend
from patchbay.toolkit.transformers_layers import attention_layer_specs


class PartialRotaryAttention:
    """The ``forward`` of one StableLM attention module, attending through patchbay."""

    def __init__(self, module: Any, apply_rotary_pos_emb: Any) -> None:
        self.module = module
        self.apply_rotary_pos_emb = apply_rotary_pos_emb
        self.rotary = int(module.rotary_ndims)
        self.head_dim = int(module.head_dim)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        module = self.module
        batch, tokens = hidden_states.shape[:-1]
        shape = (batch, tokens, -1, self.head_dim)
        query = module.q_proj(hidden_states).view(shape).transpose(1, 2)  # [1, heads, T, head_dim]
        key = module.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = module.v_proj(hidden_states).view(shape)
        if module.qk_layernorm:
            query, key = module.q_layernorm(query), module.k_layernorm(key)
        assert position_embeddings is not None, "StableLM's decoder hands every layer its rotary tables"
        cos, sin = position_embeddings
        rotary = self.rotary
        query_rot, key_rot = self.apply_rotary_pos_emb(query[..., :rotary], key[..., :rotary], cos, sin)
        query = torch.cat((query_rot, query[..., rotary:]), dim=-1)
        key = torch.cat((key_rot, key[..., rotary:]), dim=-1)
        output = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0])
        return module.o_proj(output.reshape(batch, tokens, -1)), None


class StableLMArchitecture(Architecture):
    """StableLM: transformers' modules, each attention's forward through patchbay (partial rotary, q/k norms)."""

    contract_version = "1.1"
    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(
        devices=("cpu", "cuda", "mps"),
        architectures=("StableLmForCausalLM",),
        tensor_parallel=("StableLmForCausalLM",),
        priority=10,
    )

    def load(self, source: ModelSource) -> ArchitectureModel:
        """transformers builds the model; each attention module's ``forward`` becomes a
        :class:`PartialRotaryAttention`."""
        model = source.load_transformers(attention="eager")
        modeling = sys.modules[type(model).__module__]
        specs = attention_layer_specs(model, source.architecture)
        modules = dict(model.named_modules())
        for spec in specs.values():
            module = modules[spec.layer_name]
            module.forward = PartialRotaryAttention(module, modeling.apply_rotary_pos_emb)
        model.config._attn_implementation = "patchbay"  # no causal mask is built for attention patchbay does
        return ArchitectureModel(model, specs)
