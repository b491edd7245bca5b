"""The torch_sdpa backend's C++ decode kernel: against dense attention, in the engine, and when it cannot build."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import pytest
import torch

import patchbay
from patchbay.plugins.attention import _cpu_kernel, torch_sdpa
from patchbay.toolkit import native_build
from patchbay.toolkit.int8_kv import dequantize_rows, quantize_rows
from patchbay.toolkit.tiles import (
    BFLOAT16_KERNELS,
    bfloat16_amx_available,
    load_tile_kernels,
    tiles_unavailable,
    use_bfloat16_amx_from,
    use_bfloat16_kernel,
)
from patchbay.sampling_params import SamplingParams
from patchbay.testing.attention import AttentionCase, check_attention, make_batch
from decode_kernels import expected_attention, kernel_variant, needs_kernel
from tiny_models import transformers_greedy

pytestmark = needs_kernel


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [0, 37])
# 16 and 64: the SIMD path (one or several registers per head); 20: the generic loops (not a register multiple).
@pytest.mark.parametrize("head_size", [16, 64, 20])
@pytest.mark.parametrize("variant", ["native", pytest.param("avx2", marks=pytest.mark.slow)])
# A group of 4 query heads per KV head; one of 14, more than the value pass serves at once.
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (14, 1)])
# OpenMP's threads, or the tiled products' pool (its C entry point) with two and three threads.
@pytest.mark.parametrize("pool_threads", [0, 2, 3])
def test_kernel_matches_dense_attention_over_the_gathered_blocks(
    window, dtype, tolerance, head_size, variant, heads, kv_heads, pool_threads
):
    generator = torch.Generator().manual_seed(0)
    num_reqs, block_size, num_blocks = 7, 4, 128
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=generator).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=generator).to(dtype)
    seq_lens = torch.tensor([1, 3, 4, 5, 17, 40, 63], dtype=torch.int32)
    block_table = torch.randperm(num_blocks, generator=generator)[: num_reqs * 16].view(num_reqs, 16).to(torch.int32)
    rows = torch.tensor([6, 0, 3, 1, 5, 2, 4])  # queries sit in any row order
    # transformers hands queries as [heads, tokens, head_size]; the kernel reads that layout through strides.
    query = torch.randn(heads, num_reqs, head_size, generator=generator).to(dtype).transpose(0, 1)
    attended = _attend(
        kernel_variant(variant), query, key_cache, value_cache, block_table, seq_lens, rows, window, pool_threads
    )
    attended.check(tolerance)


@dataclass
class _Attended:
    """The kernel's output for one query per request, and what the dense oracle compares it with."""

    output: torch.Tensor
    query: torch.Tensor
    keys_by_block: torch.Tensor
    values_by_block: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor
    window: int
    scale: float

    def check(self, tolerance: float) -> None:
        for request in range(len(self.rows)):
            row = int(self.rows[request])
            expected = expected_attention(
                self.query[row],
                self.keys_by_block,
                self.values_by_block,
                self.block_table[request],
                int(self.seq_lens[request]),
                self.window,
                self.scale,
            )
            # The reference computes in float64 from the same (rounded) inputs; bfloat16 output adds one rounding.
            torch.testing.assert_close(self.output[row].float(), expected.float(), rtol=tolerance, atol=tolerance)


def _attend(
    kernel, query, key_cache, value_cache, block_table, seq_lens, rows, window, pool_threads, dequantized=None
) -> _Attended:
    """The kernel on request i's query in row ``rows[i]``, over OpenMP (``pool_threads`` 0) or the tiled
    products' pool; ``dequantized``: the caches as float features, where they are int8 rows."""
    runner = load_tile_kernels().chunk_runner() if pool_threads else 0
    output = torch.full(query.shape, float("nan"), dtype=query.dtype)
    scale = query.shape[-1] ** -0.5
    table_rows = torch.arange(len(rows))
    kernel.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        rows,
        table_rows,
        scale,
        window,
        output,
        runner,
        pool_threads,
    )
    keys, values = dequantized if dequantized is not None else (key_cache, value_cache)
    return _Attended(output, query, keys, values, block_table, seq_lens, rows, window, scale)


def test_the_build_runs_in_the_background_and_the_kernel_is_used_once_ready(monkeypatch):
    release = threading.Event()
    fake_kernel = object()

    def slow_build():
        release.wait(10)
        return fake_kernel

    monkeypatch.setattr(_cpu_kernel, "load_kernel", slow_build)
    build = _cpu_kernel.KernelBuild()
    assert build.ready() is None  # still building: callers go on with SDPA
    release.set()
    assert build.wait(10) is fake_kernel and build.error is None


def test_a_failed_background_build_is_logged_once_and_leaves_sdpa(monkeypatch, caplog):
    def broken_build():
        raise RuntimeError("compiler crashed (test)")

    monkeypatch.setattr(_cpu_kernel, "load_kernel", broken_build)
    with caplog.at_level(logging.WARNING):
        build = _cpu_kernel.KernelBuild()
        assert build.wait(10) is None
    assert "compiler crashed (test)" in build.error and "compiler crashed (test)" in caplog.text


def test_auto_serves_sdpa_until_the_background_build_is_ready(monkeypatch):
    release = threading.Event()
    fake_kernel = object()
    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: None)
    monkeypatch.setattr(_cpu_kernel, "load_kernel", lambda: release.wait(10) and fake_kernel)
    build = _cpu_kernel.KernelBuild()
    monkeypatch.setattr(torch_sdpa.KernelBuild, "shared", classmethod(lambda cls: build))
    kernel = torch_sdpa.DecodeKernel("auto")
    assert kernel.get() is None
    release.set()
    build.wait(10)
    assert kernel.get() is fake_kernel


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native_build.clear_stale_lock(tmp_path)
    assert lock.exists()  # another process may be building right now
    old = time.time() - native_build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    native_build.clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_lock_whose_builder_exited_is_removed_at_once(tmp_path):
    """A process that exits during a background build leaves torch's lock: the next start must not wait out
    STALE_LOCK_SECONDS for it."""
    import socket
    import subprocess

    lock = tmp_path / "lock"
    lock.touch()
    builder = tmp_path / native_build.BUILDER_FILE
    builder.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # alive: it may be building right now
    native_build.clear_stale_lock(tmp_path)
    assert lock.exists()
    builder.write_text(f"another-machine {os.getpid() + 1}\n")  # elsewhere: only the lock's age tells
    native_build.clear_stale_lock(tmp_path)
    assert lock.exists()
    gone = subprocess.Popen(["true"])
    gone.wait()
    builder.write_text(f"{socket.gethostname()} {gone.pid}\n")
    started = time.monotonic()
    native_build.wait_for_other_builds(tmp_path)
    assert time.monotonic() - started < 5
    native_build.clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_the_build_folder_is_keyed_by_source_flags_torch_installation_and_cpu(monkeypatch, tmp_path):
    name = _cpu_kernel.build_name()
    assert _cpu_kernel.build_directory().name == name
    monkeypatch.setattr(_cpu_kernel, "EXTRA_CFLAGS", (*_cpu_kernel.EXTRA_CFLAGS, "-DANOTHER"))
    assert _cpu_kernel.build_name() != name
    monkeypatch.undo()
    other_cpu = tmp_path / "cpuinfo"
    other_cpu.write_text("model name\t: Another CPU\nflags\t\t: fpu sse2 avx2\n")
    from patchbay.worker.cpu.tuning import CpuInfo

    read = CpuInfo.read.__func__
    monkeypatch.setattr(CpuInfo, "read", classmethod(lambda cls: read(cls, other_cpu)))
    assert _cpu_kernel.build_name() != name


def test_an_explicit_kernel_that_cannot_build_is_an_error_naming_why(monkeypatch):
    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: "no C++ compiler (test)")
    with pytest.raises(RuntimeError, match="paged_cpp is unavailable: no C\\+\\+ compiler"):
        torch_sdpa.DecodeKernel("paged_cpp").get()


def test_auto_without_the_kernel_says_so_and_uses_sdpa(monkeypatch, caplog):
    monkeypatch.setattr(torch_sdpa, "kernel_unavailable", lambda: "no C++ compiler (test)")
    with caplog.at_level(logging.WARNING):
        assert torch_sdpa.DecodeKernel("auto").get() is None
    assert "no C++ compiler (test)" in caplog.text


def test_greedy_tokens_are_the_same_with_the_kernel_and_with_sdpa(tiny_llama):
    prompts = [[5, 9, 11, 3, 7], list(range(20, 90)), [42], list(range(300, 333))]
    tokens = {}
    for choice in ("sdpa", "paged_cpp"):
        llm = patchbay.LLM(
            model__path=str(tiny_llama),
            model__dtype="float32",
            attention__name="torch_sdpa",
            attention__options={"decode_kernel": choice},
            cache__block_size=4,
        )
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        tokens[choice] = [o.token_ids for o in outputs]
    assert tokens["paged_cpp"] == tokens["sdpa"] == transformers_greedy(tiny_llama, prompts, 16)


def test_a_built_kernel_loads_past_a_lock_left_after_it_was_built(tmp_path, monkeypatch):
    # A process killed while torch's builder checked an up-to-date build leaves its lock behind; the
    # finished library must load at once, not wait on the lock.
    monkeypatch.setattr(native_build.NativeExtension, "build_directory", lambda self: tmp_path)
    built = tmp_path / f"{_cpu_kernel.build_name()}.so"
    built.write_bytes(b"")
    old = time.time() - 60
    os.utime(built, (old, old))
    (tmp_path / "lock").touch()
    imported = []
    monkeypatch.setattr(native_build, "import_built", lambda path: imported.append(path) or "kernel")
    _cpu_kernel.load_kernel.cache_clear()
    try:
        assert _cpu_kernel.load_kernel() == "kernel" and imported == [built]
        # A lock taken before the library was written is a build in progress: not finished.
        os.utime(tmp_path / "lock", (old - 60, old - 60))
        assert not native_build.finished(built, tmp_path / "lock")
    finally:
        _cpu_kernel.load_kernel.cache_clear()


# Queries with thousands of keys: many passes of the kernel's running softmax (a larger score arriving late
# rescales what came before), and keys split between tasks whose shares are merged (one query alone, or a few).
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")])
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("seq_lens", [[3001], [1, 129, 1500, 2300]], ids=["alone", "few"])
@pytest.mark.parametrize("pool_threads", [0, 2])
def test_long_queries_attend_like_dense_attention(dtype, cache_dtype, window, seq_lens, pool_threads):
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, head_size, block_size = 9, 3, 64, 16
    num_reqs, max_blocks = len(seq_lens), -(-max(seq_lens) // block_size)
    num_blocks = num_reqs * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_size)
    # Scores that grow along the sequence: later passes keep finding a larger one than every pass before.
    drift = torch.linspace(0, 3, num_blocks * block_size).view(num_blocks, block_size, 1, 1)
    keys = torch.randn(*shape, generator=generator) + drift
    values = torch.randn(*shape, generator=generator)
    if cache_dtype == "int8":
        key_cache, value_cache = quantize_rows(keys), quantize_rows(values)
        dequantized = dequantize_rows(key_cache), dequantize_rows(value_cache)
    else:
        key_cache, value_cache, dequantized = keys.to(dtype), values.to(dtype), None
    block_table = torch.randperm(num_blocks, generator=generator)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    block_table = block_table.sort(dim=1).values.to(torch.int32)  # ascending: the drift grows along each query
    query = (torch.randn(num_reqs, heads, head_size, generator=generator) + 1).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    rows = torch.arange(num_reqs).flip(0)
    attended = _attend(
        kernel_variant("native"),
        query,
        key_cache,
        value_cache,
        block_table,
        lens,
        rows,
        window,
        pool_threads,
        dequantized,
    )
    attended.check(1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "case",
    [
        # decodes, a 4-token draft, a prefill chunk after cached tokens, a fresh prefill,
        # one longer than the kernel takes
        AttentionCase(
            num_computed=(40, 7, 0, 20, 0),
            num_new=(1, 4, 33, 17, torch_sdpa.KERNEL_MAX_QUERY_LEN + 5),
            num_heads=8,
            num_kv_heads=2,
        ),
        AttentionCase(num_computed=(30, 0, 12), num_new=(1, 40, 9), sliding_window=16, num_heads=4, num_kv_heads=4),
        AttentionCase(num_computed=(25, 0), num_new=(1, 20), dtype="bfloat16", num_heads=6, num_kv_heads=2),
        # chunks longer than the kernel takes after cached tokens: SDPA's two mask-free calls, merged
        *(
            AttentionCase(
                num_computed=(37, 300),
                num_new=(torch_sdpa.KERNEL_MAX_QUERY_LEN + 9, torch_sdpa.KERNEL_MAX_QUERY_LEN + 40),
                dtype=dtype,
                num_heads=6,
                num_kv_heads=2,
                cache_dtype=cache_dtype,
            )
            for dtype, cache_dtype in (("float32", None), ("bfloat16", None), ("float32", "int8"))
        ),
    ],
    ids=["mixed", "window", "bf16", "long-after-cached", "long-after-cached-bf16", "long-after-cached-int8"],
)
def test_the_kernel_attends_every_token_of_short_queries_like_the_dense_oracle(case):
    # paged_cpp: the kernel takes every request of up to KERNEL_MAX_QUERY_LEN tokens, SDPA the longer ones.
    options = torch_sdpa.TorchSDPABackend.Options(decode_kernel="paged_cpp")
    check_attention(torch_sdpa.TorchSDPABackend, torch_sdpa.TorchSDPAMetadataBuilder, case, options=options)


@pytest.mark.parametrize("kernel", BFLOAT16_KERNELS)
def test_a_long_bfloat16_chunk_after_cached_tokens_attends_like_the_oracle_with_either_tile_kernel(kernel):
    """Where the tuning widens bfloat16 products to float32 (``fma``), long chunks are attended in float32 too."""
    case = AttentionCase(
        num_computed=(300,),
        num_new=(torch_sdpa.KERNEL_MAX_QUERY_LEN + 40,),
        dtype="bfloat16",
        num_heads=6,
        num_kv_heads=2,
    )
    options = torch_sdpa.TorchSDPABackend.Options(decode_kernel="paged_cpp")
    if tiles_unavailable(torch.float32) is not None:
        pytest.skip(f"no tiled products here: {tiles_unavailable(torch.float32)}")
    previous = use_bfloat16_kernel(kernel), use_bfloat16_amx_from(0)
    try:
        widened = torch_sdpa._long_compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
        assert widened == (kernel == "fma")
        check_attention(torch_sdpa.TorchSDPABackend, torch_sdpa.TorchSDPAMetadataBuilder, case, options=options)
        # Where AMX takes many-row bfloat16 products, torch's attention has it too: nothing widens.
        use_bfloat16_amx_from(8)
        amx_widened = torch_sdpa._long_compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
        assert amx_widened == (kernel == "fma" and not bfloat16_amx_available())
    finally:
        use_bfloat16_kernel(previous[0])
        use_bfloat16_amx_from(previous[1])


def test_the_plan_gives_the_kernel_each_token_with_its_own_causal_length():
    case = AttentionCase(num_computed=(5, 0, 3), num_new=(1, 3, torch_sdpa.KERNEL_MAX_QUERY_LEN + 1))
    batch = make_batch(torch_sdpa.TorchSDPABackend, case, "cpu", 0)
    plan = torch_sdpa.TorchSDPAMetadataBuilder(block_size=16).build(batch.common).plan
    queries = plan.kernel_queries
    assert queries.rows.tolist() == [0, 1, 2, 3]  # the long third request is SDPA's
    assert queries.seq_lens.tolist() == [6, 1, 2, 3] and queries.table_rows.tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_the_kernel_writes_new_keys_and_values_where_write_kv_does(dtype, slot_dtype):
    """The C++ write (one call per layer) against the backends' shared torch write, on views of a fused product
    (strided rows) with padding rows past the slots."""
    from patchbay.plugins.attention._paged import write_kv

    generator = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_size = 6, 4, 3, 16
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_size, generator=generator).to(dtype) for _ in "kv"]
    expected = [cache.clone() for cache in caches]
    fused = torch.randn(7, 5 * kv_heads * head_size, generator=generator).to(dtype)  # 5 rows of slots, 2 padding
    key = fused[:, : kv_heads * head_size].view(7, kv_heads, head_size)
    value = fused[:, 2 * kv_heads * head_size : 3 * kv_heads * head_size].view(7, kv_heads, head_size)
    assert not key.is_contiguous()
    slots = torch.tensor([5, 0, 23, 9, 10], dtype=slot_dtype)
    _cpu_kernel.load_kernel().write_kv(*caches, key, value, slots)
    write_kv(*expected, key, value, slots)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot 24 of token 1 is outside the cache's 24 rows"):
        _cpu_kernel.load_kernel().write_kv(*caches, key, value, torch.tensor([0, 24], dtype=slot_dtype))


@pytest.mark.parametrize("dtype, cache_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "int8")])
def test_a_step_the_kernel_attends_whole_is_one_call_per_layer_with_the_two_calls_results(
    dtype, cache_dtype, monkeypatch
):
    """Decodes, a draft and a short prefill, with padding rows: the one call writes the cache and attends exactly
    as write_kv and the kernel do apart; inputs it does not take go to the general path, and it writes nothing."""
    case = AttentionCase(
        num_computed=(40, 7, 0), num_new=(1, 4, 9), num_heads=8, num_kv_heads=2, dtype=dtype, cache_dtype=cache_dtype
    )
    batch = make_batch(torch_sdpa.TorchSDPABackend, case)
    metadata = torch_sdpa.TorchSDPAMetadataBuilder(block_size=case.block_size).build(batch.common)
    assert metadata.plan.kernel_attends_all
    backend = torch_sdpa.TorchSDPABackend(torch_sdpa.TorchSDPABackend.Options(decode_kernel="paged_cpp"))
    impl = backend.make_impl(case.layer(0))
    kernel = _cpu_kernel.load_kernel()
    one_call_cache = batch.kv_cache.clone()
    one_call_outputs = []

    def one_call(*args):
        one_call_outputs.append(type(impl)._kernel_only(impl, *args))
        return one_call_outputs[-1]

    monkeypatch.setattr(impl, "_kernel_only", one_call)
    output = impl.forward(batch.query, batch.key, batch.value, one_call_cache, metadata)
    assert len(one_call_outputs) == 1 and one_call_outputs[0] is output

    two_call_cache = batch.kv_cache.clone()
    key_cache, value_cache = torch_sdpa.TorchSDPABackend.split_kv_cache(two_call_cache)
    kernel.write_kv(key_cache, value_cache, batch.key, batch.value, metadata.plan.slots)
    expected = torch.zeros_like(batch.query)
    queries = metadata.plan.kernel_queries
    kernel.paged_decode_attention(
        batch.query, key_cache, value_cache, queries.block_table, queries.seq_lens, queries.rows,
        queries.table_rows, impl.layer.scale, 0, expected, 0, 1,
    )  # fmt: skip
    assert torch.equal(one_call_cache, two_call_cache) and torch.equal(output, expected)
    assert output[sum(case.num_new) :].count_nonzero() == 0  # padding rows

    strided = torch.cat([batch.query, batch.query], dim=-1)[..., ::2]  # stride 2 along head_size
    untouched = batch.kv_cache.clone()
    assert impl._kernel_only(strided, batch.key, batch.value, untouched, metadata.plan) is None
    assert torch.equal(untouched, batch.kv_cache)
