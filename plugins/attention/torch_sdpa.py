"""The ``torch_sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention`` over the paged cache.

Each step is planned once per KV-cache group (by :class:`TorchSDPAMetadataBuilder`):

- requests with short queries (decodes, speculative verification) are grouped
  by query length and attended in one padded SDPA call per group: their
  cached blocks are gathered into ``[batch, kv_heads, keys, head_size]`` and a
  boolean mask hides padding keys, future keys and keys outside the window;
- longer queries (prefill chunks) get one SDPA call each: ``is_causal`` over
  the new keys when nothing is cached, else an explicit mask over the
  gathered blocks; on the CPU without a sliding window, a chunk after cached
  tokens is two mask-free calls instead (``_context_split``).

On CPU float32 and bfloat16, single-token queries (decodes) skip the gather
and go through patchbay's C++ kernel over the paged cache instead (option
``decode_kernel``; see ``_cpu_kernel.py``).  On a CPU with AMX, long bfloat16
prefill chunks of head size 64 go through the same extension's AMX kernel
instead of SDPA (option ``prefill_kernel``).

MLA's latent layers (one cache row per token, the value its first
``value_size`` features) run the same kernel with the latent cache as both the
key and the value cache: every query head reads each cached row once, and the
output's features past ``value_size`` (the rotary key's, weighed alike) are
dropped.  Longer queries, and every query off the CPU, attend their request's
gathered rows through one SDPA call each.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionImpl,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from patchbay.plugins.attention._bidirectional import LengthRun, attend_bidirectional, plan_runs
from patchbay.plugins.attention._context_split import attend_after_context
from patchbay.plugins.attention._cpu_kernel import KernelBuild, kernel_unavailable, load_kernel
from patchbay.plugins.attention._paged import (
    Workspace,
    as_cached,
    as_float,
    gather_blocks,
    split_and_write_kv,
    window_start,
    write_latent_rows,
)
from patchbay.plugins.attention.common import (
    CommonMetadataBuilder,
    PagedAttentionMetadata,
    as_paged,
    extend_metadata,
)
from patchbay.toolkit.tiles import bfloat16_products_widened, chunk_runner, chunk_threads

logger = logging.getLogger(__name__)

SHORT_QUERY_LEN = 16
"""Requests with at most this many new tokens are batched with others of the same query length."""

KERNEL_MAX_QUERY_LEN = 256
"""With the C++ kernel (CPU), requests of up to this many new tokens (decodes, drafts, short prefills) have
every token attended by the kernel, all in one call per layer; longer prefills go to SDPA, whose tiled
products scale better with the length (the kernel reads a request's keys once per query token)."""


@dataclass
class ShortQueryBatch:
    """Requests with equal, short query lengths, attended in one SDPA call over their padded gathered blocks."""

    query_len: int
    rows: torch.Tensor
    """long ``[batch * query_len]``: the query (and output) rows, request after request."""
    block_ids: torch.Tensor
    """long ``[batch * num_blocks]``: the blocks to gather, ``num_blocks`` per request (padded with real ids)."""
    num_blocks: int
    mask: torch.Tensor
    """bool ``[batch, 1, query_len, num_blocks * block_size]``: which gathered keys each query sees."""


@dataclass
class KernelQueries:
    """Every query token of the requests with at most :data:`KERNEL_MAX_QUERY_LEN` new tokens, for the C++
    kernel, which attends each token on its own straight over the paged cache (the step's keys are written
    first, so a token of a prefill sees the ones before it)."""

    block_table: torch.Tensor
    """int32 ``[requests, max_blocks]``: the step's block table."""
    seq_lens: torch.Tensor
    """int32 ``[queries]``: the keys each query attends (itself included)."""
    rows: torch.Tensor
    """int64 ``[queries]``: each query's row."""
    table_rows: torch.Tensor
    """int64 ``[queries]``: each query's request, its row of :attr:`block_table`."""


@dataclass
class LongQuery:
    """One request with a long query (a prefill chunk), attended on its own."""

    query_start: int
    query_end: int
    num_keys: int
    """Keys to attend from the gathered blocks (the request's keys from the first gathered block on)."""
    block_ids: torch.Tensor | None
    """long: blocks to gather; ``None`` when nothing is cached and the new keys are used directly."""
    mask: torch.Tensor | None
    """bool ``[query_len, num_keys]``; ``None`` means causal attention over the new keys, after
    :attr:`context_len` cached keys every query sees."""
    context_len: int = 0
    """Cached keys before the new ones, attended apart from them (on the CPU: see ``_context_split``)."""


class SDPAPlan:
    """How one step's batch is split into SDPA calls (shared by every layer of a KV-cache group).

    The SDPA calls (:attr:`short_batches`, :attr:`long_queries`) are planned on first use: a step whose
    requests the C++ kernel attends whole (every decode step on the CPU) never plans them.
    """

    def __init__(self, metadata: PagedAttentionMetadata, sliding_window: int | None) -> None:
        self.sliding_window = sliding_window
        self.metadata = metadata
        self.max_query_len = max(metadata.query_lens, default=0)
        self.kernel_queries: KernelQueries | None = _kernel_queries(metadata)
        """The same requests' tokens for the C++ kernel where it runs (CPU), up to
        :data:`KERNEL_MAX_QUERY_LEN` tokens per request: with the kernel, short batches and long queries it
        covers are not attended by SDPA."""
        self.kernel_attends_all = self.kernel_queries is not None and self.max_query_len <= KERNEL_MAX_QUERY_LEN
        """Whether the kernel attends every request (every decode step on the CPU): each layer is then one call."""
        self.slots = metadata.slot_mapping.contiguous()
        """The cache slot of each actual token, shared by the layers."""

    @functools.cached_property
    def short_batches(self) -> list[ShortQueryBatch]:
        """Requests of up to :data:`SHORT_QUERY_LEN` new tokens, batched by query length and block count."""
        metadata = self.metadata
        by_query_len: dict[int, list[int]] = {}
        for request, query_len in enumerate(metadata.query_lens):
            if 0 < query_len <= SHORT_QUERY_LEN:
                by_query_len.setdefault(query_len, []).append(request)
        num_blocks = [-(-seq_len // metadata.block_size) for seq_len in metadata.seq_lens]
        return [
            _short_batch(metadata, run, query_len, self.sliding_window)
            for query_len, requests in sorted(by_query_len.items())
            for run in _split_by_padding(requests, num_blocks)
        ]

    @functools.cached_property
    def long_queries(self) -> list[LongQuery]:
        """Requests of more new tokens, one SDPA call each."""
        return [
            _long_query(self.metadata, request, self.sliding_window)
            for request, query_len in enumerate(self.metadata.query_lens)
            if query_len > SHORT_QUERY_LEN
        ]


@dataclass
class SDPAMetadata(PagedAttentionMetadata):
    """:class:`PagedAttentionMetadata` with the step's :class:`SDPAPlan`."""

    plan: SDPAPlan


@dataclass
class EncoderOnlyMetadata(PagedAttentionMetadata):
    """An encoder-only step: :class:`PagedAttentionMetadata` with its requests in runs of similar lengths."""

    runs: list[LengthRun]


def _split_by_padding(requests: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split ``requests`` into runs whose block counts are within 2x of the run's largest.

    Padding every request to the longest in its run then costs at most twice
    the useful work.  Example: block counts ``[20, 3, 18, 2, 9]`` for requests
    0..4 give runs ``[[0, 2], [4], [1, 3]]``.
    """
    ordered = sorted(requests, key=lambda request: -num_blocks[request])
    runs: list[list[int]] = []
    for request in ordered:
        if runs and 2 * num_blocks[request] >= num_blocks[runs[-1][0]]:
            runs[-1].append(request)
        else:
            runs.append([request])
    return runs


def _short_batch(
    metadata: PagedAttentionMetadata, requests: list[int], query_len: int, sliding_window: int | None
) -> ShortQueryBatch:
    block_size = metadata.block_size
    device = metadata.block_table.device
    first_block = min(window_start(metadata.context_lens[r], sliding_window) for r in requests) // block_size
    last_block = max(-(-metadata.seq_lens[r] // block_size) for r in requests)
    request_index = torch.tensor(requests, dtype=torch.long, device=device)
    block_ids = metadata.block_table[request_index, first_block:last_block].long().reshape(-1)
    starts = torch.tensor([metadata.query_starts[r] for r in requests], dtype=torch.long, device=device)
    offsets = torch.arange(query_len, device=device)
    rows = (starts[:, None] + offsets).reshape(-1)
    # Positions of each query ([batch, query_len]) and of each gathered key ([keys]).
    contexts = torch.tensor([metadata.context_lens[r] for r in requests], dtype=torch.long, device=device)
    query_positions = contexts[:, None] + offsets
    key_positions = first_block * block_size + torch.arange((last_block - first_block) * block_size, device=device)
    mask = key_positions <= query_positions[:, :, None]
    if sliding_window is not None:
        mask &= key_positions > query_positions[:, :, None] - sliding_window
    return ShortQueryBatch(query_len, rows, block_ids, last_block - first_block, mask[:, None])


def _kernel_queries(metadata: PagedAttentionMetadata) -> KernelQueries | None:
    """The tokens of the requests the kernel takes (``None`` when there are none, or off the CPU).

    Built from the metadata's lists in Python: a step has at most a few hundred such tokens, and torch's
    ``repeat_interleave`` took 80 us a call on two threads, four calls a step.
    """
    if metadata.block_table.device.type != "cpu":
        return None
    table_rows: list[int] = []
    rows: list[int] = []
    seq_lens: list[int] = []
    for request, (query_len, start, context) in enumerate(
        zip(metadata.query_lens, metadata.query_starts, metadata.context_lens, strict=False)
    ):
        if 0 < query_len <= KERNEL_MAX_QUERY_LEN:  # each token attends its context and the query up to itself
            table_rows.extend([request] * query_len)
            rows.extend(range(start, start + query_len))
            seq_lens.extend(range(context + 1, context + query_len + 1))
    if not rows:
        return None
    return KernelQueries(
        block_table=metadata.block_table.to(torch.int32).contiguous(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        rows=torch.tensor(rows, dtype=torch.long),
        table_rows=torch.tensor(table_rows, dtype=torch.long),
    )


def _long_query(metadata: PagedAttentionMetadata, request: int, sliding_window: int | None) -> LongQuery:
    block_size = metadata.block_size
    device = metadata.block_table.device
    start, end = metadata.query_starts[request], metadata.query_starts[request + 1]
    context_len, seq_len = metadata.context_lens[request], metadata.seq_lens[request]
    if context_len == 0 and sliding_window is None:
        return LongQuery(start, end, seq_len, None, None)
    # Gather from the first block the window reaches (block 0 without a window); nothing when nothing is cached.
    first_block = window_start(context_len, sliding_window) // block_size if context_len else 0
    first_key = first_block * block_size
    block_ids = metadata.block_table[request, first_block : -(-seq_len // block_size)].long() if context_len else None
    if device.type == "cpu" and sliding_window is None:
        return LongQuery(start, end, seq_len, block_ids, None, context_len)
    query_positions = context_len + torch.arange(end - start, device=device)
    key_positions = torch.arange(first_key, seq_len, device=device)
    mask = key_positions <= query_positions[:, None]
    if sliding_window is not None:
        mask &= key_positions > query_positions[:, None] - sliding_window
    return LongQuery(start, end, seq_len - first_key, block_ids, mask)


def _long_compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype a long query is attended in: float32 for bfloat16 on a CPU whose bfloat16 dot products the tuning
    measured slower than float32 FMA (there torch's CPU attention ran bfloat16 1.3-1.5x slower than float32, and the
    widened copies cost little next to it); else the query's own (with AMX, torch's bfloat16 attention ran
    2.4-3.7x faster than float32, at 128 to 1,024 tokens)."""
    if query.dtype == torch.bfloat16 and query.device.type == "cpu" and bfloat16_products_widened():
        return torch.float32
    return query.dtype


def plan_step(metadata: PagedAttentionMetadata, sliding_window: int | None) -> SDPAPlan:
    """Split one step's requests into batched short queries and per-request long queries."""
    return SDPAPlan(metadata, sliding_window)


class TorchSDPAMetadataBuilder(CommonMetadataBuilder):
    """Plans each step's SDPA calls once per KV-cache group: batches of short queries and per-request prefills."""

    contract_version = "1.1"

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata | EncoderOnlyMetadata:
        """Return :class:`SDPAMetadata` for this step (``common`` is not modified); for an encoder-only step, its
        requests in runs of similar lengths (:class:`EncoderOnlyMetadata`)."""
        paged = super().build(common)
        if not common.causal:
            return extend_metadata(
                paged, EncoderOnlyMetadata, runs=plan_runs(paged.query_starts, common.block_table.device)
            )
        return extend_metadata(paged, SDPAMetadata, plan=plan_step(paged, self.sliding_window))


def _kernel_pool() -> tuple[int, int]:
    """Where the kernel runs its tasks: the tiled products' helpers (the pool's entry point, 0: OpenMP), on as
    many threads as the products use."""
    return chunk_runner(), chunk_threads() or torch.get_num_threads()


AMX_PREFILL_HEAD_SIZE = 64
"""The head size the AMX prefill kernel takes (``amx_prefill_attention``)."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Cache dtypes the C++ decode kernel runs on."""


class TorchSDPAOptions(BaseModel):
    """Options of the ``torch_sdpa`` backend."""

    model_config = ConfigDict(extra="forbid")

    decode_kernel: Literal["auto", "paged_cpp", "sdpa"] = "auto"
    """Few-token queries on CPU float32 or bfloat16: ``paged_cpp`` attends straight over the paged cache with
    patchbay's C++ kernel (needs a C++ compiler and ninja); ``sdpa`` gathers the blocks and calls SDPA; ``auto``
    uses the kernel once built, SDPA meanwhile or, logged, for good
    (docs/design/cpu-fast-paths.md#the-decode-attention-kernel)."""
    prefill_kernel: Literal["auto", "sdpa"] = "auto"
    """Prefill chunks of over 256 tokens on a CPU, in bfloat16, head size 64, no sliding window: ``auto`` attends
    them with patchbay's AMX kernel where the CPU has AMX bfloat16 tiles and the C++ kernel is built (it comes with
    ``decode_kernel``'s, so not with ``sdpa`` there), else with SDPA; ``sdpa`` always uses SDPA
    (docs/design/cpu-fast-paths.md#long-prefills-through-amx)."""


class DecodeKernel:
    """The C++ decode kernel as the option chose it (shared by all layers of a backend)."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        self._kernel: Any = None
        self._build: KernelBuild | None = None
        self._resolved = choice == "sdpa"
        self._error: str | None = None
        """Why the explicitly chosen kernel cannot run; raised again on every call, never a fallback to SDPA."""

    def get(self) -> Any:
        """The kernel module, or ``None`` when decodes go through SDPA (for now, or for good).

        With ``paged_cpp`` chosen, a kernel that cannot build raises on this call and every later one (a step
        replayed after the first error must not quietly run on SDPA).
        """
        if self._error is not None:
            raise RuntimeError(self._error)
        if self._resolved:
            return self._kernel
        if self.choice == "paged_cpp":  # asked for explicitly: build it now, or fail saying why
            reason = kernel_unavailable()
            if reason is None:
                try:
                    self._kernel = load_kernel()
                except Exception as exc:
                    reason = f"building it failed: {exc}"
            if reason is not None:
                self._error = f"torch_sdpa: decode_kernel paged_cpp is unavailable: {reason}"
                raise RuntimeError(self._error)
            self._resolved = True
            return self._kernel
        reason = kernel_unavailable()
        if reason is not None:
            self._resolved = True
            logger.warning(
                "torch_sdpa: decodes use SDPA over gathered blocks; the C++ kernel is unavailable: %s", reason
            )
            return None
        if self._build is None:
            self._build = KernelBuild.shared()
        self._kernel = self._build.ready()
        self._resolved = self._kernel is not None or self._build.error is not None
        return self._kernel


class TorchSDPABackend(AttentionBackend):
    """torch scaled_dot_product_attention over gathered paged KV: batched decodes, per-request prefills."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = TorchSDPAOptions
    options: TorchSDPAOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cpu", "cuda", "mps"),
        supports_sliding_window=True,
        supports_encoder_only=True,
        cache_dtypes=("int8",),
        supports_latent_kv=True,
        priority=10,
    )
    metadata_builder: ClassVar[str] = "torch_sdpa"

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.workspace = Workspace()
        self.decode_kernel = DecodeKernel(self.options.decode_kernel)

    def make_impl(self, layer: AttentionLayerSpec) -> TorchSDPAImpl:
        """Create the implementation of one layer (all layers share the gather buffers and the decode kernel)."""
        return TorchSDPAImpl(layer, self.workspace, self.decode_kernel, self.options.prefill_kernel)


class TorchSDPAImpl(AttentionImpl):
    """One layer of :class:`TorchSDPABackend`."""

    def __init__(
        self,
        layer: AttentionLayerSpec,
        workspace: Workspace | None = None,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: Literal["auto", "sdpa"] = "auto",
    ) -> None:
        if layer.logits_soft_cap is not None:
            raise ValueError(f"torch_sdpa cannot soft-cap attention logits (layer {layer.layer_name})")
        self.layer = layer
        self.workspace = workspace if workspace is not None else Workspace()
        self.decode_kernel = decode_kernel if decode_kernel is not None else DecodeKernel("sdpa")
        self.enable_gqa = layer.num_heads != layer.num_kv_heads
        self.amx_prefill = (
            prefill_kernel == "auto" and layer.head_size == AMX_PREFILL_HEAD_SIZE and layer.sliding_window is None
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: SDPAMetadata | PagedAttentionMetadata | CommonAttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys and values, then attend every request as the step's plan says; an encoder-only
        step attends each request whole, both ways, without a cache."""
        paged = metadata if isinstance(metadata, PagedAttentionMetadata) else None
        common = paged.common if paged is not None else metadata
        if isinstance(common, CommonAttentionMetadata) and not common.causal:
            paged = as_paged(metadata)
            # Another builder's metadata: planned here, for this layer.
            runs = (
                metadata.runs
                if isinstance(metadata, EncoderOnlyMetadata)
                else plan_runs(paged.query_starts, query.device)
            )
            return attend_bidirectional(
                query, key, value, runs, paged.num_actual_tokens, self.layer.scale, _long_compute_dtype(query)
            )
        plan = self._plan(metadata)
        if self.layer.value_size is not None:
            return self._forward_latent(query, key, kv_cache, plan, self.layer.value_size)
        if plan.kernel_attends_all:
            output = self._kernel_only(query, key, value, kv_cache, plan)
            if output is not None:
                return output
        metadata = as_paged(metadata)
        kernel = None
        if query.device.type == "cpu" and kv_cache.dtype in (query.dtype, torch.int8) and query.dtype in KERNEL_DTYPES:
            kernel = self.decode_kernel.get()
            query = query.contiguous() if kernel is not None and query.stride(-1) != 1 else query
        slots = plan.slots
        if (
            kernel is not None
            and key.dim() == value.dim() == 3
            and key.dtype == value.dtype == query.dtype
            and key.stride(-1) == value.stride(-1) == 1
            and kv_cache.is_contiguous()
            and slots.dtype in (torch.int32, torch.int64)
            and slots.is_contiguous()
        ):
            key_cache, value_cache = TorchSDPABackend.split_kv_cache(kv_cache)
            # One C++ call per layer: the few torch ops per cache of write_kv cost more than a decode's copy.
            kernel.write_kv(key_cache, value_cache, key, value, slots)
        else:
            key_cache, value_cache = split_and_write_kv(TorchSDPABackend, kv_cache, key, value, slots)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_actual_tokens < output.shape[0]:
            output[metadata.num_actual_tokens :].zero_()
        covered = 0  # requests of up to this many new tokens were attended by the kernel
        if kernel is not None and plan.kernel_queries is not None:
            queries = plan.kernel_queries
            kernel.paged_decode_attention(
                query, key_cache, value_cache, *self._query_arguments(queries), output, *_kernel_pool()
            )
            covered = KERNEL_MAX_QUERY_LEN
        if plan.max_query_len > covered:  # else the kernel attended every request: SDPA has nothing to do
            for batch in plan.short_batches:
                if batch.query_len > covered:
                    self._short(query, key_cache, value_cache, batch, output)
            for long_query in plan.long_queries:
                if long_query.query_end - long_query.query_start > covered:
                    self._long(query, key, value, key_cache, value_cache, long_query, output)
        return output

    def _forward_latent(
        self, query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor, plan: SDPAPlan, size: int
    ) -> torch.Tensor:
        """A latent (MLA) layer: write each token's row, attend the short queries with the C++ kernel over the
        latent cache as keys and values alike (then keep each output's first ``size`` features), the others
        through SDPA over their request's gathered rows."""
        metadata = plan.metadata
        write_latent_rows(kv_cache, key, plan.slots)
        output = torch.zeros(*query.shape[:-1], size, dtype=query.dtype, device=query.device)
        kernel = None
        queries = plan.kernel_queries
        if queries is not None and kv_cache.dtype == query.dtype and query.dtype in KERNEL_DTYPES:
            kernel = self.decode_kernel.get()
        covered = 0
        if kernel is not None and queries is not None:
            query = query.contiguous() if query.stride(-1) != 1 else query
            rows = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            kernel.paged_decode_attention(
                query, kv_cache, kv_cache, *self._query_arguments(queries), rows, *_kernel_pool()
            )
            output[queries.rows] = rows[queries.rows, :, :size]
            covered = KERNEL_MAX_QUERY_LEN
        for request, query_len in enumerate(metadata.query_lens):
            if query_len > covered:
                start = metadata.query_starts[request]
                self._latent_request(query, kv_cache, metadata, request, size, output[start : start + query_len])
        return output

    def _latent_request(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        request: int,
        size: int,
        out: torch.Tensor,
    ) -> None:
        """One request's queries over its gathered latent rows (keys; their first ``size`` features the values)."""
        start, end = metadata.query_starts[request], metadata.query_starts[request + 1]
        context, seq_len = metadata.context_lens[request], metadata.seq_lens[request]
        blocks = metadata.block_table[request, : -(-seq_len // metadata.block_size)].long()
        rows = as_float(gather_blocks(kv_cache, blocks)[:seq_len], query.dtype).transpose(0, 1)  # [1, keys, row]
        compute = _long_compute_dtype(query)
        queries = query[start:end].transpose(0, 1).to(compute)  # [heads, tokens, row]
        positions = context + torch.arange(end - start, device=query.device)
        mask = torch.arange(seq_len, device=query.device) <= positions[:, None]
        attended = F.scaled_dot_product_attention(
            queries,
            rows.to(compute),
            rows[..., :size].to(compute),
            attn_mask=mask,
            scale=self.layer.scale,
            enable_gqa=True,
        )
        out.copy_(attended.transpose(0, 1))

    def _kernel_only(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: SDPAPlan
    ) -> torch.Tensor | None:
        """The layer as one C++ call (write the keys and values, attend every query), where the kernel runs and
        takes these tensors; ``None`` leaves the layer to the general path.  Per layer of a decode step, the
        Python and tensor views around two calls had cost more than the attention itself."""
        kernel = self.decode_kernel.get()
        queries = plan.kernel_queries
        if kernel is None or queries is None:
            return None
        output: torch.Tensor | None = kernel.write_kv_and_attend(
            query, key, value, kv_cache, plan.slots, *self._query_arguments(queries), *_kernel_pool()
        )
        return output

    def _query_arguments(self, queries: KernelQueries) -> tuple[Any, ...]:
        """The kernel's arguments that say what each query attends: the step's block table, lengths and rows,
        then the layer's scale and window (0: none)."""
        return (
            queries.block_table,
            queries.seq_lens,
            queries.rows,
            queries.table_rows,
            self.layer.scale,
            self.layer.sliding_window or 0,
        )

    def _plan(self, metadata: SDPAMetadata | PagedAttentionMetadata | CommonAttentionMetadata) -> SDPAPlan:
        if isinstance(metadata, SDPAMetadata) and metadata.plan.sliding_window == self.layer.sliding_window:
            return metadata.plan
        # Metadata from another builder (or for another window): plan here, once per layer.
        return plan_step(as_paged(metadata), self.layer.sliding_window)

    def _short(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: ShortQueryBatch,
        output: torch.Tensor,
    ) -> None:
        num_reqs = batch.mask.shape[0]
        num_heads, head_size = query.shape[1:]
        queries = query.index_select(0, batch.rows).view(num_reqs, batch.query_len, num_heads, head_size)
        keys, values = (
            as_float(self._gather(name, cache, batch.block_ids), query.dtype)
            .view(num_reqs, -1, cache.shape[-2], head_size)
            .transpose(1, 2)
            for name, cache in (("keys", key_cache), ("values", value_cache))
        )
        attended = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys,
            values,
            attn_mask=batch.mask,
            scale=self.layer.scale,
            enable_gqa=self.enable_gqa,
        )
        output.index_copy_(0, batch.rows, attended.transpose(1, 2).reshape(-1, num_heads, head_size))

    def _long(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        long_query: LongQuery,
        output: torch.Tensor,
    ) -> None:
        start, end = long_query.query_start, long_query.query_end
        if long_query.block_ids is None:
            keys, values = as_cached(key[start:end], key_cache.dtype), as_cached(value[start:end], value_cache.dtype)
        else:
            keys = self._gather("keys", key_cache, long_query.block_ids)[: long_query.num_keys]
            values = self._gather("values", value_cache, long_query.block_ids)[: long_query.num_keys]
        compute = _long_compute_dtype(query)
        kernel = self._amx_prefill_kernel(query, compute, long_query)
        if kernel is not None:
            if long_query.block_ids is not None:
                keys, values = as_float(keys, compute), as_float(values, compute)
            kernel.amx_prefill_attention(
                query[start:end], keys, values, long_query.context_len, self.layer.scale, output[start:end],
                *_kernel_pool(),
            )  # fmt: skip
            return
        queries = query[start:end].transpose(0, 1).to(compute)
        keys, values = (as_float(rows, compute).transpose(0, 1) for rows in (keys, values))
        if long_query.context_len:
            attended = attend_after_context(queries, keys, values, long_query.context_len, self.layer.scale)
        else:
            attended = F.scaled_dot_product_attention(
                queries[None],
                keys[None],
                values[None],
                attn_mask=long_query.mask,
                is_causal=long_query.mask is None,
                scale=self.layer.scale,
                enable_gqa=self.enable_gqa,
            )[0]
        output[start:end] = attended.transpose(0, 1)

    def _amx_prefill_kernel(self, query: torch.Tensor, compute: torch.dtype, long_query: LongQuery) -> Any:
        """The C++ extension, where it attends this long query through AMX tiles (a bfloat16 CPU query attended in
        bfloat16, every key up to its own seen); else ``None``."""
        if not (
            self.amx_prefill
            and query.dtype == compute == torch.bfloat16
            and query.device.type == "cpu"
            and query.stride(-1) == 1
            and long_query.mask is None
        ):
            return None
        kernel = self.decode_kernel.get()
        return kernel if kernel is not None and kernel.amx_prefill_supported() else None

    def _gather(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        numel = block_ids.shape[0] * cache[0].numel()
        return gather_blocks(cache, block_ids, out=self.workspace.buffer(name, numel, cache.dtype, cache.device))
