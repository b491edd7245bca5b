"""The C++ decode kernel on int8 KV caches: attention over the rows as dequantized, and write_kv's quantization."""

from __future__ import annotations


import pytest
import torch

from patchbay.interfaces.int8_kv import SCALE_BYTES
from patchbay.toolkit.int8_kv import dequantize_rows, quantize_rows, row_scales
from patchbay.plugins.attention import _cpu_kernel
from patchbay.toolkit.tiles import load_tile_kernels

from decode_kernels import expected_attention, kernel_variant, needs_kernel

pytestmark = needs_kernel


def int8_cache(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """An int8 cache of random rows whose magnitudes differ (so each row's own scale matters), some rows zero."""
    rows = torch.randn(*shape, generator=generator) * (0.1 + 3 * torch.rand(*shape[:-1], 1, generator=generator))
    rows[0, 0] = 0.0  # scale 0: reads as zeros
    return quantize_rows(rows)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [0, 23])
# 16 and 64: the SIMD path (one or several registers per head); 20: the generic loops (not a register multiple).
@pytest.mark.parametrize("head_size", [16, 64, 20])
@pytest.mark.parametrize("variant", ["native", pytest.param("avx2", marks=pytest.mark.slow)])
# Groups of 3 query heads per KV head, and one of 14 (more than the value pass serves at once).
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (14, 1)])
# OpenMP's threads, or the tiled products' pool with two threads.
@pytest.mark.parametrize("pool_threads", [0, 2])
def test_kernel_on_int8_caches_matches_dense_attention_over_the_dequantized_blocks(
    dtype, tolerance, window, head_size, variant, heads, kv_heads, pool_threads
):
    generator = torch.Generator().manual_seed(1)
    num_reqs, block_size, num_blocks, max_blocks = 5, 6, 96, 12
    runner = load_tile_kernels().chunk_runner() if pool_threads else 0
    key_cache = int8_cache((num_blocks, block_size, kv_heads, head_size), generator)
    value_cache = int8_cache((num_blocks, block_size, kv_heads, head_size), generator)
    assert key_cache.shape[-1] == head_size + SCALE_BYTES
    block_table = torch.randperm(num_blocks, generator=generator)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    block_table = block_table.to(torch.int32)
    # Request 3 runs a 3-token draft: each of its queries attends the keys up to itself (causal).
    seq_lens = torch.tensor([1, 5, 17, 38, 39, 40, 63], dtype=torch.int32)
    table_rows = torch.tensor([0, 1, 2, 3, 3, 3, 4])
    rows = torch.tensor([6, 0, 3, 1, 5, 2, 4])  # queries sit in any row order
    num_queries = len(rows)
    query = torch.randn(heads, num_queries, head_size, generator=generator).to(dtype).transpose(0, 1)
    output = torch.full(query.shape, float("nan"), dtype=dtype)
    scale = head_size**-0.5
    kernel_variant(variant).paged_decode_attention(
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
    keys_by_block, values_by_block = dequantize_rows(key_cache), dequantize_rows(value_cache)
    for i in range(num_queries):
        row = int(rows[i])
        expected = expected_attention(
            query[row], keys_by_block, values_by_block, block_table[table_rows[i]], int(seq_lens[i]), window, scale
        )
        torch.testing.assert_close(output[row].float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "cache_dtype, row_size, match",
    [
        (torch.int8, 16, "int8 cache rows of head_size \\+ 4 bytes .* expected: 20 for head_size 16, got 16"),
        (torch.float32, 20, "cache rows of head_size features expected: 16 for head_size 16, got 20"),
        (torch.bfloat16, 16, "key and value caches both in the query's dtype or both int8 expected"),
    ],
)
def test_caches_whose_rows_do_not_fit_the_query_are_an_error(cache_dtype, row_size, match):
    key_cache = torch.zeros(4, 4, 2, row_size, dtype=cache_dtype)
    query = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match=match):
        _cpu_kernel.load_kernel().paged_decode_attention(
            query,
            key_cache,
            key_cache.clone(),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor([0]),
            0.25,
            0,
            torch.empty_like(query),
            0,
            1,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_quantizes_new_keys_and_values_into_int8_caches(dtype, slot_dtype):
    """On views of a fused product (strided rows) with padding rows past the slots, as the backend passes them."""
    generator = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_size = 6, 4, 3, 40
    shape = (num_blocks, block_size, kv_heads, head_size + SCALE_BYTES)
    caches = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator) for _ in "kv"]
    before = [cache.clone() for cache in caches]
    fused = torch.randn(7, 5 * kv_heads * head_size, generator=generator) * 4  # 5 rows of slots, 2 padding
    fused[1, :head_size] = 0.0  # one all-zero key row: scale 0, levels 0
    fused = fused.to(dtype)
    key = fused[:, : kv_heads * head_size].view(7, kv_heads, head_size)
    value = fused[:, 2 * kv_heads * head_size : 3 * kv_heads * head_size].view(7, kv_heads, head_size)
    assert not key.is_contiguous()
    slots = torch.tensor([5, 0, 23, 9, 10], dtype=slot_dtype)
    _cpu_kernel.load_kernel().write_kv(*caches, key, value, slots)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.long()] = True
    for cache, old, new in zip(caches, before, (key, value), strict=True):
        got = cache.view(-1, kv_heads, head_size + SCALE_BYTES)
        want = quantize_rows(new[: len(slots)])
        torch.testing.assert_close(row_scales(got[slots.long()]), row_scales(want), rtol=1e-6, atol=0)
        levels = got[slots.long(), :, :head_size].int() - want[..., :head_size].int()
        # Fast math may round a tie the other way; anything systematic (truncation, a wrong scale) shows.
        assert levels.abs().max() <= 1 and (levels == 0).float().mean() > 0.99
        assert torch.equal(got[~written], old.view_as(got)[~written])
    zero_row = caches[0].view(-1, kv_heads, head_size + SCALE_BYTES)[0, 0]  # token 1's first head, at slot 0
    assert not zero_row.any()  # levels and scale
    with pytest.raises(RuntimeError, match="slot 24 of token 1 is outside the cache's 24 rows"):
        _cpu_kernel.load_kernel().write_kv(*caches, key, value, torch.tensor([0, 24], dtype=slot_dtype))


@pytest.mark.parametrize(
    "row_size, source_dtype, match",
    [
        # An int8 cache sized as a float one (no room for the scale): its rows hold 36 features, not 40.
        (40, torch.float32, "head_size 36 \\(the int8 caches' rows less their 4-byte scale\\)"),
        (44, torch.float16, "float32 or bfloat16 ones into int8 caches"),
    ],
)
def test_write_kv_refuses_keys_that_do_not_fit_int8_caches(row_size, source_dtype, match):
    caches = [torch.zeros(2, 4, 3, row_size, dtype=torch.int8) for _ in "kv"]
    key = torch.zeros(2, 3, 40, dtype=source_dtype)
    with pytest.raises(RuntimeError, match=match):
        _cpu_kernel.load_kernel().write_kv(*caches, key, key.clone(), torch.tensor([0, 1]))
