"""Numeric conformance suites for attention backends and attention-metadata builders.

A backend author's whole test file::

    from patchbay.testing import AttentionBackendSuite

    class TestMyBackend(AttentionBackendSuite):
        plugin_name = "my_backend"
        device = "cuda"          # default "cpu"

Every case builds a batch the way the runner does (per-request cached and
new token counts, a block table of randomly permuted physical blocks, a
cache full of noise except for the requests' cached keys), builds the
metadata with the backend's own registered metadata builder, runs the
backend and checks two things against an oracle written here: the output
equals plain dense causal attention over each request's contiguous keys,
and the cache holds exactly the new keys and values at ``slot_mapping``
with every other slot untouched.  Cases outside the backend's declared
capabilities are skipped with the reasons ``validate`` gives.

:func:`check_attention` runs one :class:`AttentionCase` outside pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import pytest

from patchbay.contract.registry import Registration, Registry
from patchbay.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionConfig,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from patchbay.interfaces.int8_kv import SCALE_BYTES, row_size
from patchbay.testing.kinds import AttentionBackendBaseSuite, MetadataBuilderBaseSuite
from patchbay.testing.suite import skip_not_declared

if TYPE_CHECKING:
    import torch

# torch is imported inside functions: this module is imported whenever pytest loads the patchbay plugin.

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"atol": 1e-4, "rtol": 1e-5},
    "float16": {"atol": 3e-3, "rtol": 3e-3},
    "bfloat16": {"atol": 2e-2, "rtol": 2e-2},
}
"""Output tolerance per dtype, against the float64 oracle run on the same (dtype-rounded) inputs."""

PADDING_SCALE = 100.0
"""Padding rows of query/key/value are this large, so that any leak into real rows shows."""


@dataclass(frozen=True)
class AttentionCase:
    """One step to attend: per-request cached and new token counts, and the layer's shape."""

    num_computed: tuple[int, ...]
    """Tokens of each request already in the cache before the step."""
    num_new: tuple[int, ...]
    """Tokens of each request in the step (1 for a decode)."""
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 4
    head_size: int = 64
    dtype: str = "float32"
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    num_padding: int = 3
    """Rows past ``num_actual_tokens`` in query, key and value (the runner pads batches)."""
    spare_blocks: int = 4
    """Cache blocks no request owns; they must come out untouched."""
    seed: int = 0
    cache_dtype: str | None = None
    """``"int8"``: the cache holds rows of :mod:`patchbay.interfaces.int8_kv`; ``None``: rows in :attr:`dtype`."""

    def config(self, device: str) -> AttentionConfig:
        """The :class:`AttentionConfig` the backend is asked to serve for this case."""
        return AttentionConfig(
            device=device.split(":")[0],
            dtype=self.dtype,
            head_size=self.head_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            cache_dtype=self.cache_dtype,
        )

    def layer(self, index: int = 0) -> AttentionLayerSpec:
        # Not 1/sqrt(head_size): a backend that ignores the given scale must fail.
        return AttentionLayerSpec(
            layer_name=f"layers.{index}.attn",
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=1.3 / math.sqrt(self.head_size),
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )


def make_block_table(
    seq_lens: Sequence[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> torch.Tensor:
    """A block table giving each request distinct, randomly chosen physical blocks out of ``num_blocks``.

    int32 ``[num_reqs, max_blocks + 1]`` (one column wider than needed);
    unused entries are 0, as the runner leaves them.
    """
    import torch

    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    if sum(blocks_needed) > num_blocks:
        raise ValueError(f"{sum(blocks_needed)} blocks needed, only {num_blocks} in the cache")
    physical = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), max(blocks_needed, default=0) + 1, dtype=torch.int32)
    taken = 0
    for request, count in enumerate(blocks_needed):
        table[request, :count] = physical[taken : taken + count]
        taken += count
    return table


def build_common_metadata(
    num_computed: Sequence[int], num_new: Sequence[int], block_table: torch.Tensor, block_size: int, device: str = "cpu"
) -> CommonAttentionMetadata:
    """The :class:`CommonAttentionMetadata` the runner builds for one step, built the way it does (vectorised).

    ``num_computed[i]`` tokens of request ``i`` are cached, ``num_new[i]``
    are scheduled now; ``block_table`` (int32, on the CPU) maps each
    request's logical blocks to physical ones.
    """
    import torch

    computed = torch.tensor(list(num_computed), dtype=torch.int32)
    new = torch.tensor(list(num_new), dtype=torch.int32)
    num_reqs, num_tokens = len(num_new), int(new.sum())
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(new, 0)
    seq_lens = computed + new
    # Request of each token: new = [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2].
    request_of = torch.repeat_interleave(torch.arange(num_reqs), new.long())
    # Position of each token: its offset in the request's new tokens, after the cached ones.
    positions = computed[request_of].long() + torch.arange(num_tokens) - query_start_loc[request_of].long()
    blocks = block_table[request_of, positions // block_size].long()
    slot_mapping = blocks * block_size + positions % block_size
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=computed,
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(num_new, default=0),
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        block_size=block_size,
    )


@dataclass
class AttentionBatch:
    """One layer's inputs for a case, and what the oracle needs to judge the result."""

    common: CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    expected_cache: torch.Tensor
    """The cache as it must be after the step: the input cache with the new keys and values at their slots."""
    keys: list[torch.Tensor]
    """Every request's keys in position order (cached, then new), contiguous: what the oracle attends to."""
    values: list[torch.Tensor]


def make_batch(
    backend_class: type[AttentionBackend], case: AttentionCase, device: str = "cpu", layer: int = 0
) -> AttentionBatch:
    """Random inputs for ``case``: shape and block table depend on the case only, the values also on ``layer``."""
    import torch

    from patchbay.toolkit.int8_kv import dequantize_rows, quantize_rows

    dtype = getattr(torch, case.dtype)
    seq_lens = [computed + new for computed, new in zip(case.num_computed, case.num_new, strict=True)]
    num_blocks = sum(-(-seq_len // case.block_size) for seq_len in seq_lens) + case.spare_blocks
    block_table = make_block_table(seq_lens, case.block_size, num_blocks, torch.Generator().manual_seed(case.seed))
    common = build_common_metadata(case.num_computed, case.num_new, block_table, case.block_size, device)

    generator = torch.Generator().manual_seed(1_000 * case.seed + layer + 1)
    kv_shape = (case.num_kv_heads, case.head_size)
    keys = [torch.randn(seq_len, *kv_shape, generator=generator).to(dtype) for seq_len in seq_lens]
    values = [torch.randn(seq_len, *kv_shape, generator=generator).to(dtype) for seq_len in seq_lens]
    rows = row_size(case.head_size, case.cache_dtype)
    cache_shape = backend_class.kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, rows)
    if case.cache_dtype == "int8":
        kv_cache = torch.empty(cache_shape, dtype=torch.int8)
        for part in backend_class.split_kv_cache(kv_cache):  # noise wherever nothing was written
            part.copy_(quantize_rows(torch.randn(*part.shape[:-1], case.head_size, generator=generator)))
        # Keys and values on the int8 grid: the cache keeps them exactly, so the oracle's inputs are the
        # backend's whether it attends a step's new keys as given or as its cache holds them.
        keys = [dequantize_rows(quantize_rows(rows_of), dtype) for rows_of in keys]
        values = [dequantize_rows(quantize_rows(rows_of), dtype) for rows_of in values]
    else:
        kv_cache = torch.randn(cache_shape, generator=generator).to(dtype)  # noise wherever nothing was written
    expected_cache = kv_cache.clone()
    num_tokens = sum(case.num_new)
    padded = num_tokens + case.num_padding
    query = PADDING_SCALE * torch.randn(padded, case.num_heads, case.head_size, generator=generator)
    key = PADDING_SCALE * torch.randn(padded, *kv_shape, generator=generator)
    value = PADDING_SCALE * torch.randn(padded, *kv_shape, generator=generator)
    query[:num_tokens] = torch.randn(num_tokens, case.num_heads, case.head_size, generator=generator)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    start = 0
    for request, (computed, new) in enumerate(zip(case.num_computed, case.num_new, strict=True)):
        key[start : start + new] = keys[request][computed:]
        value[start : start + new] = values[request][computed:]
        start += new
        positions = torch.arange(computed + new)
        blocks = block_table[request, positions // case.block_size].long()
        offsets = positions % case.block_size
        # The cached part is in both caches; the new part only in the expected one.
        for cache, cached_upto in ((kv_cache, computed), (expected_cache, computed + new)):
            key_cache, value_cache = backend_class.split_kv_cache(cache)
            key_cache[blocks[:cached_upto], offsets[:cached_upto]] = _cache_rows(keys[request][:cached_upto], case)
            value_cache[blocks[:cached_upto], offsets[:cached_upto]] = _cache_rows(values[request][:cached_upto], case)
    return AttentionBatch(
        common, query.to(device), key.to(device), value.to(device), kv_cache.to(device), expected_cache, keys, values
    )


def _cache_rows(rows: torch.Tensor, case: AttentionCase) -> torch.Tensor:
    """Keys or values as the case's cache stores them."""
    from patchbay.toolkit.int8_kv import quantize_rows

    return quantize_rows(rows) if case.cache_dtype == "int8" else rows


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, layer: AttentionLayerSpec
) -> torch.Tensor:
    """The oracle: float64 softmax attention of one request's queries over its contiguous keys.

    ``query`` is ``[new, num_heads, head_size]`` at positions
    ``context_len ..``; ``keys``/``values`` are ``[context_len + new,
    num_kv_heads, head_size]``.  Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.
    """
    import torch

    group = layer.num_heads // layer.num_kv_heads
    kv_head_of = torch.arange(layer.num_heads) // group
    keys, values = keys.double()[:, kv_head_of], values.double()[:, kv_head_of]
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * layer.scale
    if layer.logits_soft_cap is not None:
        scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
    query_positions = context_len + torch.arange(query.shape[0])
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions[None, :] <= query_positions[:, None]
    if layer.sliding_window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - layer.sliding_window
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def snapshot(common: CommonAttentionMetadata) -> dict[str, Any]:
    """A copy of every field of ``common`` (tensors cloned), for :func:`assert_unchanged`."""
    copy: dict[str, Any] = {}
    for field in dataclasses.fields(common):
        value = getattr(common, field.name)
        is_tensor = hasattr(value, "clone")
        copy[field.name] = (value.clone(), value.dtype, value.device, tuple(value.shape)) if is_tensor else value
    return copy


def assert_unchanged(common: CommonAttentionMetadata, before: dict[str, Any], what: str) -> None:
    """Assert every field of ``common`` still equals ``before`` (taken with :func:`snapshot`)."""
    import torch

    for name, old in before.items():
        after = getattr(common, name)
        if isinstance(old, tuple):
            tensor, dtype, device, shape = old
            assert (after.dtype, after.device, tuple(after.shape)) == (dtype, device, shape) and torch.equal(
                after, tensor
            ), f"{what} modified CommonAttentionMetadata.{name}"
        else:
            assert after == old, f"{what} modified CommonAttentionMetadata.{name}: {old!r} -> {after!r}"


def _check_cache(backend_class: type[AttentionBackend], batch: AttentionBatch, case: AttentionCase) -> None:
    import torch

    written = set(batch.common.slot_mapping.tolist())
    after = backend_class.split_kv_cache(batch.kv_cache.cpu())
    expected = backend_class.split_kv_cache(batch.expected_cache)
    for name, got, want in zip(("key", "value"), after, expected, strict=True):
        if torch.equal(got, want):
            continue
        wrong_rows = (got != want).flatten(2).any(-1)
        if case.cache_dtype == "int8":
            wrong_rows &= ~_same_int8_rows(got, want)
        wrong = wrong_rows.flatten().nonzero().flatten().tolist()
        if not wrong:
            continue
        bad_new = [slot for slot in wrong if slot in written]
        touched = [slot for slot in wrong if slot not in written]
        problems = []
        if bad_new:
            problems.append(f"new {name}s written wrongly at slots {bad_new[:10]}")
        if touched:
            problems.append(f"{name} cache slots outside slot_mapping were changed: {touched[:10]}")
        raise AssertionError(f"{'; '.join(problems)} (case {case})")


def _same_int8_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row of two int8 caches: the same row up to the rounding of one feature by one level and of the scale by
    a float32 step (a kernel's fused arithmetic may round a tie or the scale's division otherwise)."""
    import torch

    from patchbay.toolkit.int8_kv import row_scales

    got_scale, want_scale = row_scales(got), row_scales(want)
    same_scale = torch.isclose(got_scale, want_scale, rtol=1e-6, atol=0.0)
    levels = (got[..., :-SCALE_BYTES].int() - want[..., :-SCALE_BYTES].int()).abs().amax(-1)
    return (same_scale & (levels <= 1)).flatten(2).all(-1)


def _check_output(output: torch.Tensor, batch: AttentionBatch, case: AttentionCase, layer: AttentionLayerSpec) -> None:
    import torch

    output = output.cpu()
    query = batch.query.cpu()
    start = 0
    for request, (computed, new) in enumerate(zip(case.num_computed, case.num_new, strict=True)):
        rows = slice(start, start + new)
        start += new
        want = dense_attention(query[rows], batch.keys[request], batch.values[request], computed, layer)
        got = output[rows].double()
        try:
            tolerance = TOLERANCES[case.dtype]
            torch.testing.assert_close(got, want, atol=tolerance["atol"], rtol=tolerance["rtol"])
        except AssertionError:
            error = (got - want).abs().nan_to_num(float("inf"))
            row, head = divmod(int(error.amax(-1).argmax()), case.num_heads)
            raise AssertionError(
                f"output differs from dense causal attention for request {request} ({computed} cached + {new} new "
                f"tokens, rows {rows.start}:{rows.stop}): max abs error {float(error.max()):.3g} at row "
                f"{rows.start + row} head {head}, tolerance {TOLERANCES[case.dtype]} (case {case})"
            ) from None


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the suite's own small tensor work on one thread (a thread pool costs more than it saves here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_attention(
    backend_class: type[AttentionBackend],
    builder_class: type[AttentionMetadataBuilder],
    case: AttentionCase,
    *,
    device: str = "cpu",
    options: Any = None,
    num_layers: int = 1,
    builder: AttentionMetadataBuilder | None = None,
) -> None:
    """Run ``case`` through a backend and raise :class:`AssertionError` on any deviation from the oracle.

    Builds the step's metadata once with ``builder_class`` (default
    options) and runs ``num_layers`` layers on it (each with its own inputs
    and cache, as the runner shares metadata across a KV-cache group),
    checking for each: the output against :func:`dense_attention`, the cache
    against the expected one (new keys and values at ``slot_mapping``,
    nothing else touched), and that neither the inputs nor the common
    metadata were modified.  ``options`` is an instance of the backend's
    ``Options`` (``None``: the defaults).  ``builder`` is an instance to
    reuse (the runner keeps one per KV-cache group for the whole run); by
    default a new one is made for the case.
    """
    with _one_thread():
        batches = [make_batch(backend_class, case, device, layer) for layer in range(num_layers)]
    common = batches[0].common
    if builder is None:
        builder = builder_class(block_size=case.block_size, sliding_window=case.sliding_window, device=device)
    original = snapshot(common)
    metadata = builder.build(common)
    assert_unchanged(common, original, f"{builder_class.__name__}.build")
    backend = backend_class(options)
    for index, batch in enumerate(batches):
        layer = case.layer(index)
        impl = backend.make_impl(layer)
        inputs = [tensor.clone() for tensor in (batch.query, batch.key, batch.value)]
        output = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata)
        for name, before, after in zip(
            ("query", "key", "value"), inputs, (batch.query, batch.key, batch.value), strict=True
        ):
            assert after.equal(before), f"forward modified its {name} input (case {case})"
        assert_unchanged(common, original, f"{backend_class.__name__} forward")
        assert tuple(output.shape) == tuple(batch.query.shape), (
            f"output shape {tuple(output.shape)}, expected the query's {tuple(batch.query.shape)}"
        )
        assert output.dtype == batch.query.dtype, f"output dtype {output.dtype}, expected {batch.query.dtype}"
        assert output.device == batch.query.device, f"output on {output.device}, expected {batch.query.device}"
        with _one_thread():
            _check_cache(backend_class, batch, case)
            _check_output(output, batch, case, layer)


ENCODER_ONLY_LENGTHS = (5, 1, 17, 33, 9)
"""Prompts of the encoder-only case: a single token, under, across and over two 16-token blocks."""


def check_encoder_only(
    backend_class: type[AttentionBackend],
    builder_class: type[AttentionMetadataBuilder],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    lengths: Sequence[int] = ENCODER_ONLY_LENGTHS,
) -> None:
    """An encoder-only step (``causal`` ``False``, an empty ``kv_cache``, padding rows after the prompts) through
    a backend: each query must attend every key of its own prompt, both ways, as the float64 oracle does."""
    import dataclasses

    import torch

    case = AttentionCase(num_computed=(0,) * len(lengths), num_new=tuple(lengths), num_heads=6, num_kv_heads=2)
    layer = case.layer()
    generator = torch.Generator().manual_seed(case.seed)
    num_tokens = sum(lengths)
    torch_dtype = getattr(torch, dtype)
    query, key, value = (
        torch.randn(num_tokens + case.num_padding, heads, case.head_size, generator=generator).to(torch_dtype)
        for heads in (case.num_heads, case.num_kv_heads, case.num_kv_heads)
    )
    for tensor in (query, key, value):
        tensor[num_tokens:] = PADDING_SCALE
    block_table = make_block_table(
        lengths, case.block_size, sum(-(-n // case.block_size) for n in lengths) + 1, generator
    )
    common = dataclasses.replace(
        build_common_metadata(case.num_computed, lengths, block_table, case.block_size, device), causal=False
    )
    metadata = builder_class(block_size=case.block_size, device=device).build(common)
    output = (
        backend_class()
        .make_impl(layer)
        .forward(
            query.to(device),
            key.to(device),
            value.to(device),
            torch.empty(0, dtype=torch_dtype, device=device),
            metadata,
        )
    )
    assert tuple(output.shape) == tuple(query.shape), f"encoder-only output shape {tuple(output.shape)}"
    start = 0
    for index, length in enumerate(lengths):
        rows = slice(start, start + length)
        # Every key visible: the oracle's queries all sit after the whole prompt.
        expected = dense_attention(query[rows], key[rows], value[rows], length, layer)
        got = output[rows].cpu().double()
        tolerance = TOLERANCES[dtype]
        assert torch.allclose(got, expected, rtol=tolerance["rtol"], atol=tolerance["atol"]), (
            f"encoder-only step, {dtype}: prompt {index} ({length} tokens) differs from bidirectional attention "
            f"over its own keys by {float((got - expected).abs().max()):.3g} (a causal mask, or keys of another "
            "prompt or of the padding rows, attended)"
        )
        start += length


def device_unavailable_reason(device: str) -> str | None:
    """Why ``device`` cannot be used on this machine, or ``None``."""
    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        return "needs CUDA (torch.cuda.is_available() is False)"
    if kind == "mps" and not torch.backends.mps.is_available():
        return "needs MPS (torch.backends.mps.is_available() is False)"
    return None


class AttentionBackendSuite(AttentionBackendBaseSuite):
    """The attention-backend conformance suite: registration checks plus numerics against a dense oracle.

    Class attributes choose the matrix; each case the backend's capabilities
    exclude is skipped with the reasons its ``validate`` gives.
    """

    device: ClassVar[str] = "cpu"
    """Device the cases run on (``"cuda"``, ``"cuda:1"``, ...)."""
    block_sizes: ClassVar[tuple[int, ...]] = (16, 32)
    head_sizes: ClassVar[tuple[int, ...]] = (64, 128)
    gqa_ratios: ClassVar[tuple[int, ...]] = (1, 3)
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    sliding_windows: ClassVar[tuple[int, ...]] = (5, 20)
    """Windows smaller than a block and spanning blocks (cases with a window skip unless it is supported)."""
    run_end_to_end: ClassVar[bool] = True
    """Run the engine test (tiny model, a few seconds); ``False`` skips it (and fails it in strict mode)."""

    # -- fixtures ----------------------------------------------------------------------------

    @pytest.fixture
    def backend_class(self, available: type[AttentionBackend]) -> type[AttentionBackend]:
        """The backend class, skipping when it or :attr:`device` cannot run on this machine."""
        reason = device_unavailable_reason(self.device)
        if reason:
            pytest.skip(f"unavailable: {reason}")
        return available

    @pytest.fixture
    def builder_class(
        self, backend_class: type[AttentionBackend], patchbay_registry: Registry
    ) -> type[AttentionMetadataBuilder]:
        """The backend's own metadata builder, resolved by the name it declares."""
        # resolve() checked that the class implements the kind's interface.
        builder = cast(
            "type[AttentionMetadataBuilder]",
            patchbay_registry.resolve("attention_metadata_builder", backend_class.metadata_builder),
        )
        reason = builder.unavailable_reason()
        if reason:
            pytest.fail(
                f"{backend_class.__name__} is available but its metadata builder "
                f"{backend_class.metadata_builder!r} is not: {reason}"
            )
        return builder

    # -- the matrix --------------------------------------------------------------------------

    def base_case(self, capabilities: AttentionCapabilities, **changes: Any) -> AttentionCase:
        """A mixed batch in the backend's preferred shape (float32, head size 64, block size 16 where allowed)."""
        dtype = "float32" if "float32" in capabilities.dtypes else capabilities.dtypes[0]
        head_sizes = capabilities.head_sizes
        head_size = 64 if head_sizes is None or 64 in head_sizes else head_sizes[0]
        if capabilities.block_sizes is not None:
            block_size = 16 if 16 in capabilities.block_sizes else capabilities.block_sizes[0]
        else:
            multiple = capabilities.block_size_multiple
            block_size = 16 if 16 % multiple == 0 else multiple
        # A decode, a whole prompt, a decode at a block boundary, a chunk after cached context, a 1-token prompt.
        case = AttentionCase(
            num_computed=(20, 0, 31, 7, 0),
            num_new=(1, 12, 1, 9, 1),
            dtype=dtype,
            head_size=head_size,
            block_size=block_size,
        )
        return dataclasses.replace(case, **changes)

    def run_case(
        self,
        backend_class: type[AttentionBackend],
        builder_class: type[AttentionMetadataBuilder],
        case: AttentionCase,
        **kwargs: Any,
    ) -> None:
        """Skip ``case`` if the backend rejects it, else check it with :func:`check_attention`."""
        reasons = backend_class.validate(case.config(self.device))
        if reasons:
            skip_not_declared("; ".join(reasons))
        check_attention(backend_class, builder_class, case, device=self.device, **kwargs)

    # -- batch shapes ------------------------------------------------------------------------

    def test_pure_prefill(self, backend_class, builder_class) -> None:
        case = self.base_case(backend_class.capabilities, num_computed=(0, 0, 0), num_new=(5, 17, 33))
        self.run_case(backend_class, builder_class, case)

    def test_pure_decode(self, backend_class, builder_class) -> None:
        # Contexts around block boundaries, and one long one.
        computed = (15, 16, 31, 1, 47, 100)
        case = self.base_case(backend_class.capabilities, num_computed=computed, num_new=(1,) * len(computed))
        self.run_case(backend_class, builder_class, case)

    def test_many_decodes(self, backend_class, builder_class) -> None:
        computed = tuple((37 * request) % 90 + 1 for request in range(64))
        case = self.base_case(
            backend_class.capabilities,
            num_computed=computed,
            num_new=(1,) * len(computed),
            num_heads=6,
            num_kv_heads=2,
            spare_blocks=0,
        )
        self.run_case(backend_class, builder_class, case)

    def test_mixed_batch(self, backend_class, builder_class) -> None:
        self.run_case(backend_class, builder_class, self.base_case(backend_class.capabilities))

    def test_chunked_prefill(self, backend_class, builder_class) -> None:
        # Continuations of prompts whose first chunks are cached: block-aligned and not, short and long.
        case = self.base_case(backend_class.capabilities, num_computed=(16, 5, 40, 64), num_new=(16, 30, 21, 3))
        self.run_case(backend_class, builder_class, case)

    def test_multi_token_queries(self, backend_class, builder_class) -> None:
        # Speculative-decoding verification: a few new tokens per request after long contexts.
        case = self.base_case(backend_class.capabilities, num_computed=(10, 20, 33, 47), num_new=(4, 4, 4, 3))
        self.run_case(backend_class, builder_class, case)

    def test_single_request(self, backend_class, builder_class) -> None:
        case = self.base_case(backend_class.capabilities, num_computed=(0,), num_new=(1,))
        self.run_case(backend_class, builder_class, case)

    def test_without_padding_rows(self, backend_class, builder_class) -> None:
        self.run_case(backend_class, builder_class, self.base_case(backend_class.capabilities, num_padding=0))

    def test_other_block_tables(self, backend_class, builder_class) -> None:
        for seed in (1, 2):
            self.run_case(backend_class, builder_class, self.base_case(backend_class.capabilities, seed=seed))

    def test_metadata_is_shared_by_layers(self, backend_class, builder_class) -> None:
        """One metadata object serves several layers (each with its own cache), as in a KV-cache group."""
        self.run_case(backend_class, builder_class, self.base_case(backend_class.capabilities), num_layers=3)

    # -- layer shapes and variants (parametrized from the class attributes above) -------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        for argument, attribute in (
            ("block_size", "block_sizes"),
            ("head_size", "head_sizes"),
            ("gqa_ratio", "gqa_ratios"),
            ("dtype", "dtypes"),
            ("sliding_window", "sliding_windows"),
        ):
            if argument in metafunc.fixturenames:
                metafunc.parametrize(argument, getattr(metafunc.cls, attribute))

    def test_block_size(self, backend_class, builder_class, block_size: int) -> None:
        case = self.base_case(backend_class.capabilities, block_size=block_size)
        self.run_case(backend_class, builder_class, case)

    def test_gqa(self, backend_class, builder_class, gqa_ratio: int) -> None:
        case = self.base_case(backend_class.capabilities, num_heads=6, num_kv_heads=6 // gqa_ratio)
        self.run_case(backend_class, builder_class, case)

    def test_head_size(self, backend_class, builder_class, head_size: int) -> None:
        self.run_case(backend_class, builder_class, self.base_case(backend_class.capabilities, head_size=head_size))

    def test_dtype(self, backend_class, builder_class, dtype: str) -> None:
        case = self.base_case(backend_class.capabilities, dtype=dtype, num_heads=6, num_kv_heads=2)
        self.run_case(backend_class, builder_class, case)

    def test_sliding_window(self, backend_class, builder_class, sliding_window: int) -> None:
        # Decodes, a prompt longer than the window, and chunks whose window starts inside the cached context.
        case = self.base_case(
            backend_class.capabilities,
            num_computed=(20, 0, 31, 40, 3),
            num_new=(1, 30, 1, 21, 4),
            sliding_window=sliding_window,
            num_heads=6,
            num_kv_heads=2,
        )
        self.run_case(backend_class, builder_class, case)

    def test_encoder_only(self, backend_class, builder_class, dtype: str) -> None:
        """Bidirectional attention over each prompt's own keys, without a KV cache (BERT, XLM-R)."""
        case = self.base_case(backend_class.capabilities, dtype=dtype)
        reasons = backend_class.validate(dataclasses.replace(case.config(self.device), encoder_only=True))
        if reasons:
            skip_not_declared("; ".join(reasons))
        check_encoder_only(backend_class, builder_class, dtype=dtype, device=self.device)

    def test_logits_soft_cap(self, backend_class, builder_class) -> None:
        case = self.base_case(backend_class.capabilities, logits_soft_cap=2.0)
        self.run_case(backend_class, builder_class, case)

    # -- int8 KV cache (cases skip unless the backend lists "int8" in cache_dtypes) -----------

    def test_int8_cache(self, backend_class, builder_class, dtype: str) -> None:
        """Rows of :mod:`patchbay.interfaces.int8_kv`: decodes, a draft, a chunk after cached context, a prompt."""
        case = self.base_case(
            backend_class.capabilities,
            num_computed=(20, 0, 31, 7, 47),
            num_new=(1, 12, 1, 9, 4),
            dtype=dtype,
            num_heads=6,
            num_kv_heads=2,
            cache_dtype="int8",
        )
        self.run_case(backend_class, builder_class, case)

    def test_int8_cache_many_decodes(self, backend_class, builder_class) -> None:
        computed = tuple((37 * request) % 90 + 1 for request in range(48))
        case = self.base_case(
            backend_class.capabilities, num_computed=computed, num_new=(1,) * len(computed), cache_dtype="int8"
        )
        self.run_case(backend_class, builder_class, case)

    def test_int8_cache_sliding_window(self, backend_class, builder_class) -> None:
        case = self.base_case(
            backend_class.capabilities,
            num_computed=(20, 0, 40),
            num_new=(1, 30, 21),
            sliding_window=20,
            cache_dtype="int8",
        )
        self.run_case(backend_class, builder_class, case)

    # -- one builder for a whole run, and the real engine -------------------------------------

    def test_one_builder_serves_changing_batches(self, backend_class, builder_class) -> None:
        """The runner builds every step's metadata with one builder instance: each step must be right, not the first."""
        check_changing_batches(
            backend_class, builder_class, self.base_case(backend_class.capabilities), device=self.device
        )

    def test_engine_run_matches_the_reference_backend(self, backend_class, patchbay_registry: Registry) -> None:
        """In the real engine on a tiny model, over many steps with a changing batch, greedy tokens are the reference's.

        Requests join as others finish (3 at a time), prompts are prefilled in
        32-token chunks, and a small KV cache forces preemptions.
        """
        if not self.run_end_to_end:
            pytest.skip(f"{type(self).__name__}.run_end_to_end is False")
        run_backend_in_engine(self.plugin_name, backend_class, patchbay_registry, self.device)


CHANGING_BATCHES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((0, 0, 0), (5, 17, 33)),  # prefills
    ((5, 17, 33), (1, 1, 1)),  # their first decode
    ((20, 0, 31, 7, 0), (1, 12, 1, 9, 1)),  # requests joined: a mixed batch
    ((16, 5), (16, 30)),  # fewer requests, chunked prefill
    ((100,), (1,)),  # one long decode
)
"""The steps :func:`check_changing_batches` runs one builder instance through (cached, new tokens per request)."""


class KitReferenceReader(AttentionBackend):
    """The kit's own reader of a builder's metadata: dense attention over the fields every backend may read.

    Those are the step's :class:`CommonAttentionMetadata` (the result itself, or its ``.common``) and, when the
    result has them, the per-request ``query_lens``, ``context_lens`` and ``seq_lens`` (lists or tensors), which
    take precedence, as they do for the built-in backends.  A builder an operator pairs with any backend through
    ``attention.metadata_builder`` must be right for this reader.
    """

    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        devices=("cpu", "cuda"), supports_sliding_window=True, supports_logits_soft_cap=True
    )

    def make_impl(self, layer: AttentionLayerSpec) -> KitReferenceReaderImpl:
        return KitReferenceReaderImpl(layer)


def _per_request(metadata: Any, name: str, fallback: list[int]) -> list[int]:
    value = getattr(metadata, name, None)
    if value is None or isinstance(metadata, CommonAttentionMetadata):
        return fallback
    return [int(item) for item in (value.tolist() if hasattr(value, "tolist") else value)][: len(fallback)]


class KitReferenceReaderImpl(AttentionImpl):
    """One layer of :class:`KitReferenceReader`."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        self.layer = layer

    def forward(self, query, key, value, kv_cache, metadata):
        import torch

        common = metadata if isinstance(metadata, CommonAttentionMetadata) else getattr(metadata, "common", None)
        assert isinstance(common, CommonAttentionMetadata), (
            f"the builder's result ({type(metadata).__name__}) is neither a CommonAttentionMetadata nor carries one "
            "as .common: a backend paired with this builder through attention.metadata_builder cannot read it"
        )
        num_tokens = common.num_actual_tokens
        starts = common.query_start_loc_cpu.tolist()
        derived_query = [end - start for start, end in itertools.pairwise(starts)]
        derived_seq = [int(length) for length in common.seq_lens_cpu.tolist()][: len(derived_query)]
        query_lens = _per_request(metadata, "query_lens", derived_query)
        seq_lens = _per_request(metadata, "seq_lens", derived_seq)
        derived_context = [seq - new for seq, new in zip(seq_lens, query_lens, strict=True)]
        context_lens = _per_request(metadata, "context_lens", derived_context)
        key_cache, value_cache = KitReferenceReader.split_kv_cache(kv_cache)
        slots = common.slot_mapping[:num_tokens].long()
        block_size = key_cache.shape[1]
        key_cache.view(-1, *key_cache.shape[2:])[slots] = key[:num_tokens]
        value_cache.view(-1, *value_cache.shape[2:])[slots] = value[:num_tokens]
        output = torch.zeros_like(query)
        for request, (start, new, context) in enumerate(zip(starts[:-1], query_lens, context_lens, strict=True)):
            positions = torch.arange(context + new, device=kv_cache.device)
            blocks = common.block_table[request, positions // block_size].long()
            offsets = positions % block_size
            keys, values = key_cache[blocks, offsets], value_cache[blocks, offsets]
            attended = dense_attention(query[start : start + new], keys, values, context, self.layer)
            output[start : start + new] = attended.to(query.dtype)
        return output


def check_changing_batches(
    backend_class: type[AttentionBackend],
    builder_class: type[AttentionMetadataBuilder],
    base: AttentionCase,
    *,
    device: str = "cpu",
) -> None:
    """Run :data:`CHANGING_BATCHES` through one backend with ONE builder instance, each step against the oracle."""
    builder = builder_class(block_size=base.block_size, sliding_window=base.sliding_window, device=device)
    for step, (num_computed, num_new) in enumerate(CHANGING_BATCHES):
        case = dataclasses.replace(base, num_computed=num_computed, num_new=num_new, seed=step)
        try:
            check_attention(backend_class, builder_class, case, device=device, builder=builder)
        except AssertionError as exc:
            raise AssertionError(
                f"step {step + 1} of a run with one {builder_class.__name__} instance (earlier steps were right): {exc}"
            ) from None
        except Exception as exc:
            raise AssertionError(
                f"step {step + 1} of a run with one {builder_class.__name__} instance raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def run_backend_in_engine(
    name: str | None,
    backend_class: type[AttentionBackend],
    registry: Registry,
    device: str = "cpu",
    *,
    metadata_builder: str | None = None,
) -> None:
    """Greedy tokens of the tiny model with backend ``name`` over a changing batch equal the ``reference`` backend's."""
    from patchbay.testing import end_to_end

    if not name:
        skip_not_declared("the engine selects the backend by its registered name; set plugin_name")
    reasons = backend_class.validate(end_to_end.attention_config(device))
    if reasons:
        skip_not_declared(f"cannot serve the tiny model: {'; '.join(reasons)}")
    reason = end_to_end.unavailable_reason(registry)
    if reason:
        pytest.skip(reason)
    workload = end_to_end.changing_batch_workload()
    expected, _ = end_to_end.run_greedy(registry, workload, {"attention__name": "reference", "runtime__device": device})
    settings = {"attention__name": name, "runtime__device": device, **end_to_end.CHANGING_BATCH_SETTINGS}
    if metadata_builder is not None:
        settings["attention__metadata_builder"] = metadata_builder
    try:
        got, engine = end_to_end.run_greedy(registry, workload, settings)
    except Exception as exc:
        raise AssertionError(
            f"the engine run with attention backend {name!r} (requests joining, finishing and "
            f"preempted; chunked prefill) failed: {type(exc).__name__}: {exc}"
        ) from exc
    end_to_end.assert_same_tokens(expected, got, f"attention backend {name!r} in the engine")
    assert engine.stats.num_preemptions > 0, "the changing-batch run had no preemption (the kit's set-up is wrong)"


def _assert_same(first: Any, second: Any, path: str, depth: int = 0) -> None:
    """Assert two build results are equal, field by field (tensors exactly; callables are not compared)."""
    import torch

    if depth > 6 or callable(first) and not isinstance(first, torch.Tensor):
        return
    assert type(first) is type(second), f"{path}: {type(first).__name__} vs {type(second).__name__}"
    if isinstance(first, torch.Tensor):
        assert first.dtype == second.dtype and first.shape == second.shape and torch.equal(first, second), (
            f"{path} differs between two builds of the same batch"
        )
    elif dataclasses.is_dataclass(first):
        for field in dataclasses.fields(first):
            _assert_same(getattr(first, field.name), getattr(second, field.name), f"{path}.{field.name}", depth + 1)
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), f"{path}: lengths {len(first)} and {len(second)}"
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            _assert_same(a, b, f"{path}[{index}]", depth + 1)
    elif isinstance(first, dict):
        assert first.keys() == second.keys(), f"{path}: keys differ"
        for key in first:
            _assert_same(first[key], second[key], f"{path}[{key!r}]", depth + 1)
    elif isinstance(first, (int, float, str, bool, type(None))):
        assert first == second, f"{path}: {first!r} vs {second!r}"
    elif hasattr(first, "__dict__"):
        _assert_same(vars(first), vars(second), path, depth + 1)


BUILDER_BATCHES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "prefill": ((0, 0, 0), (5, 17, 33)),
    "decode": ((15, 16, 31, 1, 47), (1, 1, 1, 1, 1)),
    "mixed": ((20, 0, 31, 7, 0), (1, 12, 1, 9, 1)),
    "chunked": ((16, 5, 40), (16, 30, 21)),
}
"""Batches the metadata-builder suite builds: (cached tokens, new tokens) per request."""


class MetadataBuilderSuite(MetadataBuilderBaseSuite):
    """The metadata-builder conformance suite: builds real batches and checks what a builder may and must not do."""

    device: ClassVar[str] = "cpu"
    block_size: ClassVar[int] = 16
    sliding_windows: ClassVar[tuple[int | None, ...]] = (None, 20)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "batch_name" in metafunc.fixturenames:
            metafunc.parametrize("batch_name", list(BUILDER_BATCHES))
        if "sliding_window" in metafunc.fixturenames:
            metafunc.parametrize("sliding_window", metafunc.cls.sliding_windows)

    @pytest.fixture
    def builder_class(self, available: type[AttentionMetadataBuilder]) -> type[AttentionMetadataBuilder]:
        """The builder class, skipping when it or :attr:`device` cannot run on this machine."""
        reason = device_unavailable_reason(self.device)
        if reason:
            pytest.skip(f"unavailable: {reason}")
        kind = self.device.split(":")[0]
        if kind not in available.capabilities.devices:
            skip_not_declared(f"device {kind!r} not supported (supports {', '.join(available.capabilities.devices)})")
        return available

    def common(self, batch_name: str, seed: int = 0) -> CommonAttentionMetadata:
        """The common metadata of one of :data:`BUILDER_BATCHES`, with a randomly permuted block table."""
        import torch

        num_computed, num_new = BUILDER_BATCHES[batch_name]
        seq_lens = [computed + new for computed, new in zip(num_computed, num_new, strict=True)]
        num_blocks = sum(-(-seq_len // self.block_size) for seq_len in seq_lens) + 4
        table = make_block_table(seq_lens, self.block_size, num_blocks, torch.Generator().manual_seed(seed))
        return build_common_metadata(num_computed, num_new, table, self.block_size, self.device)

    def make_builder(
        self, builder_class: type[AttentionMetadataBuilder], sliding_window: int | None = None
    ) -> AttentionMetadataBuilder:
        return builder_class(block_size=self.block_size, sliding_window=sliding_window, device=self.device)

    def test_runner_metadata_matches_the_batch(self, builder_class, batch_name: str) -> None:
        """The suite's own stand-in for the runner builds consistent metadata (so the other tests mean something)."""
        import torch

        common = self.common(batch_name)
        num_computed, num_new = BUILDER_BATCHES[batch_name]
        assert common.query_start_loc.dtype == common.seq_lens.dtype == common.block_table.dtype == torch.int32
        assert common.slot_mapping.dtype == torch.int64
        assert common.query_start_loc_cpu.tolist() == [0, *itertools.accumulate(num_new)]
        assert common.seq_lens_cpu.tolist() == [c + n for c, n in zip(num_computed, num_new, strict=True)]
        assert common.num_computed_tokens_cpu.tolist() == list(num_computed)
        assert tuple(common.slot_mapping.shape) == (common.num_actual_tokens,) == (sum(num_new),)
        row = 0
        for request, (computed, new) in enumerate(zip(num_computed, num_new, strict=True)):
            for position in range(computed, computed + new):
                block = int(common.block_table[request, position // self.block_size])
                assert int(common.slot_mapping[row]) == block * self.block_size + position % self.block_size
                row += 1

    def test_build_does_not_modify_its_input(self, builder_class, batch_name: str, sliding_window) -> None:
        common = self.common(batch_name)
        original = snapshot(common)
        self.make_builder(builder_class, sliding_window).build(common)
        assert_unchanged(common, original, f"{builder_class.__name__}.build")

    def test_build_is_deterministic(self, builder_class, batch_name: str, sliding_window) -> None:
        builder = self.make_builder(builder_class, sliding_window)
        first = builder.build(self.common(batch_name))
        second = self.make_builder(builder_class, sliding_window).build(self.common(batch_name))
        _assert_same(first, second, "metadata")

    def test_built_metadata_agrees_with_the_batch(self, builder_class, batch_name: str) -> None:
        """Whatever the result exposes of the batch (the common metadata, per-request lengths) must match it."""
        common = self.common(batch_name)
        built = self.make_builder(builder_class).build(common)
        assert built is not None, "build returned None"
        carried = built if isinstance(built, CommonAttentionMetadata) else getattr(built, "common", None)
        if isinstance(carried, CommonAttentionMetadata):
            _assert_same(carried, common, "metadata.common")
        num_computed, num_new = BUILDER_BATCHES[batch_name]
        expected = {
            "query_lens": list(num_new),
            "context_lens": list(num_computed),
            "seq_lens": [c + n for c, n in zip(num_computed, num_new, strict=True)],
            "num_reqs": len(num_new),
            "num_actual_tokens": sum(num_new),
        }
        for name, want in expected.items():
            got = getattr(built, name, None)
            if got is None or isinstance(built, CommonAttentionMetadata):
                continue
            got = got.tolist() if hasattr(got, "tolist") else got
            assert got == want, f"metadata.{name} is {got}, the batch has {want}"

    def test_one_instance_builds_each_batch_afresh(self, builder_class, sliding_window) -> None:
        """One instance serves a whole run: each batch it builds equals what a new instance builds for that batch."""
        builder = self.make_builder(builder_class, sliding_window)
        for step, batch_name in enumerate([*BUILDER_BATCHES, *reversed(BUILDER_BATCHES)]):
            got = builder.build(self.common(batch_name, seed=step))
            fresh = self.make_builder(builder_class, sliding_window).build(self.common(batch_name, seed=step))
            try:
                _assert_same(got, fresh, "metadata")
            except AssertionError as exc:
                raise AssertionError(
                    f"build #{step + 1} ({batch_name}) of one instance differs from a new instance's "
                    f"build of the same batch: {exc}"
                ) from None

    def test_the_kits_reference_reader_attends_correctly(self, builder_class) -> None:
        """The fields every backend may read (see :class:`KitReferenceReader`), through dense attention over
        changing batches: what a backend an operator pairs with this builder relies on."""
        base = AttentionBackendSuite().base_case(KitReferenceReader.capabilities)
        try:
            check_changing_batches(KitReferenceReader, builder_class, base, device=self.device)
        except AssertionError as exc:
            raise AssertionError(f"the kit's reference reader, over this builder's metadata: {exc}") from None

    def test_backends_reading_it_attend_correctly(
        self, builder_class, patchbay_registry: Registry, registration: Registration
    ) -> None:
        """Every field its own backends read, custom ones included, through their output over changing batches.

        Only backends of the builder's own distribution count: a backend of another package that reads this
        builder is checked by that backend's suite, so a builder's result never depends on what else is installed.
        """
        readers = [
            reader
            for reader in patchbay_registry.registrations("attention")
            if _declared_builder(reader) == self.plugin_name
            and reader.origin.distribution == registration.origin.distribution
        ]
        if not readers:
            skip_not_declared(
                f"no attention backend of {registration.origin.distribution} names {self.plugin_name!r} as its "
                "metadata_builder; the kit's reference reader checks the fields every backend may read"
            )
        unavailable = []
        for reader in readers:
            backend_class = cast("type[AttentionBackend]", reader.resolve())  # resolve() checked the kind
            if backend_class.unavailable_reason():
                unavailable.append(f"{reader.reference}: {backend_class.unavailable_reason()}")
                continue
            base = AttentionBackendSuite().base_case(backend_class.capabilities)
            try:
                check_changing_batches(backend_class, builder_class, base, device=self.device)
            except AssertionError as exc:
                raise AssertionError(f"{reader.reference}, which reads this builder's metadata: {exc}") from None
        if len(unavailable) == len(readers):
            # The builder runs here; the backends that read its own fields do not (the kit's reference reader
            # checked the fields every backend may read).  Where they run, this check runs them.
            skip_not_declared(f"every backend reading this builder is unavailable here ({'; '.join(unavailable)})")

    def test_reorder_batch_is_a_permutation_or_none(self, builder_class) -> None:
        num_scheduled = [1, 12, 1, 9, 1]
        order = self.make_builder(builder_class).reorder_batch(num_scheduled)
        if order is not None:
            assert sorted(order) == list(range(len(num_scheduled))), f"reorder_batch returned {order}"


def _declared_builder(registration: Any) -> str | None:
    try:
        return registration.resolve().metadata_builder
    except Exception:  # a backend that does not import is reported by its own checks
        return None
