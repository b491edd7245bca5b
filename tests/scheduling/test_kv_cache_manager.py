"""The paged KV cache: block pool, prefix caching, sliding windows, sizing, block hashes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.block_pool import BlockPool
from patchbay.scheduling.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.request import Request, hash_block_tokens

BLOCK_SIZE = 4


def full_group(block_size: int = BLOCK_SIZE) -> KVCacheGroup:
    return KVCacheGroup(KVCacheSpec(block_size=block_size, num_kv_heads=1, head_size=8), ["layers.0"])


def sliding_group(window: int, block_size: int = BLOCK_SIZE) -> KVCacheGroup:
    return KVCacheGroup(
        KVCacheSpec(block_size=block_size, num_kv_heads=1, head_size=8, sliding_window=window), ["layers.1"]
    )


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, tokens, SamplingParams(**params), block_size=BLOCK_SIZE)


def prefill(manager: KVCacheManager, request: Request) -> tuple[list[int], ...]:
    """Schedule the whole prompt in one step, as the scheduler would, and mark it computed."""
    computed, num_computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_computed, computed, num_computed) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def decode(manager: KVCacheManager, request: Request, token: int) -> tuple[list[int], ...] | None:
    """``token`` was sampled; the next step computes it."""
    request.append_output_token_ids(token)
    new_blocks = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    return new_blocks


def pool_state(manager: KVCacheManager) -> list:
    return [
        (pool.free_queue.block_ids(), [b.ref_cnt for b in pool.blocks], dict(pool.cached_blocks))
        for pool in manager.pools
    ]


# -- allocation, reference counts, free list ---------------------------------


def test_allocate_grows_block_table_and_free_returns_blocks():
    manager = KVCacheManager([full_group()], num_blocks=10)
    request = make_request("a", list(range(10)))

    assert manager.allocate_slots(request, 10) == ([1, 2, 3],)  # 10 tokens in blocks of 4
    assert [manager.pools[0].blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert manager.num_free_blocks == 6
    request.num_computed_tokens = 10
    request.append_output_token_ids(10)

    assert manager.allocate_slots(request, 1) == ([],)  # token 11 fits block 3
    request.num_computed_tokens = 11
    request.append_output_token_ids(11)
    assert manager.allocate_slots(request, 1) == ([],)  # token 12 fills block 3
    request.num_computed_tokens = 12
    request.append_output_token_ids(12)
    assert manager.allocate_slots(request, 1) == ([4],)  # token 13 opens block 4
    assert manager.get_block_ids("a") == ([1, 2, 3, 4],)

    manager.free(request)
    assert manager.num_free_blocks == 9
    assert manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.pools[0].blocks)
    assert manager.get_block_ids("a") == ([],)


def test_null_block_is_never_handed_out():
    manager = KVCacheManager([full_group()], num_blocks=5)
    request = make_request("a", list(range(16)))
    assert manager.allocate_slots(request, 16) == ([1, 2, 3, 4],)
    assert manager.usage == 1.0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager([full_group()], num_blocks=4)
    first = make_request("a", list(range(8)))
    prefill(manager, first)
    before = pool_state(manager)

    second = make_request("b", list(range(100, 112)))  # needs 3 blocks, 1 free
    assert manager.allocate_slots(second, 12) is None
    assert pool_state(manager) == before
    assert manager.get_block_ids("b") == ([],)


def test_lookahead_tokens_reserve_blocks():
    manager = KVCacheManager([full_group()], num_blocks=10)
    request = make_request("a", list(range(4)))
    assert manager.allocate_slots(request, 4, num_lookahead_tokens=3) == ([1, 2],)


def test_rejects_non_positive_token_count_and_mismatched_block_size():
    manager = KVCacheManager([full_group()], num_blocks=10)
    with pytest.raises(ValueError, match="num_new_tokens must be positive"):
        manager.allocate_slots(make_request("a", [1, 2]), 0)
    other = Request("b", [1, 2, 3], SamplingParams(), block_size=8)
    with pytest.raises(ValueError, match="blocks of 8 tokens but the KV cache uses blocks of 4"):
        manager.get_computed_blocks(other)
    with pytest.raises(ValueError, match="one block size"):
        KVCacheManager([full_group(4), full_group(8)], num_blocks=10)


# -- prefix caching -----------------------------------------------------------


def test_common_prefix_shares_physical_blocks():
    manager = KVCacheManager([full_group()], num_blocks=20)
    shared = list(range(8))  # two full blocks
    first = make_request("a", shared + [50, 51])
    second = make_request("b", shared + [60, 61, 62])
    first_ids = prefill(manager, first)[0]

    computed, num_computed = manager.get_computed_blocks(second)
    assert computed == (first_ids[:2],) and num_computed == 8
    second_ids = prefill(manager, second)[0]
    assert second_ids[:2] == first_ids[:2]
    assert second_ids[2] not in first_ids
    pool = manager.pools[0]
    assert [pool.blocks[i].ref_cnt for i in first_ids[:2]] == [2, 2]

    manager.free(first)
    assert [pool.blocks[i].ref_cnt for i in first_ids[:2]] == [1, 1]
    assert not set(first_ids[:2]) & set(pool.free_queue.block_ids())
    manager.free(second)
    assert manager.num_free_blocks == 19
    assert manager.prefix_cache_queries == 10 + 11
    assert manager.prefix_cache_hits == 8


def test_get_computed_blocks_has_no_side_effects_and_never_returns_the_whole_prompt():
    manager = KVCacheManager([full_group()], num_blocks=10)
    prompt = list(range(8))  # exactly two blocks
    first = make_request("a", prompt)
    prefill(manager, first)
    manager.free(first)
    before = pool_state(manager)

    again = make_request("b", prompt)
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 4  # token 8 must be recomputed for its logits, so block 2 is not a hit
    assert len(computed[0]) == 1
    assert pool_state(manager) == before
    assert manager.get_computed_blocks(again) == (computed, num_computed)  # asking twice is harmless
    assert manager.prefix_cache_queries == 8  # lookups alone are not counted


def test_freed_blocks_are_evicted_in_lru_order_tail_first():
    manager = KVCacheManager([full_group()], num_blocks=7)
    first = make_request("a", list(range(8)))
    second = make_request("b", list(range(100, 108)))
    assert prefill(manager, first) == ([1, 2],)
    assert prefill(manager, second) == ([3, 4],)
    pool = manager.pools[0]

    manager.free(first)
    manager.free(second)
    # Never-used blocks first, then each request's tail block before its prefix block.
    assert pool.free_queue.block_ids() == [5, 6, 2, 1, 4, 3]

    third = make_request("c", list(range(200, 212)))
    assert prefill(manager, third) == ([5, 6, 2],)
    assert pool.get_cached_block(first.block_hashes[1]) is None  # evicted with block 2
    assert pool.get_cached_block(first.block_hashes[0]) is pool.blocks[1]
    assert pool.blocks[2].block_hash == third.block_hashes[2]  # reused and re-registered


def test_freed_cached_block_is_revived_by_a_prefix_hit():
    manager = KVCacheManager([full_group()], num_blocks=10)
    prompt = list(range(9))
    first = make_request("a", prompt)
    first_ids = prefill(manager, first)[0]
    manager.free(first)
    pool = manager.pools[0]
    assert manager.num_free_blocks == 9

    second = make_request("b", prompt)
    second_ids = prefill(manager, second)[0]
    assert second_ids[:2] == first_ids[:2]
    assert [pool.blocks[i].ref_cnt for i in second_ids] == [1, 1, 1]
    assert not set(second_ids) & set(pool.free_queue.block_ids())
    assert manager.num_free_blocks == 6


def test_blocks_filled_by_decoding_are_cached():
    manager = KVCacheManager([full_group()], num_blocks=20)
    first = make_request("a", [1, 2, 3])
    prefill(manager, first)
    for token in (4, 5, 6, 7):
        decode(manager, first, token)
    # Tokens 1..7 computed: block 0 full and cached, block 1 not yet.
    assert first.num_computed_tokens == 7

    follower = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    computed, num_computed = manager.get_computed_blocks(follower)
    assert num_computed == 4
    decode(manager, first, 8)  # block 1 becomes full and cached
    assert manager.get_computed_blocks(follower)[1] == 8


def test_only_blocks_of_known_tokens_are_cached_when_drafts_are_scheduled():
    manager = KVCacheManager([full_group()], num_blocks=20)
    request = make_request("a", list(range(7)))
    request.num_computed_tokens = 0
    manager.allocate_slots(request, 7 + 3)  # 3 draft tokens reach into block 2
    assert len(manager.pools[0].cached_blocks) == 1  # block 1 holds drafts: no hash for it yet


def test_a_prefill_chunk_caches_only_the_blocks_it_completes():
    manager = KVCacheManager([full_group()], num_blocks=20)
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 6)  # positions 0..5: block 0 complete, block 1 half done
    assert len(manager.pools[0].cached_blocks) == 1
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 6)
    assert len(manager.pools[0].cached_blocks) == 3


def test_prompt_logprobs_requests_never_hit():
    manager = KVCacheManager([full_group()], num_blocks=20)
    prefill(manager, make_request("a", list(range(12))))
    wants_logprobs = make_request("b", list(range(12)), prompt_logprobs=1)
    assert manager.get_computed_blocks(wants_logprobs) == (([],), 0)


def test_prefix_caching_off_shares_nothing():
    manager = KVCacheManager([full_group()], num_blocks=20, enable_prefix_caching=False)
    prefill(manager, make_request("a", list(range(12))))
    assert manager.get_computed_blocks(make_request("b", list(range(12)))) == (([],), 0)
    assert not manager.pools[0].cached_blocks


def test_reset_prefix_cache_forgets_hashes_but_keeps_blocks():
    manager = KVCacheManager([full_group()], num_blocks=20)
    running = make_request("a", list(range(12)))
    ids = prefill(manager, running)
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", list(range(12)))) == (([],), 0)
    assert manager.get_block_ids("a") == ids
    manager.free(running)
    assert manager.num_free_blocks == 19


def test_multiple_groups_hit_only_where_all_groups_hit():
    manager = KVCacheManager([full_group(), full_group()], num_blocks=20)
    first = make_request("a", list(range(12)))
    prefill(manager, first)
    manager.free(first)
    manager.pools[1].get_new_blocks(19)  # evicts every cached block of group 1, block 3 (the second block) among them
    computed, num_computed = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert computed == ([], []) and num_computed == 0


# -- sliding window ------------------------------------------------------------


def test_sliding_window_releases_blocks_outside_the_window():
    manager = KVCacheManager([full_group(), sliding_group(window=8)], num_blocks=30)
    request = make_request("a", list(range(6)))
    prefill(manager, request)
    for token in range(100, 114):
        decode(manager, request, token)
    assert request.num_computed_tokens == 20

    decode(manager, request, 114)  # allocating for position 20, which sees positions 12..20
    full_ids, window_ids = manager.get_block_ids("a")
    assert 0 not in full_ids
    assert window_ids[:3] == [0, 0, 0]  # blocks 0..2 hold positions 0..11, all out of the window
    assert 0 not in window_ids[3:]
    assert manager.pools[1].num_free_blocks == 29 - (len(window_ids) - 3)
    assert manager.pools[0].num_free_blocks == 29 - len(full_ids)

    manager.free(request)
    assert manager.pools[1].num_free_blocks == 29
    assert all(block.ref_cnt == 0 for block in manager.pools[1].blocks)


def test_sliding_window_prefix_hit_needs_only_the_blocks_in_the_window():
    manager = KVCacheManager([full_group(), sliding_group(window=8)], num_blocks=30)
    prompt = list(range(24))
    first = make_request("a", prompt)
    full_ids, window_ids = prefill(manager, first)
    manager.free(first)
    window_pool = manager.pools[1]

    # Evict the window group's first block: a hit of 24 tokens only needs positions 16..23 (blocks 4, 5).
    evicted = window_pool.blocks[window_ids[0]]
    del window_pool.cached_blocks[evicted.block_hash]
    evicted.block_hash = None

    second = make_request("b", prompt + [99])
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 24
    assert computed == (full_ids, [0, 0, 0, 0] + window_ids[4:])
    assert manager.allocate_slots(second, 1, computed, num_computed) is not None
    assert manager.get_block_ids("b")[1][:4] == [0, 0, 0, 0]
    assert window_pool.null_block.ref_cnt == 0

    # Without block 5 a 24-token hit is invalid; 20 tokens are (position 20 sees 12..20: blocks 3, 4).
    manager.free(second)
    missing = window_pool.blocks[window_ids[5]]
    del window_pool.cached_blocks[missing.block_hash]
    missing.block_hash = None
    computed, num_computed = manager.get_computed_blocks(make_request("c", prompt + [99]))
    assert num_computed == 20
    assert computed[1] == [0, 0, 0] + window_ids[3:5]


def test_max_blocks_per_request_counts_only_the_window_for_sliding_groups():
    full_only = KVCacheManager([full_group()], num_blocks=10)
    assert full_only.max_blocks_per_request(max_model_len=100, max_tokens_per_step=16) == 25
    window_only = KVCacheManager([sliding_group(window=8)], num_blocks=10)
    # cdiv(8 + 16, 4) + 1: window behind the step's first token plus the step's tokens.
    assert window_only.max_blocks_per_request(max_model_len=100, max_tokens_per_step=16) == 7


# -- sizing --------------------------------------------------------------------


def test_num_blocks_for_memory_counts_every_layer_of_every_group():
    spec = KVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    assert spec.page_size_bytes == 8192
    window = KVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=128)
    groups = [KVCacheGroup(spec, ["l0", "l2"]), KVCacheGroup(window, ["l1"])]
    assert num_blocks_for_memory(groups, 1 << 20) == (1 << 20) // (3 * 8192)
    with pytest.raises(ValueError, match="no layers"):
        num_blocks_for_memory([KVCacheGroup(spec)], 1 << 20)


# -- block hashes ------------------------------------------------------------


def test_block_hashes_are_chained_sha256_of_full_blocks():
    request = make_request("a", list(range(10)))
    assert len(request.block_hashes) == 2
    first = hashlib.sha256(np.arange(4, dtype="<i8").tobytes()).digest()
    assert request.block_hashes[0] == first
    assert request.block_hashes[1] == hashlib.sha256(first + np.arange(4, 8, dtype="<i8").tobytes()).digest()


def test_block_hashes_grow_with_output_tokens_like_a_fresh_request():
    request = make_request("a", list(range(6)))
    request.append_output_token_ids([6, 7])
    request.append_output_token_ids(8)
    assert request.block_hashes == make_request("b", list(range(9))).block_hashes


def test_cache_salt_separates_otherwise_equal_requests():
    plain = make_request("a", list(range(8)))
    salted = Request("b", list(range(8)), SamplingParams(), block_size=BLOCK_SIZE, cache_salt="model-x")
    assert salted.block_hashes[0] == hash_block_tokens(None, range(4), b"model-x")
    assert salted.block_hashes[0] != plain.block_hashes[0]
    assert salted.block_hashes[1] != plain.block_hashes[1]  # the chain carries the salt


def test_decodes_that_fit_their_blocks_take_none_and_still_cache_the_block_they_fill():
    """The decode fast path (issue 55) does what the general path did: no block until the table is full, and a
    block registered in the prefix cache on the step its last token is computed."""
    manager = KVCacheManager([full_group()], num_blocks=10)
    request = make_request("a", [1, 2, 3, 4, 5])  # a full block and one token
    assert prefill(manager, request) == ([1, 2],)
    before = pool_state(manager)
    assert decode(manager, request, 6) == ([],)  # token 6 of 8 in block 2: nothing to take
    assert decode(manager, request, 7) == ([],)
    assert pool_state(manager)[0][:2] == before[0][:2]  # free list and reference counts unchanged
    assert decode(manager, request, 8) == ([],)  # the step that computes token 8 fills block 2 ...
    other = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.get_computed_blocks(other)[1] == 8  # ... which the prefix cache then holds
    assert decode(manager, request, 9) == ([3],)  # the ninth token needs a third block
