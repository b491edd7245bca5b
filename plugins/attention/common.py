"""The shared metadata builders: ``common`` (per-request lengths on the CPU) and ``varlen`` (ragged key slots)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch

from patchbay.interfaces import AttentionMetadataBuilder, Capabilities, CommonAttentionMetadata
from patchbay.plugins.attention._paged import ragged_slots, window_start


@dataclass
class PagedAttentionMetadata:
    """One step's batch, as the built-in backends read it.

    Carries the runner's :class:`CommonAttentionMetadata` unchanged, plus
    per-request lengths as Python lists so that backends can plan without
    device synchronisation.  For the example in ``CommonAttentionMetadata``
    (2, 5 and 3 new tokens after 4, 0 and 9 cached ones)::

        query_starts = [0, 2, 7, 10]
        query_lens   = [2, 5, 3]
        context_lens = [4, 0, 9]
        seq_lens     = [6, 5, 12]
    """

    common: CommonAttentionMetadata
    query_starts: list[int]
    """``query_start_loc`` as a list: request ``i`` owns rows ``query_starts[i]:query_starts[i+1]``."""
    query_lens: list[int]
    context_lens: list[int]
    """Tokens of each request already in the cache before this step."""
    seq_lens: list[int]
    """Tokens of each request in the cache after this step."""

    @property
    def num_reqs(self) -> int:
        return self.common.num_reqs

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    @property
    def block_size(self) -> int:
        return self.common.block_size

    @property
    def block_table(self) -> torch.Tensor:
        return self.common.block_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Cache slot of each actual token (padding past ``num_actual_tokens`` cut off)."""
        return self.common.slot_mapping[: self.common.num_actual_tokens]


def paged_metadata(common: CommonAttentionMetadata) -> PagedAttentionMetadata:
    """Derive the per-request lengths of :class:`PagedAttentionMetadata` from ``common`` (which is not modified)."""
    num_reqs = common.num_reqs
    query_starts = [int(x) for x in common.query_start_loc_cpu[: num_reqs + 1].tolist()]
    seq_lens = [int(x) for x in common.seq_lens_cpu[:num_reqs].tolist()]
    query_lens = [end - start for start, end in itertools.pairwise(query_starts)]
    context_lens = [seq_len - query_len for seq_len, query_len in zip(seq_lens, query_lens, strict=True)]
    return PagedAttentionMetadata(common, query_starts, query_lens, context_lens, seq_lens)


MetadataT = TypeVar("MetadataT", bound=PagedAttentionMetadata)


def extend_metadata(paged: PagedAttentionMetadata, cls: type[MetadataT], **extra: Any) -> MetadataT:
    """A ``cls`` (a subclass of :class:`PagedAttentionMetadata`) with ``paged``'s fields and the ``extra`` ones."""
    wanted = {field.name for field in fields(cls)}
    base = {field.name: getattr(paged, field.name) for field in fields(paged) if field.name in wanted}
    return cls(**base, **extra)


class CommonMetadataBuilder(AttentionMetadataBuilder):
    """Passes the runner's common metadata through, with per-request query, context and sequence lengths as lists."""

    contract_version = "1.1"

    capabilities: ClassVar[Capabilities] = Capabilities(devices=("cpu", "cuda", "mps"))

    def build(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        """Return :class:`PagedAttentionMetadata` for this step (``common`` is not modified)."""
        if common.block_size != self.block_size:
            raise ValueError(
                f"metadata builder for block size {self.block_size} got a batch with block size {common.block_size}"
            )
        return paged_metadata(common)


@dataclass
class VarlenAttentionMetadata(PagedAttentionMetadata):
    """:class:`PagedAttentionMetadata` plus where each request's attended keys sit in the cache, as one ragged sequence.

    Backends that want contiguous keys (flex, varlen kernels) gather
    ``kv_slots`` from the cache; request ``i``'s keys are then rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``, its positions
    ``key_starts[i] .. seq_lens[i] - 1``.  ``key_starts`` is 0 except with a
    sliding window, where keys no query of the step can see are left out.
    """

    sliding_window: int | None
    key_starts: list[int]
    cu_seqlens_k: torch.Tensor
    """int32 ``[num_reqs + 1]`` on the device: cumulative key counts starting at 0."""
    max_key_len: int
    kv_slots: torch.Tensor
    """long ``[total_keys]``: cache slot of every attended key, request after request."""
    kv_request_ids: torch.Tensor
    """long ``[total_keys]``: the request each key belongs to."""
    kv_positions: torch.Tensor
    """long ``[total_keys]``: the position of each key in its request."""


def varlen_metadata(paged: PagedAttentionMetadata, sliding_window: int | None) -> VarlenAttentionMetadata:
    """Extend ``paged`` with the ragged key layout of :class:`VarlenAttentionMetadata`."""
    key_starts = [window_start(context_len, sliding_window) for context_len in paged.context_lens]
    key_lens = [seq_len - start for start, seq_len in zip(key_starts, paged.seq_lens, strict=True)]
    slots, request_ids, positions = ragged_slots(paged.block_table, key_starts, paged.seq_lens, paged.block_size)
    cu_seqlens_k = torch.tensor([0, *itertools.accumulate(key_lens)], dtype=torch.int32, device=slots.device)
    return extend_metadata(
        paged,
        VarlenAttentionMetadata,
        sliding_window=sliding_window,
        key_starts=key_starts,
        cu_seqlens_k=cu_seqlens_k,
        max_key_len=max(key_lens, default=0),
        kv_slots=slots,
        kv_request_ids=request_ids,
        kv_positions=positions,
    )


class VarlenMetadataBuilder(CommonMetadataBuilder):
    """Adds the cache slots of every request's keys as one ragged sequence, for backends that gather them."""

    contract_version = "1.1"

    def build(self, common: CommonAttentionMetadata) -> VarlenAttentionMetadata:
        """Return :class:`VarlenAttentionMetadata` for this step (``common`` is not modified)."""
        return varlen_metadata(super().build(common), self.sliding_window)


def as_paged(metadata: PagedAttentionMetadata | CommonAttentionMetadata) -> PagedAttentionMetadata:
    """``metadata`` as :class:`PagedAttentionMetadata` (derived here when a builder passed the common metadata)."""
    if isinstance(metadata, CommonAttentionMetadata):
        return paged_metadata(metadata)
    return metadata


def as_varlen(
    metadata: PagedAttentionMetadata | CommonAttentionMetadata, sliding_window: int | None
) -> VarlenAttentionMetadata:
    """``metadata`` as :class:`VarlenAttentionMetadata` for ``sliding_window``, derived here if the builder did not."""
    if isinstance(metadata, VarlenAttentionMetadata) and metadata.sliding_window == sliding_window:
        return metadata
    return varlen_metadata(as_paged(metadata), sliding_window)


VarlenT = TypeVar("VarlenT", bound=VarlenAttentionMetadata)


def as_extended_varlen(
    metadata: PagedAttentionMetadata | CommonAttentionMetadata,
    cls: type[VarlenT],
    sliding_window: int | None,
    extend: Callable[[VarlenAttentionMetadata], VarlenT],
) -> VarlenT:
    """``metadata`` as ``cls`` (a :class:`VarlenAttentionMetadata` subclass) for ``sliding_window``.

    The builder's own result when it is a ``cls`` built for that window;
    metadata from another builder (or for another window) is extended here,
    for this layer: ``extend(as_varlen(metadata, sliding_window))``.
    """
    if isinstance(metadata, cls) and metadata.sliding_window == sliding_window:
        return metadata
    return extend(as_varlen(metadata, sliding_window))
