"""The ``flash_attn`` backend: flash-attn's ``flash_attn_varlen_func`` (CUDA).

With KV-cache blocks of a multiple of 256 tokens the kernel reads the paged
cache itself (``block_table``); flash-attn rejects smaller pages, so with
smaller blocks each request's keys are first gathered into one ragged
sequence (``cu_seqlens_k``).  flash-attn aligns the causal mask to the
bottom right, which is exactly "a query sees keys up to its own position"
when a request's keys end at its last query.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionImpl,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from patchbay.plugins.attention._paged import cuda_package_unavailable_reason, gather_slots, split_and_write_kv
from patchbay.plugins.attention.common import PagedAttentionMetadata, VarlenAttentionMetadata, as_varlen

PAGED_BLOCK_MULTIPLE = 256
"""flash-attn reads a paged cache only when its block size is a multiple of this."""


class FlashAttentionBackend(AttentionBackend):
    """flash-attn varlen kernels (CUDA): paged KV for blocks of a multiple of 256 tokens, gathered KV otherwise."""

    contract_version = "1.1"

    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cuda",),
        dtypes=("float16", "bfloat16"),
        head_sizes=(32, 64, 96, 128, 160, 192, 224, 256),
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        priority=30,
    )
    metadata_builder: ClassVar[str] = "varlen"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Needs CUDA and the flash-attn package (checked without importing it)."""
        return cuda_package_unavailable_reason("flash_attn", "flash-attn")

    def make_impl(self, layer: AttentionLayerSpec) -> FlashAttentionImpl:
        """Create the implementation of one layer."""
        return FlashAttentionImpl(layer)


class FlashAttentionImpl(AttentionImpl):
    """One layer of :class:`FlashAttentionBackend`."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        from flash_attn import flash_attn_varlen_func

        self.layer = layer
        self.flash_attn_varlen_func = flash_attn_varlen_func
        # flash-attn's window is inclusive on both ends: keys in [p - left, p + right].
        self.window_size = (-1, -1) if layer.sliding_window is None else (layer.sliding_window - 1, 0)
        self.soft_cap = 0.0 if layer.logits_soft_cap is None else layer.logits_soft_cap

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VarlenAttentionMetadata | PagedAttentionMetadata | CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys and values, then run one varlen kernel over the whole batch."""
        metadata = as_varlen(metadata, self.layer.sliding_window)
        key_cache, value_cache = split_and_write_kv(FlashAttentionBackend, kv_cache, key, value, metadata.slot_mapping)
        output = torch.zeros_like(query)
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return output
        common, num_reqs = metadata.common, metadata.num_reqs
        if metadata.block_size % PAGED_BLOCK_MULTIPLE == 0:
            # The kernel reads whole sequences from position 0: cumulative full lengths, not the trimmed ones.
            keys, values = key_cache, value_cache
            seq_lens = common.seq_lens[:num_reqs]
            cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
            max_seqlen_k, block_table = common.max_seq_len, common.block_table[:num_reqs]
        else:
            keys, values = gather_slots(key_cache, value_cache, metadata.kv_slots)
            cu_seqlens_k, max_seqlen_k, block_table = metadata.cu_seqlens_k, metadata.max_key_len, None
        output[:num_tokens] = self.flash_attn_varlen_func(
            query[:num_tokens],
            keys.to(query.dtype),
            values.to(query.dtype),
            cu_seqlens_q=common.query_start_loc[: num_reqs + 1],
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=common.max_query_len,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=self.layer.scale,
            causal=True,
            window_size=self.window_size,
            softcap=self.soft_cap,
            block_table=block_table,
        )
        return output
