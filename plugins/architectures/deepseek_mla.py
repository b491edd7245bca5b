"""The ``deepseek_mla`` architecture: DeepSeek-V2/V3 with multi-head latent attention over a latent KV cache.

MLA compresses each token's keys and values into one latent vector ``c``
(``kv_lora_rank`` features, normalized) plus one rotary key ``k_pe``
(``qk_rope_head_dim``), shared by every head; ``kv_b_proj`` expands ``c`` into
each head's key part ``W_UK[h] c`` and value ``W_UV[h] c``.  transformers
expands them for every cached token at every step and caches the expansion's
inputs only in its own cache; patchbay caches just ``[c, k_pe]`` (one row per
token: 576 features for DeepSeek-V3 against 2 x 128 x 192 for the heads
expanded) and attends in the latent space, with the expansion folded into the
query and the output (as DeepSeek's paper and vLLM do):

- ``q_nope[h] . (W_UK[h] c) = (W_UK[h]ᵀ q_nope[h]) . c``: each head's query becomes
  ``[W_UK[h]ᵀ q_nope[h], q_pe[h]]``, attended against the rows ``[c, k_pe]``
  (one KV head, the scale of the full ``qk_head_dim``);
- ``sum_t p_t W_UV[h] c_t = W_UV[h] (sum_t p_t c_t)``: the backend returns each
  head's weighted latent (the rows' first ``kv_lora_rank`` features are the
  values), ``W_UV[h]`` then gives the head's ``v_head_dim`` output, and
  ``o_proj`` the layer's.

The rest of the model (norms, MLPs and routed experts, the rotary tables) is
transformers' own, loaded by ``source.load_transformers``; only each layer's
attention ``forward`` is replaced, with the family's own rotary functions.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import torch
from torch import nn

from patchbay.interfaces import (
    Architecture,
    ArchitectureCapabilities,
    ArchitectureModel,
    AttentionLayerSpec,
    ModelSource,
)
from patchbay.toolkit.forward_context import attend
from patchbay.toolkit.model_files import ModelLoadError


class LatentExpansion(nn.Module):
    """``kv_b_proj``'s weight split per head into the key part ``W_UK`` ``[heads, qk_nope_head_dim, kv_lora_rank]``
    and the value part ``W_UV`` ``[heads, v_head_dim, kv_lora_rank]``: parameters, not a linear, since the
    attention multiplies them into queries and outputs (and the CPU linear paths must leave them as they are)."""

    def __init__(self, kv_b_proj: nn.Linear, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> None:
        super().__init__()
        weight = kv_b_proj.weight.detach().view(num_heads, qk_nope_head_dim + v_head_dim, -1)
        self.key_part = nn.Parameter(weight[:, :qk_nope_head_dim].clone(), requires_grad=False)
        self.value_part = nn.Parameter(weight[:, qk_nope_head_dim:].clone(), requires_grad=False)


class LatentAttention:
    """The ``forward`` of one DeepSeek attention module, attending in the latent space over patchbay's cache."""

    def __init__(self, module: Any, rotate: Any) -> None:
        self.module = module
        self.rotate = rotate
        """The family's rotary step: ``(q_pe [1, heads, T, rope], k_pe [1, 1, T, rope], position_embeddings)`` to the
        rotated pair."""
        self.num_heads = int(module.num_heads)
        self.kv_lora_rank = int(module.kv_lora_rank)
        self.qk_nope_head_dim = int(module.qk_nope_head_dim)
        self.qk_rope_head_dim = int(module.qk_rope_head_dim)
        self.v_head_dim = int(module.v_head_dim)
        module.latent_expansion = LatentExpansion(
            module.kv_b_proj, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        )
        del module.kv_b_proj  # folded into latent_expansion: nothing may compute the expansion per token

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        module = self.module
        batch, tokens = hidden_states.shape[:-1]
        if module.q_lora_rank is None:
            query = module.q_proj(hidden_states)
        else:
            query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        query_size = self.qk_nope_head_dim + self.qk_rope_head_dim
        query = query.view(batch, tokens, -1, query_size).transpose(1, 2)  # [1, heads, T, qk_head_dim]
        q_nope, q_pe = torch.split(query, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed = module.kv_a_proj_with_mqa(hidden_states)
        latent, k_pe = torch.split(compressed, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = module.kv_a_layernorm(latent)  # [1, T, kv_lora_rank]
        q_pe, k_pe = self.rotate(q_pe, k_pe.view(batch, 1, tokens, self.qk_rope_head_dim), position_embeddings)
        expansion = module.latent_expansion  # a tensor-parallel rank's holds its heads only
        # Each head's query in the latent space: W_UK[h]ᵀ q_nope[h], [heads, T, kv_lora_rank].
        q_latent = torch.matmul(q_nope[0], expansion.key_part)
        query_rows = torch.cat([q_latent, q_pe[0].to(q_latent.dtype)], dim=-1).transpose(0, 1)  # [T, heads, row]
        key_rows = torch.cat([latent[0], k_pe[0, 0].to(latent.dtype)], dim=-1).unsqueeze(1)  # [T, 1, row]
        attended = attend(module.layer_idx, query_rows, key_rows, key_rows[..., : self.kv_lora_rank])
        # Each head's weighted latent through W_UV[h]: [heads, T, v_head_dim].
        output = torch.matmul(attended.transpose(0, 1), expansion.value_part.transpose(1, 2))
        output = output.transpose(0, 1).reshape(batch, tokens, -1)
        return module.o_proj(output), None


def _v2_rotate(modeling: Any) -> Any:
    """DeepSeek-V2: rotary as complex products over interleaved pairs (``position_embeddings`` is ``freqs_cis``)."""

    def rotate(q_pe: torch.Tensor, k_pe: torch.Tensor, position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return modeling.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))

    return rotate


def _v3_rotate(modeling: Any, interleaved: bool) -> Any:
    """DeepSeek-V3: ``(cos, sin)`` rotary, over interleaved pairs when the config says ``rope_interleave``."""
    apply = modeling.apply_rotary_pos_emb_interleave if interleaved else modeling.apply_rotary_pos_emb

    def rotate(q_pe: torch.Tensor, k_pe: torch.Tensor, position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = position_embeddings
        return apply(q_pe, k_pe, cos, sin)

    return rotate


FAMILIES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
"""Served architecture -> transformers' model type."""


class DeepseekMLAArchitecture(Architecture):
    """DeepSeek-V2/V3: transformers' modules, each attention in the latent space over one cached row per token."""

    contract_version = "1.1"
    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(
        devices=("cpu", "cuda"),
        architectures=tuple(FAMILIES),
        tensor_parallel=tuple(FAMILIES),
        priority=10,
    )

    def load(self, source: ModelSource) -> ArchitectureModel:
        """transformers builds the model; each attention module's ``forward`` becomes a :class:`LatentAttention`."""
        model = source.load_transformers(attention="eager")
        config = model.config
        modeling = sys.modules[type(model).__module__]
        if config.model_type == "deepseek_v2":
            rotate = _v2_rotate(modeling)
        else:
            rotate = _v3_rotate(modeling, bool(getattr(config, "rope_interleave", True)))
        specs: dict[int, AttentionLayerSpec] = {}
        for name, module in model.named_modules():
            if not (hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "layer_idx")):
                continue
            module.forward = LatentAttention(module, rotate)
            row = int(module.kv_lora_rank) + int(module.qk_rope_head_dim)
            specs[int(module.layer_idx)] = AttentionLayerSpec(
                layer_name=name,
                num_heads=int(module.num_heads),
                num_kv_heads=1,
                head_size=row,
                scale=float(module.scaling),
                value_size=int(module.kv_lora_rank),
            )
        if len(specs) != config.num_hidden_layers:
            raise ModelLoadError(
                f"{source.architecture}: found {len(specs)} MLA attention modules, expected {config.num_hidden_layers}"
            )
        # Nothing computes transformers' causal mask for these layers: the eager implementation would build one
        # of [tokens, tokens] per step. "patchbay" makes transformers skip it (registered by the generic path).
        model.config._attn_implementation = "patchbay"
        return ArchitectureModel(model, specs)
