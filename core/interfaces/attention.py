"""Attention backends, their per-layer implementations and attention-metadata builders.

The runner flattens every request's scheduled tokens of one step into one
sequence of ``num_actual_tokens`` rows (request after request, in batch
order).  Each attention layer calls its :class:`AttentionImpl` once per step
with that step's queries, keys and values; the implementation writes the new
keys and values into the paged KV cache at ``slot_mapping`` and attends each
query to its own request's cached and new keys, causally.

An encoder-only model (BERT, RoBERTa, XLM-R, pooled by a pooling engine)
keeps no KV cache: each of its steps runs whole prompts, and every query
attends to every key of its own request in the step, both ways
(``CommonAttentionMetadata.causal`` is ``False``).  Only backends that
declare ``supports_encoder_only`` are given such steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel


@dataclass(frozen=True)
class AttentionConfig(ServingConfig):
    """The attention shape a backend is asked to serve (one KV-cache group)."""

    head_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 8
    block_size: int = 16
    sliding_window: int | None = None
    """Window in tokens for sliding-window layers; ``None`` for full attention."""
    logits_soft_cap: float | None = None
    cache_dtype: str | None = None
    """The KV cache's dtype where it differs from :attr:`dtype` (``"int8"``: see
    :mod:`patchbay.interfaces.int8_kv`); ``None``: the cache holds keys and values in :attr:`dtype`."""
    value_size: int | None = None
    """MLA's latent cache (see :attr:`AttentionLayerSpec.value_size`); ``None``: separate keys and values."""
    encoder_only: bool = False
    """The layers are an encoder-only model's: bidirectional attention over each step's own keys, no KV cache."""


@dataclass(frozen=True)
class AttentionCapabilities(Capabilities):
    """What an attention backend can serve."""

    head_sizes: tuple[int, ...] | None = None
    """Supported head sizes; ``None`` means any."""
    block_sizes: tuple[int, ...] | None = None
    """Supported KV-cache block sizes; ``None`` means any multiple of :attr:`block_size_multiple`."""
    block_size_multiple: int = 1
    supports_gqa: bool = True
    """Grouped-query attention (fewer KV heads than query heads)."""
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False
    cache_dtypes: tuple[str, ...] = ()
    """Cache dtypes the backend reads and writes besides the model's (``("int8",)``: rows in the format of
    :mod:`patchbay.interfaces.int8_kv`)."""
    supports_latent_kv: bool = False
    """MLA layers: one cache row per token, its first ``value_size`` features the value
    (:attr:`AttentionLayerSpec.value_size`)."""
    supports_encoder_only: bool = False
    """Encoder-only steps: ``causal`` metadata ``False``, an empty ``kv_cache``, whole prompts attended both ways
    (see :meth:`AttentionImpl.forward`)."""
    priority: int = 0
    """Rank for ``attention.name: auto``: among backends that can serve a run, the highest wins."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if not isinstance(config, AttentionConfig):
            return found
        if self.head_sizes is not None and config.head_size not in self.head_sizes:
            found.append(f"head size {config.head_size} not supported (supports {list(self.head_sizes)})")
        if self.block_sizes is not None and config.block_size not in self.block_sizes:
            found.append(f"block size {config.block_size} not supported (supports {list(self.block_sizes)})")
        if config.block_size % self.block_size_multiple:
            found.append(f"block size {config.block_size} is not a multiple of {self.block_size_multiple}")
        if not self.supports_gqa and config.num_kv_heads != config.num_heads:
            found.append(
                f"grouped-query attention not supported ({config.num_heads} query heads, "
                f"{config.num_kv_heads} KV heads)"
            )
        if config.sliding_window is not None and not self.supports_sliding_window:
            found.append(f"sliding-window attention not supported (window {config.sliding_window})")
        if config.logits_soft_cap is not None and not self.supports_logits_soft_cap:
            found.append("attention logits soft-capping not supported")
        if config.encoder_only and not self.supports_encoder_only:
            found.append("encoder-only attention (bidirectional, without a KV cache) not supported")
        if config.cache_dtype is not None and config.cache_dtype not in self.cache_dtypes:
            found.append(f"{config.cache_dtype} KV cache not supported (supports {list(self.cache_dtypes) or 'none'})")
        if config.value_size is not None and not self.supports_latent_kv:
            found.append("MLA's latent KV cache (one row per token, values inside the keys) not supported")
        return found


@dataclass
class CommonAttentionMetadata:
    """Backend-neutral description of one step's batch for one KV-cache group.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    those rows are its tokens at positions
    ``seq_lens[i] - query_len .. seq_lens[i] - 1``.  Tensors without the
    ``_cpu`` suffix live on the run's device.

    Example, three requests scheduling 2, 5 and 3 tokens with 4, 0 and 9
    tokens already in the cache::

        query_start_loc = [0, 2, 7, 10]
        seq_lens        = [6, 5, 12]
        num_computed_tokens_cpu = [4, 0, 9]
    """

    query_start_loc: torch.Tensor
    """int32 ``[num_reqs + 1]``, cumulative query lengths starting at 0."""
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    """int32 ``[num_reqs]``, tokens in the cache for each request after this step."""
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    """int32 ``[num_reqs]``, tokens already in the cache before this step."""
    block_table: torch.Tensor
    """int32 ``[num_reqs, max_blocks_per_req]``, physical block ids; unused entries are 0."""
    slot_mapping: torch.Tensor
    """int64 ``[num_actual_tokens]``, cache slot (``block_id * block_size + offset``) of each new token."""
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    causal: bool = True
    """``False``: an encoder-only model's step (no KV cache; each request whole, attended both ways)."""


@dataclass(frozen=True)
class AttentionLayerSpec:
    """The fixed shape of one attention layer, given when its implementation is created."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    """Multiplies ``q . k`` before the soft cap and the softmax (usually ``head_size ** -0.5``)."""
    sliding_window: int | None = None
    """Window ``W`` in tokens: the query at position ``p`` sees the keys at positions ``p - W + 1 .. p``
    (``W`` keys, itself included; position ``p - W`` is out).  ``None``: every key up to ``p``."""
    logits_soft_cap: float | None = None
    """Cap ``c``: each score ``s = scale * (q . k)`` becomes ``c * tanh(s / c)`` before masking and the
    softmax (Gemma 2).  ``None``: scores are used as they are."""
    value_size: int | None = None
    """MLA's latent cache (DeepSeek-V2/V3): each token has one cache row, its key of ``head_size`` features
    (``num_kv_heads`` is 1: the compressed latent, then the rotary key), and its value is the first
    ``value_size`` features of that same row (the latent).  Such a layer passes ``key[..., :value_size]`` as
    the value to :meth:`AttentionImpl.forward` and gets ``[num_tokens, num_heads, value_size]`` back.
    ``None``: keys and values are cached apart, ``head_size`` features each."""

    @property
    def latent(self) -> bool:
        """Whether the layer caches MLA latent rows (:attr:`value_size` is set)."""
        return self.value_size is not None


class AttentionImpl(ABC):
    """One layer's attention computation, created by :meth:`AttentionBackend.make_impl`."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Write this step's keys and values into ``kv_cache`` and return the attention output.

        ``query`` is ``[num_tokens, num_heads, head_size]``; ``key`` and
        ``value`` are ``[num_tokens, num_kv_heads, head_size]``, where
        ``num_tokens >= metadata.num_actual_tokens`` (rows past it are
        padding and must be ignored).  ``kv_cache`` has the shape given by
        :meth:`AttentionBackend.kv_cache_shape`; it is ``torch.int8`` when the
        run asked for an int8 cache (its rows in the format of
        :mod:`patchbay.interfaces.int8_kv`), else in the model's dtype.  ``metadata`` is what the
        backend's metadata builder built for this layer's KV-cache group.

        Returns ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype;
        padding rows may hold anything.  Each query attends, causally, to all
        keys of its own request up to its own position (within
        ``sliding_window`` when set), scaled by ``scale`` and soft-capped by
        ``logits_soft_cap`` when set (see :class:`AttentionLayerSpec`).

        For a latent (MLA) layer (``value_size`` set in its spec, only given to a backend that declares
        ``supports_latent_kv``), ``key`` is ``[num_tokens, 1, head_size]``, ``value`` is its view
        ``key[..., :value_size]`` (the same features: nothing of it is written apart), ``kv_cache`` has the shape of
        :meth:`AttentionBackend.latent_kv_cache_shape`, each token's one row is its key, the first
        ``value_size`` features of each cached row are its value, and the output is
        ``[num_tokens, num_heads, value_size]``.

        When the metadata's common part has ``causal`` ``False`` (an
        encoder-only model; only backends declaring ``supports_encoder_only``
        get these), ``kv_cache`` is empty and nothing is written: every
        request runs whole in the step, and each query attends to all of its
        own request's keys of the step, before and after it.
        """


class AttentionBackend(Plugin):
    """An attention backend: the KV-cache layout and a factory of per-layer implementations."""

    kind: ClassVar[str] = "attention"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities()
    metadata_builder: ClassVar[str] = "common"
    """Registered name of the metadata builder whose output :meth:`AttentionImpl.forward` reads."""

    def __init__(self, options: BaseModel | None = None) -> None:
        """Create the backend with its validated ``options`` (``None``: the defaults)."""
        self.options = options if options is not None else self.Options()

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor.

        ``head_size`` is the row size: the model's head size, or that plus 4
        for an int8 cache (:func:`patchbay.interfaces.int8_kv.row_size`).
        The default layout is ``(2, num_blocks, block_size, num_kv_heads,
        head_size)``: keys at index 0, values at 1.  A backend that changes it
        must also override :meth:`split_kv_cache`.
        """
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def latent_kv_cache_shape(num_blocks: int, block_size: int, row_size: int) -> tuple[int, ...]:
        """Shape of one latent (MLA) layer's cache tensor: ``(num_blocks, block_size, 1, row_size)``, one row per
        token, keys and values in it (see :attr:`AttentionLayerSpec.value_size`).  A backend that changes it must
        keep the blocks on the first dimension: the runner zeroes ``kv_cache[block_ids]``."""
        return (num_blocks, block_size, 1, row_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the key and value caches, each ``[num_blocks, block_size, num_kv_heads, head_size]``.

        This is how KV connectors and the conformance suite read and write a
        backend's cache without knowing its layout.
        """
        return kv_cache[0], kv_cache[1]

    @abstractmethod
    def make_impl(self, layer: AttentionLayerSpec) -> AttentionImpl:
        """Create the implementation for one attention layer."""


class AttentionMetadataBuilder(Plugin):
    """Builds a backend's per-step metadata from :class:`CommonAttentionMetadata`.

    One builder instance exists per KV-cache group; :meth:`build` runs once
    per step per group and its result is shared by all layers of the group.
    """

    kind: ClassVar[str] = "attention_metadata_builder"

    def __init__(
        self,
        options: BaseModel | None = None,
        *,
        block_size: int = 16,
        sliding_window: int | None = None,
        device: str = "cpu",
    ) -> None:
        """Create the builder for one KV-cache group (its block size, window and device)."""
        self.options = options if options is not None else self.Options()
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Return this step's metadata for the group's layers.

        Must not modify ``common``.  May precompute anything the backend
        needs (masks, per-request sequence views, ...); the result is passed
        unchanged to :meth:`AttentionImpl.forward` of every layer in the group.
        """

    def reorder_batch(self, num_scheduled_tokens: Sequence[int]) -> list[int] | None:
        """Optionally ask the runner to reorder this step's requests.

        ``num_scheduled_tokens[i]`` is the number of tokens request ``i`` of
        the persistent batch runs this step.  Return a permutation (new order
        as a list of current indices) or ``None`` to keep the order.  Backends
        that split decodes from prefills use this to put decodes first.
        """
        return None
