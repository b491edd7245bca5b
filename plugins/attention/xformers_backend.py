"""The ``xformers`` backend: ``xformers.ops.memory_efficient_attention`` over gathered paged KV (CUDA).

Each request's attended keys are gathered from the cache into one ragged
sequence; a block-diagonal bias, causal from the bottom right (and local
for sliding-window layers), keeps each query to its own request's keys at
positions no later than its own.  The bias is built once per step by the
``xformers`` metadata builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from patchbay.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionImpl,
    AttentionLayerSpec,
    Capabilities,
    CommonAttentionMetadata,
)
from patchbay.plugins.attention._paged import (
    cuda_package_unavailable_reason,
    gather_slots,
    package_unavailable_reason,
    split_and_write_kv,
)
from patchbay.plugins.attention.common import (
    PagedAttentionMetadata,
    VarlenAttentionMetadata,
    VarlenMetadataBuilder,
    as_extended_varlen,
    extend_metadata,
)


@dataclass
class XFormersMetadata(VarlenAttentionMetadata):
    """:class:`VarlenAttentionMetadata` with the step's xformers attention bias."""

    attn_bias: Any
    """An ``xformers.ops.fmha.attn_bias`` block-diagonal mask over the step's queries and gathered keys."""


def xformers_metadata(varlen: VarlenAttentionMetadata) -> XFormersMetadata:
    """Build the block-diagonal bias of ``varlen``'s step (``None`` for an empty step)."""
    if varlen.num_actual_tokens == 0:
        return extend_metadata(varlen, XFormersMetadata, attn_bias=None)
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask, BlockDiagonalMask

    key_lens = [seq_len - start for start, seq_len in zip(varlen.key_starts, varlen.seq_lens, strict=True)]
    device = varlen.kv_slots.device
    if varlen.sliding_window is None:
        bias = BlockDiagonalCausalFromBottomRightMask.from_seqlens(varlen.query_lens, key_lens, device=device)
    else:
        bias = BlockDiagonalMask.from_seqlens(varlen.query_lens, key_lens, device=device)
        # xformers' local window: a key is visible when it is less than window_size positions behind the query.
        bias = bias.make_local_attention_from_bottomright(varlen.sliding_window)
    return extend_metadata(varlen, XFormersMetadata, attn_bias=bias)


class XFormersMetadataBuilder(VarlenMetadataBuilder):
    """Gathers every request's key slots into one ragged sequence and builds the step's xformers bias."""

    contract_version = "1.1"

    capabilities: ClassVar[Capabilities] = Capabilities(devices=("cuda",))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Needs the xformers package (checked without importing it)."""
        return package_unavailable_reason("xformers")

    def build(self, common: CommonAttentionMetadata) -> XFormersMetadata:
        """Return :class:`XFormersMetadata` for this step (``common`` is not modified)."""
        return xformers_metadata(super().build(common))


class XFormersBackend(AttentionBackend):
    """xformers memory_efficient_attention over gathered paged KV with a block-diagonal causal bias; CUDA only."""

    contract_version = "1.1"

    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cuda",),
        dtypes=("float16", "bfloat16"),
        head_sizes=(32, 64, 96, 128),
        supports_sliding_window=True,
        priority=20,
    )
    metadata_builder: ClassVar[str] = "xformers"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Needs CUDA and the xformers package (checked without importing it)."""
        return cuda_package_unavailable_reason("xformers")

    def make_impl(self, layer: AttentionLayerSpec) -> XFormersImpl:
        """Create the implementation of one layer."""
        return XFormersImpl(layer)


class XFormersImpl(AttentionImpl):
    """One layer of :class:`XFormersBackend`."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        if layer.logits_soft_cap is not None:
            raise ValueError(f"xformers cannot soft-cap attention logits (layer {layer.layer_name})")
        from xformers.ops import memory_efficient_attention

        self.layer = layer
        self.memory_efficient_attention = memory_efficient_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: XFormersMetadata | PagedAttentionMetadata | CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys and values, gather every request's keys, and attend in one kernel call."""
        metadata = as_extended_varlen(metadata, XFormersMetadata, self.layer.sliding_window, xformers_metadata)
        key_cache, value_cache = split_and_write_kv(XFormersBackend, kv_cache, key, value, metadata.slot_mapping)
        output = torch.zeros_like(query)
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return output
        num_kv_heads, head_size = key_cache.shape[-2:]
        group = self.layer.num_heads // num_kv_heads
        keys, values = (rows[None] for rows in gather_slots(key_cache, value_cache, metadata.kv_slots, query.dtype))
        queries = query[:num_tokens][None]
        if group > 1:
            # GQA in xformers' [batch, tokens, kv_heads, group, head_size] form: keys broadcast over the group.
            queries = queries.view(1, num_tokens, num_kv_heads, group, head_size)
            keys = keys[:, :, :, None].expand(-1, -1, -1, group, -1)
            values = values[:, :, :, None].expand(-1, -1, -1, group, -1)
        attended = self.memory_efficient_attention(
            queries, keys, values, attn_bias=metadata.attn_bias, scale=self.layer.scale
        )
        output[:num_tokens] = attended.reshape(num_tokens, self.layer.num_heads, head_size)
        return output
