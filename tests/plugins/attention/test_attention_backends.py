"""The built-in attention backends and metadata builders against the conformance suites."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from patchbay.contract.registry import Registry
from patchbay.interfaces import AttentionConfig, AttentionLayerSpec
from patchbay.plugins.attention.common import CommonMetadataBuilder, as_paged
from patchbay.plugins.attention.reference import ReferenceBackend, ReferenceImpl
from patchbay.plugins.attention.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAImpl,
    TorchSDPAMetadataBuilder,
    plan_step,
)
from patchbay.testing import AttentionBackendSuite, MetadataBuilderSuite
from patchbay.testing.attention import AttentionCase, build_common_metadata, check_attention, make_block_table


class TestReference(AttentionBackendSuite):
    plugin_name = "reference"


class TestTorchSDPA(AttentionBackendSuite):
    plugin_name = "torch_sdpa"


class TestFlex(AttentionBackendSuite):
    plugin_name = "flex"


class TestCommonBuilder(MetadataBuilderSuite):
    plugin_name = "common"


class TestVarlenBuilder(MetadataBuilderSuite):
    plugin_name = "varlen"


class TestTorchSDPABuilder(MetadataBuilderSuite):
    plugin_name = "torch_sdpa"


class TestFlexBuilder(MetadataBuilderSuite):
    plugin_name = "flex"


MIXED = AttentionCase(num_computed=(20, 0, 31, 7, 0), num_new=(1, 12, 1, 9, 1), num_heads=6, num_kv_heads=2)
"""Decodes, a whole prompt and a chunk after cached context, with GQA."""


# -- the CUDA-only backends on a machine without CUDA -------------------------------------------

CUDA_ONLY = ["flash_attn", "xformers"]


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_backends_register_and_explain_why_they_cannot_run(patchbay_registry: Registry, name: str) -> None:
    backend = patchbay_registry.resolve("attention", name)
    assert backend.capabilities.devices == ("cuda",)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; test_attention_cuda.py covers these backends")
    assert backend.unavailable_reason() == "needs CUDA (torch.cuda.is_available() is False)"
    reasons = backend.validate(AttentionConfig(device="cpu", dtype="float32"))
    assert "unavailable: needs CUDA (torch.cuda.is_available() is False)" in reasons
    assert any("device 'cpu' not supported" in reason for reason in reasons)


def test_cuda_backend_modules_import_their_libraries_lazily(patchbay_registry: Registry) -> None:
    import sys

    for name in CUDA_ONLY:
        patchbay_registry.resolve("attention", name)
    assert "flash_attn" not in sys.modules and "xformers" not in sys.modules


def test_flex_compile_is_an_option(patchbay_registry: Registry) -> None:
    backend = patchbay_registry.resolve("attention", "flex")
    assert backend.Options().compile is False
    assert backend().make_impl(MIXED.layer()).compile_kernel is False
    assert backend(backend.Options.model_validate({"compile": True})).options.compile is True


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's compile stack
def test_flex_compiled_matches_the_oracle(patchbay_registry: Registry) -> None:
    backend = patchbay_registry.resolve("attention", "flex")
    builder = patchbay_registry.resolve("attention_metadata_builder", "flex")
    case = dataclasses.replace(MIXED, sliding_window=20)
    check_attention(backend, builder, case, options=backend.Options(compile=True))


# -- the suite is not vacuous: broken backends fail it -------------------------------------------


class _NoCausalMaskImpl(ReferenceImpl):
    """Sees the whole request, future keys included."""

    def _attend(self, query, keys, values, context_len):
        return super()._attend(query, keys, values, context_len + keys.shape[0])


class _KeysIntoValuesImpl(TorchSDPAImpl):
    """Writes the keys into the value cache too."""

    def forward(self, query, key, value, kv_cache, metadata):
        return super().forward(query, key, key, kv_cache, metadata)


class _DefaultScaleImpl(TorchSDPAImpl):
    """Ignores the layer's scale and uses 1/sqrt(head_size)."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        super().__init__(dataclasses.replace(layer, scale=layer.head_size**-0.5))


class _PaddingIntoCacheImpl(TorchSDPAImpl):
    """Also writes the padding rows past num_actual_tokens into the cache (after the real ones)."""

    def forward(self, query, key, value, kv_cache, metadata):
        output = super().forward(query, key, value, kv_cache, metadata)
        padding = key.shape[0] - metadata.num_actual_tokens
        if padding:
            key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
            key_cache[-padding:] = key[metadata.num_actual_tokens :]
        return output


class _IgnoresWindowImpl(TorchSDPAImpl):
    """Attends to the whole context of sliding-window layers."""

    def __init__(self, layer: AttentionLayerSpec) -> None:
        super().__init__(dataclasses.replace(layer, sliding_window=None))


def _backend_with(base, impl_class):
    return type(f"Broken{impl_class.__name__}", (base,), {"make_impl": lambda self, layer: impl_class(layer)})


@pytest.mark.parametrize(
    ("base", "impl_class", "builder", "case", "message"),
    [
        (ReferenceBackend, _NoCausalMaskImpl, CommonMetadataBuilder, MIXED, "output differs"),
        (TorchSDPABackend, _KeysIntoValuesImpl, TorchSDPAMetadataBuilder, MIXED, "new values written wrongly"),
        (TorchSDPABackend, _DefaultScaleImpl, TorchSDPAMetadataBuilder, MIXED, "output differs"),
        (TorchSDPABackend, _PaddingIntoCacheImpl, TorchSDPAMetadataBuilder, MIXED, "outside slot_mapping were changed"),
        (
            TorchSDPABackend,
            _IgnoresWindowImpl,
            TorchSDPAMetadataBuilder,
            AttentionCase(num_computed=(20, 0), num_new=(1, 30), sliding_window=8),
            "output differs",
        ),
    ],
)
def test_the_suite_catches_a_broken_backend(base, impl_class, builder, case, message) -> None:
    with pytest.raises(AssertionError, match=message):
        check_attention(_backend_with(base, impl_class), builder, case)


def test_the_suite_passes_the_unbroken_originals() -> None:
    check_attention(ReferenceBackend, CommonMetadataBuilder, MIXED)
    check_attention(TorchSDPABackend, TorchSDPAMetadataBuilder, MIXED)


# -- torch_sdpa specifics --------------------------------------------------------------------------


def _step(num_computed, num_new, block_size=16, seed=0):
    seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, torch.Generator().manual_seed(seed))
    return build_common_metadata(num_computed, num_new, table, block_size)


def test_sdpa_plan_batches_decodes_and_splits_prefills() -> None:
    # 3 decodes with similar contexts, 2 spec-decode queries of 4, one 30-token prefill.
    common = _step((40, 41, 45, 10, 12, 0), (1, 1, 1, 4, 4, 30))
    plan = TorchSDPAMetadataBuilder(block_size=16).build(common).plan
    assert sorted(batch.query_len for batch in plan.short_batches) == [1, 4]
    decodes = next(batch for batch in plan.short_batches if batch.query_len == 1)
    assert sorted(decodes.rows.tolist()) == [0, 1, 2]
    assert [(q.query_start, q.query_end, q.block_ids) for q in plan.long_queries] == [(11, 41, None)]


def test_sdpa_plan_attends_a_cpu_chunk_after_cached_tokens_without_a_mask() -> None:
    """A mask over thousands of keys sent SDPA down its slow path: the context is attended apart instead."""
    common = _step((0, 100, 100), (30, 30, 30))
    plan = TorchSDPAMetadataBuilder(block_size=16).build(common).plan
    fresh, cached, _ = plan.long_queries
    assert (fresh.mask, fresh.context_len, cached.mask, cached.context_len) == (None, 0, None, 100)
    assert (cached.num_keys, len(cached.block_ids)) == (130, 9)
    windowed = plan_step(as_paged(common), sliding_window=8)
    assert windowed.long_queries[1].mask is not None and windowed.long_queries[1].context_len == 0


def test_sdpa_plan_does_not_pad_short_requests_to_a_long_one() -> None:
    # One decode with a long context must not make the 8 short decodes attend to 40 padded blocks.
    common = _step((640, 3, 5, 7, 9, 11, 13, 15, 17), (1,) * 9)
    plan = TorchSDPAMetadataBuilder(block_size=16).build(common).plan
    assert sorted(batch.num_blocks for batch in plan.short_batches) == [2, 41]


def test_sdpa_rejects_soft_cap() -> None:
    assert TorchSDPABackend.validate(AttentionConfig(logits_soft_cap=30.0))
    with pytest.raises(ValueError, match="soft-cap"):
        TorchSDPABackend().make_impl(AttentionLayerSpec("layer", 4, 4, 64, 0.125, logits_soft_cap=30.0))


def test_sdpa_works_with_the_common_builder() -> None:
    check_attention(TorchSDPABackend, CommonMetadataBuilder, MIXED)
    check_attention(TorchSDPABackend, CommonMetadataBuilder, AttentionCase((20, 0), (1, 30), sliding_window=8))


# -- flash_attn and xformers glue, on CPU, with stand-in kernels ---------------------------------
# The real kernels need CUDA (test_attention_cuda.py runs them on a GPU).  These stand-ins implement the documented
# semantics of the two library calls in plain torch, so that the backends' own arithmetic
# (cu_seqlens, gathered slots, window translation, GQA layout) is checked on every machine.


def _reference_varlen(queries, keys, values, scale, window_left, soft_cap):
    """One sequence, causal from the bottom right, keys within window_left behind (-1: no window)."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries.float(), keys) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    shift = keys.shape[0] - queries.shape[0]
    last_visible = torch.arange(queries.shape[0])[:, None] + shift
    key_index = torch.arange(keys.shape[0])[None, :]
    visible = key_index <= last_visible
    if window_left >= 0:
        visible &= key_index >= last_visible - window_left
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values).to(queries.dtype)


def _fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    softcap,
    block_table,
):
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for request in range(len(starts_q) - 1):
        rows = slice(starts_q[request], starts_q[request + 1])
        num_keys = starts_k[request + 1] - starts_k[request]
        assert num_keys <= max_seqlen_k and rows.stop - rows.start <= max_seqlen_q
        if block_table is None:
            keys, values = k[starts_k[request] : starts_k[request + 1]], v[starts_k[request] : starts_k[request + 1]]
        else:
            blocks = block_table[request, : -(-num_keys // k.shape[1])].long()
            keys, values = k[blocks].flatten(0, 1)[:num_keys], v[blocks].flatten(0, 1)[:num_keys]
        out[rows] = _reference_varlen(q[rows], keys, values, softmax_scale, window_size[0], softcap)
    return out


class _FakeBias:
    def __init__(self, query_lens, key_lens, window=None):
        self.query_lens, self.key_lens, self.window = list(query_lens), list(key_lens), window

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen, *, device=None):
        return cls(q_seqlen, kv_seqlen)

    def make_local_attention_from_bottomright(self, window_size):
        return _FakeBias(self.query_lens, self.key_lens, window_size)


def _fake_memory_efficient_attention(query, key, value, attn_bias, scale):
    assert query.shape[0] == 1 and query.dim() in (4, 5)
    flat = [tensor[0].flatten(1, -2) for tensor in (query, key, value)]  # [tokens, heads, head_size]
    out = torch.empty_like(flat[0])
    query_start = key_start = 0
    for query_len, key_len in zip(attn_bias.query_lens, attn_bias.key_lens, strict=True):
        rows, keys = slice(query_start, query_start + query_len), slice(key_start, key_start + key_len)
        window_left = -1 if attn_bias.window is None else attn_bias.window - 1
        out[rows] = _reference_varlen(flat[0][rows], flat[1][keys], flat[2][keys], scale, window_left, 0.0)
        query_start, key_start = query_start + query_len, key_start + key_len
    return out.view(query.shape)


@pytest.fixture
def fake_gpu_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    flash = types.ModuleType("flash_attn")
    flash.flash_attn_varlen_func = _fake_flash_attn_varlen_func
    xformers, ops, fmha, attn_bias = (
        types.ModuleType(name)
        for name in ("xformers", "xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias")
    )
    ops.memory_efficient_attention = _fake_memory_efficient_attention
    attn_bias.BlockDiagonalCausalFromBottomRightMask = attn_bias.BlockDiagonalMask = _FakeBias
    xformers.ops, ops.fmha, fmha.attn_bias = ops, fmha, attn_bias
    for module in (flash, xformers, ops, fmha, attn_bias):
        monkeypatch.setitem(sys.modules, module.__name__, module)


GLUE_CASES = {
    "mixed": MIXED,
    "chunked": AttentionCase((16, 5, 40), (16, 30, 21), num_heads=6, num_kv_heads=2),
    "window": AttentionCase((20, 0, 31, 40, 3), (1, 30, 1, 21, 4), sliding_window=5, num_heads=6, num_kv_heads=2),
    "paged": AttentionCase((300, 0, 20), (1, 40, 7), block_size=256, sliding_window=20, num_heads=6, num_kv_heads=2),
    "mha": AttentionCase((20, 0), (1, 9)),
}


@pytest.mark.usefixtures("fake_gpu_libraries")
@pytest.mark.parametrize("backend_name", ["flash_attn", "xformers"])
@pytest.mark.parametrize("case_name", list(GLUE_CASES))
def test_cuda_backend_glue_with_stand_in_kernels(
    patchbay_registry: Registry, backend_name: str, case_name: str
) -> None:
    backend = patchbay_registry.resolve("attention", backend_name)
    builder = patchbay_registry.resolve("attention_metadata_builder", backend.metadata_builder)
    check_attention(backend, builder, GLUE_CASES[case_name])


def test_an_explicit_decode_kernel_that_cannot_build_never_falls_back_to_sdpa(tiny_llama, monkeypatch) -> None:
    """Issue 30 finding: ``decode_kernel: paged_cpp`` where the kernel cannot build fell back to SDPA after one
    warning (the kernel marked itself resolved before raising, so the replayed step ran on SDPA)."""
    import patchbay
    from patchbay.plugins.attention import torch_sdpa
    from patchbay.sampling_params import SamplingParams

    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: "no C++ compiler (test)")
    kernel = torch_sdpa.DecodeKernel("paged_cpp")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="paged_cpp is unavailable: no C\\+\\+ compiler"):
            kernel.get()
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        model__dtype="float32",
        attention__name="torch_sdpa",
        attention__options={"decode_kernel": "paged_cpp"},
        runtime__threads=2,
    )
    outputs = llm.generate([[5, 9, 11], [42, 43]], SamplingParams(max_tokens=4, ignore_eos=True))
    for output in outputs:
        assert output.finish_reason == "error"
        assert "decode_kernel paged_cpp is unavailable: no C++ compiler (test)" in output.error
