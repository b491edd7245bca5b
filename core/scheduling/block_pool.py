"""A pool of fixed-size KV-cache blocks: free list in LRU order, reference counts, prefix-cache index.

Every operation is O(1) per block.  Block 0 is the *null block*: it is never
handed out, pads block tables and stands in for sliding-window blocks that
were released.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from patchbay.scheduling.kv_events import KVEventLog


class KVCacheBlock:
    """One block's bookkeeping: reference count, cached hash and links of the free list."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        """Hash of the full block's tokens while it is in the prefix cache, else ``None``."""
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks: take from the head, give back to the tail.

    The head is the least recently freed block, the first to be evicted.  A
    block in the middle (a cached block revived by a prefix hit) is unlinked
    in O(1).  Two sentinels keep the edge cases out of the code.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._length -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._length += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next evicted) to tail; for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """``num_blocks`` blocks with ids ``0 .. num_blocks - 1``; block 0 is the reserved null block.

    A block is in use while its reference count is positive.  A freed block
    goes to the tail of the free list but keeps its hash: a prefix-cache hit
    revives it (:meth:`touch`), and allocation evicts it (drops the hash).
    With an ``event_log``, every block entering or leaving the prefix cache is
    recorded there under ``group_idx`` (KV-cache events for outside indexes).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        *,
        event_log: KVEventLog | None = None,
        group_idx: int = 0,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is reserved), got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        """Hash of a full block to the one block holding it (in use or free)."""
        self.event_log = event_log
        self.group_idx = group_idx
        self.highest_handed_out = 0
        """The highest block id ever allocated: never-used blocks leave the free list first, in id order (freed
        ones join its tail), so every block above this one has never held anything."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free ones, cached or not)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding ``block_hash``, or ``None``; no side effect."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free list, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
            self.highest_handed_out = max(self.highest_handed_out, block.block_id)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving free ones (prefix-cache hits)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; unreferenced blocks go to the free tail."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        *,
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> None:
        """Register ``blocks[start:end]`` under ``block_hashes[start:end]`` in the prefix cache.

        Blocks already cached (prefix hits) and null blocks are skipped.  When
        another block already holds the same hash (two requests computed the
        same tokens side by side), the newer block stays uncached.  With an
        event log, each run of newly cached blocks is one ``BlockStored``; it
        needs the request's ``token_ids`` (all of them, from position 0) and
        its ``lora_name``.
        """
        if not self.enable_prefix_caching:
            return
        newly_cached: list[int] = []
        for index in range(start, end):
            block = blocks[index]
            if block.is_null or block.block_hash is not None:
                continue
            block_hash = block_hashes[index]
            if block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            newly_cached.append(index)
        if self.event_log is not None and newly_cached:
            self._record_stored(newly_cached, block_hashes, token_ids, lora_name)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash.  Safe while requests run: their blocks stay theirs, just unshared."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.event_log is not None:
                self.event_log.block_removed(self.group_idx, block.block_hash)
        block.block_hash = None

    def _record_stored(
        self, indexes: list[int], block_hashes: Sequence[bytes], token_ids: Sequence[int], lora_name: str | None
    ) -> None:
        """One ``BlockStored`` per run of consecutive block indexes: ``[3, 4, 7]`` -> blocks 3-4, then block 7."""
        assert self.event_log is not None
        size = self.event_log.block_size
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self.event_log.block_stored(
                self.group_idx,
                [block_hashes[index] for index in run],
                block_hashes[first - 1] if first > 0 else None,
                token_ids[first * size : (last + 1) * size],
                lora_name,
            )
