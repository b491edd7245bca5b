"""The paged KV cache seen from the scheduler: which blocks each request holds, per KV-cache group.

One :class:`BlockPool` per group; every pool has the same number of blocks,
and every group the same block size, so one token position maps to the same
block index in every group's table.  Sliding-window groups release blocks that
fell out of the window and put the null block 0 in their place.
"""

from __future__ import annotations

from collections.abc import Sequence

from patchbay.scheduling.block_pool import BlockPool, KVCacheBlock
from patchbay.scheduling.kv_cache_spec import KVCacheGroup
from patchbay.scheduling.kv_events import KVCacheEvent, KVEventLog
from patchbay.scheduling.request import Request
from patchbay.scheduling.scheduler_output import BlockIds


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks_for_memory(groups: Sequence[KVCacheGroup], memory_bytes: int) -> int:
    """How many blocks (per group, null block included) fit in ``memory_bytes``.

    One block index costs a page in every layer of every group, e.g. 2 groups
    of 4 layers with 8 KiB pages: 8 * 8 KiB = 64 KiB per block index, so 1 GiB
    holds 16384 blocks.
    """
    bytes_per_block = sum(len(group.layer_names) * group.spec.page_size_bytes for group in groups)
    if bytes_per_block <= 0:
        raise ValueError("cannot size the KV cache: the KV-cache groups have no layers")
    return int(memory_bytes) // bytes_per_block


class KVCacheManager:
    """Allocates, shares (prefix caching) and frees the blocks of requests across KV-cache groups."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        enable_prefix_caching: bool = True,
        *,
        enable_kv_events: bool = False,
    ) -> None:
        """``enable_kv_events``: record the blocks entering and leaving the prefix cache (:meth:`take_events`)."""
        if not groups:
            raise ValueError("KVCacheManager needs at least one KV-cache group")
        block_sizes = sorted({group.spec.block_size for group in groups})
        if len(block_sizes) != 1:
            raise ValueError(f"all KV-cache groups must share one block size, got block sizes {block_sizes}")
        self.groups = list(groups)
        self.block_size = block_sizes[0]
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.event_log = KVEventLog(self.block_size) if enable_kv_events else None
        self.pools = [
            BlockPool(num_blocks, enable_prefix_caching, event_log=self.event_log, group_idx=index)
            for index in range(len(self.groups))
        ]
        self._windowed = any(group.spec.sliding_window is not None for group in self.groups)
        """Whether a group releases blocks that slid out of its window (no fast path for a decode then)."""
        self._tables: dict[str, list[list[KVCacheBlock]]] = {}
        """Request id to its block table, one list of blocks per group."""
        self._num_cached_blocks: dict[str, int] = {}
        """Request id to how many of its leading blocks are registered in the prefix cache."""
        self.prefix_cache_queries = 0
        """Tokens of newly scheduled requests looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Of those, tokens found in the cache."""

    # -- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the fullest pool (the binding constraint)."""
        return min(pool.num_free_blocks for pool in self.pools)

    @property
    def usage(self) -> float:
        """Usage of the fullest pool, 0.0 to 1.0."""
        return max(pool.usage for pool in self.pools)

    @property
    def highest_block_ids(self) -> tuple[int, ...]:
        """Per group, the highest block id ever allocated (every block above it has never been used)."""
        return tuple(pool.highest_handed_out for pool in self.pools)

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block table, one list of ids per group (0 marks a released sliding-window block)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return self._empty_block_ids()
        return tuple([block.block_id for block in table] for table in tables)

    def max_blocks_per_request(self, max_model_len: int, max_tokens_per_step: int) -> int:
        """The most blocks one request can hold in any one pool.

        A sliding-window group holds the window behind the first token of a
        step plus the step's tokens: at most ``cdiv(window + tokens, block_size) + 1``
        blocks (the +1: the window's oldest block may be partly outside it).
        """
        most = 0
        for group in self.groups:
            blocks = _cdiv(max_model_len, self.block_size)
            window = group.spec.sliding_window
            if window is not None:
                blocks = min(blocks, _cdiv(window + max_tokens_per_step, self.block_size) + 1)
            most = max(most, blocks)
        return most

    def get_computed_blocks(self, request: Request) -> tuple[BlockIds, int]:
        """The longest prefix of the request cached in every group: block ids and number of tokens.

        Never the whole request: the last token is always recomputed so the
        model produces logits for it (e.g. a 32-token prompt with 16-token
        blocks hits at most 16 tokens).  Requests that compute their whole
        prompt (prompt logprobs, poolers reading more than the last token)
        never hit.  No side effects: reference counts are untouched.
        """
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return self._empty_block_ids(), 0
        self._check_block_size(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]

        num_hit = len(hashes)
        for group, pool in zip(self.groups, self.pools, strict=True):
            if group.spec.sliding_window is None:
                num_hit = self._longest_cached_prefix(pool, hashes[:num_hit])
        sliding = [
            (group.spec.sliding_window, pool)
            for group, pool in zip(self.groups, self.pools, strict=True)
            if group.spec.sliding_window is not None
        ]
        if sliding:
            num_hit = self._longest_sliding_hit(hashes[:num_hit], sliding)

        block_ids = []
        for group, pool in zip(self.groups, self.pools, strict=True):
            first_needed = self._first_needed_block(num_hit * self.block_size, group.spec.sliding_window)
            ids = [0] * first_needed
            for index in range(first_needed, num_hit):
                block = pool.get_cached_block(hashes[index])
                assert block is not None
                ids.append(block.block_id)
            block_ids.append(ids)
        return tuple(block_ids), num_hit * self.block_size

    # -- changes -----------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: BlockIds | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> BlockIds | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (drafts included).

        ``new_computed_blocks`` / ``num_new_computed_tokens`` come from
        :meth:`get_computed_blocks` for a request scheduled for the first time
        (or resumed): those blocks join its table with one more reference.
        Returns the ids of the blocks appended per group (computed blocks not
        included; see :meth:`get_block_ids` for the whole table), or ``None``
        when a pool lacks free blocks, in which case the table is unchanged
        (sliding-window blocks already out of the window may have been released).
        Blocks that become full of known tokens are registered in the prefix cache.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"request {request.request_id!r}: num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        tables = self._tables.get(request_id)
        if tables is not None and new_computed_blocks is None and not self._windowed:
            # Most steps of a running request (a decode: 15 of every 16 with blocks of 16) fit the blocks it holds:
            # nothing to release, take or touch. At 64 decoding requests the general path below made a quarter of
            # a step's Python calls.
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_required_blocks = _cdiv(num_tokens + num_lookahead_tokens, self.block_size)
            if all(len(table) >= num_required_blocks for table in tables):
                self._cache_full_blocks(request, tables, num_tokens)
                return self._empty_block_ids()
        if tables is None:
            self._check_block_size(request)
        else:
            self._release_out_of_window(tables, request.num_computed_tokens)

        computed_ids = new_computed_blocks if new_computed_blocks is not None else self._empty_block_ids()
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = _cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)

        plan: list[tuple[list[KVCacheBlock], int]] = []
        for index, pool in enumerate(self.pools):
            computed = [pool.blocks[block_id] for block_id in computed_ids[index]]
            held = len(tables[index]) if tables is not None else 0
            num_new_blocks = max(0, num_required_blocks - held - len(computed))
            # Touching a free cached block takes it off the free list too.
            num_revived = sum(1 for block in computed if block.ref_cnt == 0 and not block.is_null)
            if num_new_blocks + num_revived > pool.num_free_blocks:
                return None
            plan.append((computed, num_new_blocks))

        if tables is None:
            tables = self._tables[request_id] = [[] for _ in self.pools]
            self._num_cached_blocks[request_id] = num_new_computed_tokens // self.block_size
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens

        new_block_ids = []
        for pool, table, (computed, num_new_blocks) in zip(self.pools, tables, plan, strict=True):
            pool.touch(computed)
            table.extend(computed)
            new_blocks = pool.get_new_blocks(num_new_blocks)
            table.extend(new_blocks)
            new_block_ids.append([block.block_id for block in new_blocks])

        self._cache_full_blocks(request, tables, num_computed + num_new_tokens)
        return tuple(new_block_ids)

    def free(self, request: Request) -> None:
        """Release all blocks of the request, last block first.

        Freed blocks join the free list's tail in that order, so a request's
        tail blocks are evicted before its prefix blocks, which are likelier
        to be shared.
        """
        tables = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables, strict=True):
            pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes in every pool (blocks in use stay with their requests)."""
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.event_log is not None:
            self.event_log.all_cleared()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first (none unless built with ``enable_kv_events``)."""
        return self.event_log.take() if self.event_log is not None else []

    # -- helpers -----------------------------------------------------------

    def _empty_block_ids(self) -> BlockIds:
        return tuple([] for _ in self.pools)

    def _check_block_size(self, request: Request) -> None:
        if request.block_size != self.block_size:
            raise ValueError(
                f"request {request.request_id!r} hashes blocks of {request.block_size} tokens "
                f"but the KV cache uses blocks of {self.block_size}"
            )

    def _first_needed_block(self, position: int, sliding_window: int | None) -> int:
        """First block a token at ``position`` may attend to.

        We assume a token sees ``position - window .. position`` (one more
        than the strictest convention; keeping a block too many is safe).
        Example: window 32, blocks of 16, position 100: oldest visible
        position 68 lies in block 4, so blocks 0..3 can go.
        """
        if sliding_window is None:
            return 0
        return max(0, (position - sliding_window) // self.block_size)

    @staticmethod
    def _longest_cached_prefix(pool: BlockPool, hashes: Sequence[bytes]) -> int:
        for index, block_hash in enumerate(hashes):
            if pool.get_cached_block(block_hash) is None:
                return index
        return len(hashes)

    def _longest_sliding_hit(self, hashes: Sequence[bytes], sliding: list[tuple[int, BlockPool]]) -> int:
        """Largest ``k <= len(hashes)`` such that each sliding pool caches the blocks token ``k * block_size`` sees.

        Only blocks inside the window are needed, so a hit of ``k`` blocks
        is valid when the run of cached blocks ending at block ``k - 1`` is
        long enough, even if older blocks were evicted.
        """
        valid = [True] * (len(hashes) + 1)
        for window, pool in sliding:
            run = 0
            for k in range(1, len(hashes) + 1):
                run = run + 1 if pool.get_cached_block(hashes[k - 1]) is not None else 0
                needed = k - self._first_needed_block(k * self.block_size, window)
                valid[k] = valid[k] and run >= needed
        return max(k for k, ok in enumerate(valid) if ok)

    def _release_out_of_window(self, tables: list[list[KVCacheBlock]], num_computed_tokens: int) -> None:
        for group, pool, table in zip(self.groups, self.pools, tables, strict=True):
            first_needed = min(len(table), self._first_needed_block(num_computed_tokens, group.spec.sliding_window))
            released = []
            # Walk back from the window edge; everything before the first null was released earlier.
            for index in range(first_needed - 1, -1, -1):
                if table[index].is_null:
                    break
                released.append(table[index])
                table[index] = pool.null_block
            pool.free_blocks(released)

    def _cache_full_blocks(self, request: Request, tables: list[list[KVCacheBlock]], num_tokens_done: int) -> None:
        if not self.enable_prefix_caching:
            return
        # Drafts may be scheduled past the known tokens; only blocks of known tokens have hashes.
        num_full = min(num_tokens_done // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        lora_name = getattr(request.sampling_params, "lora", None)
        for pool, table in zip(self.pools, tables, strict=True):
            pool.cache_full_blocks(
                table, request.block_hashes, start, num_full, token_ids=request.all_token_ids, lora_name=lora_name
            )
        self._num_cached_blocks[request.request_id] = num_full
