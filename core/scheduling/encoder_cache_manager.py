"""The encoder cache seen from the scheduler: which images' encoder outputs the runner holds, and who needs them.

The runner keeps each encoded image's output (``[placeholder_tokens,
hidden]``) by content hash; this manager mirrors that cache in tokens, so the
scheduler encodes an image only when its output is absent and fits, and tells
the runner which outputs to drop.  Identical images (same content hash) share
one entry, whichever requests or prompt positions use them.

An entry no request needs any more stays cached, least recently released
first in line for eviction: it is dropped only when a new image needs its
room (as vLLM's encoder cache does), so the same image in consecutive
requests is encoded once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from patchbay.scheduling.multimodal import ImageFeature


@dataclass
class EncoderCacheStats:
    """What the encoder cache did over its life (for the engine report)."""

    hits: int = 0
    """Images scheduled whose encoder output was already cached (another request's, or an earlier copy's)."""
    misses: int = 0
    """Images scheduled for encoding."""
    encoded_tokens: int = 0
    """Encoder output rows computed (placeholder tokens of the missed images)."""
    evictions: int = 0
    """Released outputs dropped to make room for new ones."""


class EncoderCacheManager:
    """Tracks the runner's encoder cache: entries by content hash, their sizes, their users, the released ones."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the encoder cache needs a positive capacity in tokens, got {capacity}")
        self.capacity = capacity
        self._sizes: dict[str, int] = {}
        """Cached (or being encoded this step) entries: content hash to output rows."""
        self._num_cached_tokens = 0
        """The sum of ``_sizes``."""
        self._users: dict[str, set[tuple[str, int]]] = {}
        """Per entry in use, the (request id, image index) pairs that still need it."""
        self._released: OrderedDict[str, int] = OrderedDict()
        """Entries no request needs, least recently released first: evicted in this order when room is needed."""
        self._num_released_tokens = 0
        """The sum of ``_released``."""
        self._freed: list[str] = []
        """Entries dropped since the runner was last told."""
        self.stats = EncoderCacheStats()

    @property
    def num_free_tokens(self) -> int:
        """Room no entry takes (released entries count as taken until evicted)."""
        return self.capacity - self._num_cached_tokens

    @property
    def num_reclaimable_tokens(self) -> int:
        """Room a new image can get: the free room plus the released entries it may evict."""
        return self.num_free_tokens + self._num_released_tokens

    @property
    def num_entries(self) -> int:
        """Entries cached, in use or released."""
        return len(self._sizes)

    @property
    def num_entries_in_use(self) -> int:
        """Entries some request still needs."""
        return len(self._users)

    @property
    def num_cached_tokens(self) -> int:
        """Output rows of every cached entry (never more than ``capacity``)."""
        return self._num_cached_tokens

    def is_cached(self, feature: ImageFeature) -> bool:
        """Whether the image's output is cached (or scheduled for encoding this step), in use or released."""
        return feature.content_hash in self._sizes

    def is_released(self, feature: ImageFeature) -> bool:
        """Whether the image's output is cached but no request needs it (it may be evicted for room)."""
        return feature.content_hash in self._released

    def use(self, request_id: str, index: int, feature: ImageFeature) -> None:
        """Record that image ``index`` of ``request_id`` needs ``feature``'s entry: a cached one (taken back from
        the released ones if there), or a new one, evicting released entries for its room."""
        content_hash = feature.content_hash
        if content_hash in self._released:
            self._num_released_tokens -= self._released.pop(content_hash)
        elif content_hash not in self._sizes:
            self._make_room(feature.length)
            self._sizes[content_hash] = feature.length
            self._num_cached_tokens += feature.length
        self._users.setdefault(content_hash, set()).add((request_id, index))

    def uses(self, request_id: str, index: int, feature: ImageFeature) -> bool:
        """Whether image ``index`` of ``request_id`` already holds its entry."""
        return (request_id, index) in self._users.get(feature.content_hash, ())

    def release(self, request_id: str, index: int, feature: ImageFeature) -> None:
        """Image ``index`` of ``request_id`` no longer needs its entry; after the last user's release the entry
        stays cached, released, until a new image needs its room."""
        content_hash = feature.content_hash
        users = self._users.get(content_hash)
        if users is None:
            return
        users.discard((request_id, index))
        if not users:
            del self._users[content_hash]
            self._released[content_hash] = self._sizes[content_hash]
            self._num_released_tokens += self._sizes[content_hash]

    def release_all(self, request_id: str, features: list[ImageFeature]) -> None:
        """Release every image of a request (finished, aborted or preempted)."""
        for index, feature in enumerate(features):
            self.release(request_id, index, feature)

    def drop_all(self, request_id: str, features: list[ImageFeature]) -> None:
        """Release every image of a failed request and drop the entries no one else uses: the runner may not
        hold their outputs (their encoding may be what failed)."""
        for index, feature in enumerate(features):
            self.release(request_id, index, feature)
            if feature.content_hash in self._released:
                self._drop(feature.content_hash)

    def take_freed(self) -> list[str]:
        """The content hashes dropped since the last call (for the runner to delete)."""
        freed, self._freed = self._freed, []
        return freed

    def _make_room(self, length: int) -> None:
        while self.num_free_tokens < length:
            if not self._released:
                raise RuntimeError(
                    f"the encoder cache has no room for {length} tokens ({self.num_free_tokens} free of "
                    f"{self.capacity}, none released): the scheduler planned past it"
                )
            self._drop(next(iter(self._released)))
            self.stats.evictions += 1

    def _drop(self, content_hash: str) -> None:
        self._num_released_tokens -= self._released.pop(content_hash)
        self._num_cached_tokens -= self._sizes.pop(content_hash)
        self._freed.append(content_hash)
