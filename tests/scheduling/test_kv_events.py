"""KV-cache events: replayed in order, a pool's events give exactly its prefix cache, and each stored block's
hash is the chained hash of the tokens the event carries."""

from __future__ import annotations

import random

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from patchbay.scheduling.request import Request, hash_block_tokens

from test_kv_cache_manager import BLOCK_SIZE, decode, full_group, make_request, prefill, sliding_group


class Index:
    """What an outside router keeps: per group, the hashes a pool caches, each with the tokens it was told."""

    def __init__(self, check_hashes: bool = False) -> None:
        self.blocks: dict[int, dict[bytes, tuple[int, ...]]] = {}
        self.check_hashes = check_hashes
        """Recompute each stored hash from its parent and tokens (requests without salt, adapter or images)."""

    def apply(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                group = self.blocks.setdefault(event.group_idx, {})
                parent = event.parent_block_hash
                for position, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[position * event.block_size : (position + 1) * event.block_size]
                    assert block_hash not in group, "a block stored twice without being removed"
                    if self.check_hashes:
                        assert block_hash == hash_block_tokens(parent, tokens), "a hash that is not its tokens'"
                    group[block_hash] = tuple(tokens)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                group = self.blocks.setdefault(event.group_idx, {})
                for block_hash in event.block_hashes:
                    assert block_hash in group, "a block removed that was never stored (a phantom)"
                    del group[block_hash]
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()


def check_matches(index: Index, manager: KVCacheManager) -> None:
    for group_idx, pool in enumerate(manager.pools):
        assert set(index.blocks.get(group_idx, {})) == set(pool.cached_blocks)


def test_prefill_stores_one_chained_run_and_a_hit_stores_nothing_new():
    manager = KVCacheManager([full_group()], num_blocks=20, enable_kv_events=True)
    tokens = list(range(100, 111))  # 2 full blocks of 4 and 3 tokens more
    prefill(manager, make_request("a", tokens))
    [stored] = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(tokens[:8])
    first = hash_block_tokens(None, tokens[:4])
    assert stored.block_hashes == (first, hash_block_tokens(first, tokens[4:8]))

    prefill(manager, make_request("b", tokens))  # the same prompt: both blocks hit
    assert manager.take_events() == []


def test_a_decode_that_fills_a_block_stores_it_chained_on_the_prompt():
    manager = KVCacheManager([full_group()], num_blocks=20, enable_kv_events=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    prefill(manager, request)
    [prompt_event] = manager.take_events()
    decode(manager, request, 8)  # the second block is full once its last token is computed
    decode(manager, request, 9)
    [stored] = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == prompt_event.block_hashes[-1]
    assert stored.token_ids == (5, 6, 7, 8)


def test_eviction_removes_and_reset_clears():
    manager = KVCacheManager([full_group()], num_blocks=5, enable_kv_events=True)
    index = Index()
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    second = make_request("b", list(range(50, 59)))  # needs 3 blocks of 4: evicts cached ones
    prefill(manager, second)
    events = manager.take_events()
    assert any(isinstance(event, BlockRemoved) for event in events)
    index.apply(events)
    check_matches(index, manager)
    manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]
    index.apply([AllBlocksCleared()])
    check_matches(index, manager)


def test_a_lora_request_names_its_adapter():
    manager = KVCacheManager([full_group()], num_blocks=10, enable_kv_events=True)
    prefill(manager, make_request("a", list(range(9)), lora="sql"))
    [stored] = manager.take_events()
    assert isinstance(stored, BlockStored) and stored.lora_name == "sql"


def test_without_events_nothing_is_recorded():
    manager = KVCacheManager([full_group()], num_blocks=10)
    prefill(manager, make_request("a", list(range(9))))
    assert manager.take_events() == [] and manager.event_log is None


def test_random_traffic_keeps_the_index_equal_to_every_pool():
    """Shared prefixes, decodes, frees, evictions and a sliding-window group: after every step of the soak the
    replayed index equals each pool's prefix cache, and every stored block's hash is the chained hash of the
    tokens its event carried (no missed and no phantom blocks)."""
    rng = random.Random(54)
    manager = KVCacheManager([full_group(), sliding_group(8)], num_blocks=24, enable_kv_events=True)
    index = Index(check_hashes=True)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 9]))] for _ in range(4)]
    live: list[Request] = []
    for step in range(400):
        if live and (rng.random() < 0.3 or len(live) > 3):
            manager.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.5 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(6))]
            request = Request(f"r{step}", prompt, SamplingParams(), block_size=BLOCK_SIZE)
            computed, num_computed = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - num_computed, computed, num_computed) is None:
                continue
            request.num_computed_tokens = request.num_tokens
            live.append(request)
        else:
            request = rng.choice(live)
            if decode(manager, request, rng.randrange(1000)) is None:
                live.remove(request)
                manager.free(request)
        index.apply(manager.take_events())
        check_matches(index, manager)
    assert len(index.blocks) == 2 and all(index.blocks.values()), "the soak left a group's cache empty"
