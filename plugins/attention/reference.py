"""The reference backend: plain torch over the paged cache, one request at a time, in float32.

It serves MLA's latent layers too (one cache row per token, the value its first ``value_size`` features).
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
from patchbay.plugins.attention._paged import as_float, split_and_write_kv, write_latent_rows
from patchbay.plugins.attention.common import PagedAttentionMetadata, as_paged


class ReferenceBackend(AttentionBackend):
    """Dense float32 attention per request over its gathered blocks; correctness over speed."""

    contract_version = "1.1"

    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cpu", "cuda", "mps"),
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        supports_latent_kv=True,
        supports_encoder_only=True,
        priority=0,
    )
    metadata_builder: ClassVar[str] = "common"

    def make_impl(self, layer: AttentionLayerSpec) -> ReferenceImpl:
        """Create the implementation of one layer."""
        return ReferenceImpl(layer)


class ReferenceImpl(AttentionImpl):
    """One layer of :class:`ReferenceBackend`."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        self.layer = layer

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata | CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys and values, then attend each request's queries to its cached keys."""
        metadata = as_paged(metadata)
        if not metadata.common.causal:
            return self._encoder_only(query, key, value, metadata)
        if self.layer.value_size is not None:
            return self._forward_latent(query, key, kv_cache, metadata, self.layer.value_size)
        key_cache, value_cache = split_and_write_kv(ReferenceBackend, kv_cache, key, value, metadata.slot_mapping)
        output = torch.zeros_like(query)
        for request in range(metadata.num_reqs):
            start, end = metadata.query_starts[request], metadata.query_starts[request + 1]
            if start == end:
                continue
            keys, values = self._cached(key_cache, value_cache, metadata, request)
            output[start:end] = self._attend(query[start:end], keys, values, metadata.context_lens[request])
        return output

    def _forward_latent(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        size: int,
    ) -> torch.Tensor:
        """A latent (MLA) layer: write each token's one row, attend to the cached rows, their first ``size``
        features the values."""
        write_latent_rows(kv_cache, key, metadata.slot_mapping)
        output = query.new_zeros(*query.shape[:-1], size)
        for request in range(metadata.num_reqs):
            start, end = metadata.query_starts[request], metadata.query_starts[request + 1]
            if start == end:
                continue
            rows, _ = self._cached(kv_cache, kv_cache, metadata, request)
            rows = as_float(rows, torch.float32)
            output[start:end] = self._attend(query[start:end], rows, rows[..., :size], metadata.context_lens[request])
        return output

    def _encoder_only(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> torch.Tensor:
        """No cache: each request's queries attend all of its step's keys, both ways (an encoder-only model)."""
        output = torch.zeros_like(query)
        for request in range(metadata.num_reqs):
            start, end = metadata.query_starts[request], metadata.query_starts[request + 1]
            output[start:end] = self._attend(query[start:end], key[start:end], value[start:end], None)
        return output

    @staticmethod
    def _cached(
        key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: PagedAttentionMetadata, request: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = metadata.seq_lens[request]
        num_blocks = -(-seq_len // metadata.block_size)
        blocks = metadata.block_table[request, :num_blocks].long()
        num_kv_heads, head_size = key_cache.shape[-2:]
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
        return keys, values

    def _attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int | None
    ) -> torch.Tensor:
        """Dense float32 attention; ``context_len`` ``None``: every key is visible (no causal mask, no window)."""
        layer = self.layer
        group = layer.num_heads // layer.num_kv_heads
        # GQA: query head h reads KV head h // group.
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * layer.scale
        if layer.logits_soft_cap is not None:
            scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
        if context_len is None:
            return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).to(query.dtype)
        query_positions = context_len + torch.arange(query.shape[0], device=query.device)
        key_positions = torch.arange(keys.shape[0], device=query.device)
        visible = key_positions[None, :] <= query_positions[:, None]
        if layer.sliding_window is not None:
            visible &= key_positions[None, :] > query_positions[:, None] - layer.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", weights, values).to(query.dtype)
