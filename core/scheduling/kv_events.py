"""KV-cache events: the prefix-cache blocks a pool stored, evicted or forgot, for indexes outside the engine.

A router that sends each request where its prefix is cached (vLLM's router,
llm-d's KV-cache indexer, Dynamo) keeps its own index of every engine's
cached blocks, fed by these events.  They are plain records here (no torch,
no wire format); ``patchbay.engine.kv_event_publisher`` sends them in vLLM's
``KVEventBatch`` format.  Replayed in order, the events of one pool give
exactly its :attr:`BlockPool.cached_blocks` keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in prefix order: each hash chains on the one before it."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    """The hash of the block before the first one (``None``: the first is the prompt's first block)."""
    token_ids: tuple[int, ...]
    """The blocks' tokens, ``block_size`` per block."""
    block_size: int
    lora_name: str | None
    group_idx: int
    """The KV-cache group (pool) holding the blocks."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their memory went to other tokens)."""

    block_hashes: tuple[bytes, ...]
    group_idx: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every pool forgot every cached block (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events of a KV cache's pools since the last :meth:`take`, in the order they happened."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def block_stored(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        parent_block_hash: bytes | None,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
        """Record full blocks cached in a row (``token_ids``: theirs, ``block_size`` each)."""
        if len(token_ids) != len(block_hashes) * self.block_size:
            raise ValueError(
                f"{len(block_hashes)} stored blocks of {self.block_size} tokens come with {len(token_ids)} token ids"
            )
        self._events.append(
            BlockStored(tuple(block_hashes), parent_block_hash, tuple(token_ids), self.block_size, lora_name, group_idx)
        )

    def block_removed(self, group_idx: int, block_hash: bytes) -> None:
        """Record one block evicted from group ``group_idx``'s prefix cache."""
        self._events.append(BlockRemoved((block_hash,), group_idx))

    def all_cleared(self) -> None:
        """Record that every pool forgot its cached blocks."""
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events
