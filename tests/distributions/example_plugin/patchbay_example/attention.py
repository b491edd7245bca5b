"""``example_dense``: the simplest correct attention backend over the paged KV cache.

Each step it writes the new keys and values into the cache at
``slot_mapping``, then, request by request, gathers that request's blocks
from the block table and runs dense causal attention in float32.  A Python
loop over requests is slow but easy to check; that is the point of an example.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import AttentionBackend, AttentionCapabilities, AttentionImpl, AttentionLayerSpec


class ExampleDenseOptions(BaseModel):
    """Options of ``attention: {name: example_dense, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    scale_override: float | None = None
    """Softmax scale to use instead of the layer's own (``None``: the layer's ``scale``)."""


class ExampleDenseImpl(AttentionImpl):
    """One layer of :class:`ExampleDenseBackend`."""

    def __init__(self, layer: AttentionLayerSpec, scale: float) -> None:
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(
                f"{layer.layer_name}: {layer.num_heads} query heads are not a multiple of {layer.num_kv_heads} KV heads"
            )
        self.layer = layer
        self.scale = scale

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        # Only CommonAttentionMetadata fields are read: the "common" builder carries them as `.common`,
        # "example_passthrough" returns them as they are.
        metadata = getattr(metadata, "common", metadata)
        num_tokens = metadata.num_actual_tokens
        key_cache, value_cache = ExampleDenseBackend.split_kv_cache(kv_cache)
        block_size = key_cache.shape[1]

        # Slot s lives in block s // block_size at offset s % block_size.
        slots = metadata.slot_mapping[:num_tokens].to(device=kv_cache.device, dtype=torch.long)
        key_cache[slots // block_size, slots % block_size] = key[:num_tokens].to(key_cache.dtype)
        value_cache[slots // block_size, slots % block_size] = value[:num_tokens].to(value_cache.dtype)

        output = torch.zeros_like(query)  # padding rows past num_actual_tokens stay zero
        query_start_loc = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        group_size = self.layer.num_heads // self.layer.num_kv_heads
        for request in range(metadata.num_reqs):
            start, end = query_start_loc[request], query_start_loc[request + 1]
            seq_len = seq_lens[request]
            if end == start:
                continue
            num_blocks = -(-seq_len // block_size)
            block_ids = metadata.block_table[request, :num_blocks].to(device=kv_cache.device, dtype=torch.long)
            # [num_blocks, block_size, kv_heads, head] -> the request's first seq_len tokens, one row per token.
            keys = key_cache[block_ids].flatten(0, 1)[:seq_len].float()
            values = value_cache[block_ids].flatten(0, 1)[:seq_len].float()
            # Grouped-query attention: query head h reads KV head h // group_size.
            keys = keys.repeat_interleave(group_size, dim=1)
            values = values.repeat_interleave(group_size, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * self.scale
            if metadata.causal:
                # The request's queries are its last (end - start) tokens: positions seq_len - q_len .. seq_len - 1.
                query_positions = torch.arange(seq_len - (end - start), seq_len, device=scores.device)
                key_positions = torch.arange(seq_len, device=scores.device)
                scores = scores.masked_fill(key_positions[None, :] > query_positions[:, None], float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            output[start:end] = torch.einsum("hqk,khd->qhd", weights, values).to(query.dtype)
        return output


class ExampleDenseBackend(AttentionBackend):
    """Dense causal attention per request over the gathered paged blocks; simple, correct and slow."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = ExampleDenseOptions
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_gqa=True,
        supports_sliding_window=False,
        supports_logits_soft_cap=False,
        # Never the pick of `name: auto` over a real backend.
        priority=-100,
    )
    metadata_builder: ClassVar[str] = "common"

    def make_impl(self, layer: AttentionLayerSpec) -> ExampleDenseImpl:
        if layer.sliding_window is not None or layer.logits_soft_cap is not None:
            raise ValueError(f"example_dense supports neither sliding windows nor soft-capping ({layer.layer_name})")
        scale = self.options.scale_override if self.options.scale_override is not None else layer.scale
        return ExampleDenseImpl(layer, scale)
