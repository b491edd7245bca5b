"""The ``flex`` backend: ``torch.nn.attention.flex_attention`` with a block mask derived from the paged layout.

Every request's attended keys are gathered from the cache into one ragged
sequence (see :class:`VarlenAttentionMetadata`); the step's queries form
another.  One ``mask_mod`` over both says who sees whom: a query sees a key
of its own request at a position no later than its own (and within the
sliding window).  The :class:`BlockMask` is built once per step by the
``flex`` metadata builder and shared by all layers of the KV-cache group.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionImpl,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from patchbay.plugins.attention._paged import gather_slots, ragged_slots, split_and_write_kv
from patchbay.plugins.attention.common import (
    PagedAttentionMetadata,
    VarlenAttentionMetadata,
    VarlenMetadataBuilder,
    as_extended_varlen,
    extend_metadata,
)

_FLEX_MODULE = "torch.nn.attention.flex_attention"


FLEX_BLOCK = 128
"""flex_attention's tile: query and key sequences are padded to a multiple of it."""


@dataclass
class FlexAttentionMetadata(VarlenAttentionMetadata):
    """:class:`VarlenAttentionMetadata` with the step's flex ``BlockMask`` over padded sequences.

    Queries and keys are padded to multiples of :data:`FLEX_BLOCK`, so the
    mask is never evaluated out of bounds and a compiled kernel sees few
    distinct shapes; padding queries and keys belong to no request.
    """

    block_mask: Any
    """``torch.nn.attention.flex_attention.BlockMask`` over ``[padded_query_len, len(padded_kv_slots)]``."""
    padded_query_len: int
    padded_kv_slots: torch.Tensor
    """``kv_slots`` padded with slot 0 (masked out)."""


def _padded(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, length - values.shape[0]), value=fill)


def flex_metadata(varlen: VarlenAttentionMetadata) -> FlexAttentionMetadata:
    """Build the block mask of ``varlen``'s step and return it with the metadata."""
    from torch.nn.attention.flex_attention import create_block_mask

    # Queries as a ragged sequence too: request id and position of every actual token.
    _, query_request_ids, query_positions = ragged_slots(
        varlen.block_table, varlen.context_lens, varlen.seq_lens, varlen.block_size
    )
    query_len = -(-max(varlen.num_actual_tokens, 1) // FLEX_BLOCK) * FLEX_BLOCK
    kv_len = -(-max(varlen.kv_slots.shape[0], 1) // FLEX_BLOCK) * FLEX_BLOCK
    # Distinct "request ids" -1 and -2 keep padding queries and padding keys apart.
    query_request_ids = _padded(query_request_ids, query_len, -1)
    query_positions = _padded(query_positions, query_len, 0)
    key_request_ids = _padded(varlen.kv_request_ids, kv_len, -2)
    key_positions = _padded(varlen.kv_positions, kv_len, 0)
    window = varlen.sliding_window

    def mask_mod(
        batch: torch.Tensor, head: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor
    ) -> torch.Tensor:
        query_position = query_positions[query_index]
        key_position = key_positions[key_index]
        visible = (query_request_ids[query_index] == key_request_ids[key_index]) & (key_position <= query_position)
        if window is not None:
            visible = visible & (key_position > query_position - window)
        return visible

    block_mask = create_block_mask(mask_mod, None, None, query_len, kv_len, device=varlen.kv_slots.device)
    return extend_metadata(
        varlen,
        FlexAttentionMetadata,
        block_mask=block_mask,
        padded_query_len=query_len,
        padded_kv_slots=_padded(varlen.kv_slots, kv_len, 0),
    )


class FlexMetadataBuilder(VarlenMetadataBuilder):
    """Gathers every request's key slots into one ragged sequence and builds the step's flex block mask."""

    contract_version = "1.1"

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        """Return :class:`FlexAttentionMetadata` for this step (``common`` is not modified)."""
        return flex_metadata(super().build(common))


class FlexOptions(BaseModel):
    """Options of the ``flex`` backend."""

    model_config = ConfigDict(extra="forbid")

    compile: bool = False
    """Run ``flex_attention`` through ``torch.compile``: fused kernels, compiled once per padded shape.

    Shapes are static (``dynamic=False``): on CPU, torch 2.13's inductor fails
    to compile flex_attention with dynamic shapes.
    """


class FlexAttentionBackend(AttentionBackend):
    """torch flex_attention over the gathered paged KV, masked by a BlockMask built once per step."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = FlexOptions
    options: FlexOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cpu", "cuda"),
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        priority=1,
    )
    metadata_builder: ClassVar[str] = "flex"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why flex_attention cannot run here (it needs a torch that ships it), or ``None``."""
        if importlib.util.find_spec(_FLEX_MODULE) is None:
            return f"needs {_FLEX_MODULE} (torch >= 2.5; this torch is {torch.__version__})"
        return None

    def make_impl(self, layer: AttentionLayerSpec) -> FlexAttentionImpl:
        """Create the implementation of one layer."""
        return FlexAttentionImpl(layer, compile_kernel=self.options.compile)


_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex_function(compile_kernel: bool) -> Callable[..., torch.Tensor]:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_kernel:
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexAttentionImpl(AttentionImpl):
    """One layer of :class:`FlexAttentionBackend`."""

    def __init__(self, layer: AttentionLayerSpec, *, compile_kernel: bool = False) -> None:
        self.layer = layer
        self.compile_kernel = compile_kernel
        self.flex_attention = _flex_function(compile_kernel)
        self.score_mod = _soft_cap(layer.logits_soft_cap) if layer.logits_soft_cap is not None else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexAttentionMetadata | PagedAttentionMetadata | CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys and values, gather every request's keys, and attend under the step's block mask."""
        metadata = as_extended_varlen(metadata, FlexAttentionMetadata, self.layer.sliding_window, flex_metadata)
        key_cache, value_cache = split_and_write_kv(FlexAttentionBackend, kv_cache, key, value, metadata.slot_mapping)
        output = torch.zeros_like(query)
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return output
        keys, values = (
            rows.transpose(0, 1)[None]
            for rows in gather_slots(key_cache, value_cache, metadata.padded_kv_slots, query.dtype)
        )
        queries = query.new_zeros(metadata.padded_query_len, *query.shape[1:])
        queries[:num_tokens] = query[:num_tokens]
        with warnings.catch_warnings():
            if not self.compile_kernel:
                # Choosing the unfused path is the operator's call (Options.compile); do not warn every run.
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            attended = self.flex_attention(
                queries.transpose(0, 1)[None],
                keys,
                values,
                score_mod=self.score_mod,
                block_mask=metadata.block_mask,
                scale=self.layer.scale,
                enable_gqa=self.layer.num_heads != self.layer.num_kv_heads,
            )
        output[:num_tokens] = attended[0, :, :num_tokens].transpose(0, 1)
        return output


def _soft_cap(cap: float) -> Callable[..., torch.Tensor]:
    def soft_cap(
        score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap
