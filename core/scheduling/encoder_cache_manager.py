"""The encoder cache seen from the scheduler: which images' encoder outputs the runner holds, and who needs them.

The runner keeps each encoded image's output (``[placeholder_tokens,
hidden]``) by content hash until no request still needs it; this manager
mirrors that cache in tokens, so the scheduler encodes an image only when
its output is absent and fits, and tells the runner which outputs to drop.
Identical images (same content hash) share one entry, whichever requests
or prompt positions use them.
"""

from __future__ import annotations

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


class EncoderCacheManager:
    """Tracks the runner's encoder cache: entries by content hash, their sizes and their users."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the encoder cache needs a positive capacity in tokens, got {capacity}")
        self.capacity = capacity
        self._sizes: dict[str, int] = {}
        """Cached (or being encoded this step) entries: content hash to output rows."""
        self._users: dict[str, set[tuple[str, int]]] = {}
        """Per entry, the (request id, image index) pairs that still need it."""
        self._freed: list[str] = []
        """Entries dropped since the runner was last told."""
        self.stats = EncoderCacheStats()

    @property
    def num_free_tokens(self) -> int:
        return self.capacity - sum(self._sizes.values())

    @property
    def num_entries(self) -> int:
        return len(self._sizes)

    def is_cached(self, feature: ImageFeature) -> bool:
        """Whether the image's output is cached (or scheduled for encoding this step)."""
        return feature.content_hash in self._sizes

    def can_allocate(self, feature: ImageFeature) -> bool:
        return feature.length <= self.num_free_tokens

    def use(self, request_id: str, index: int, feature: ImageFeature) -> None:
        """Record that image ``index`` of ``request_id`` needs ``feature``'s entry (cached, or allocated now)."""
        self._sizes.setdefault(feature.content_hash, feature.length)
        self._users.setdefault(feature.content_hash, set()).add((request_id, index))

    def uses(self, request_id: str, index: int, feature: ImageFeature) -> bool:
        """Whether image ``index`` of ``request_id`` already holds its entry."""
        return (request_id, index) in self._users.get(feature.content_hash, ())

    def release(self, request_id: str, index: int, feature: ImageFeature) -> None:
        """Image ``index`` of ``request_id`` no longer needs its entry; the last user's release drops it."""
        users = self._users.get(feature.content_hash)
        if users is None:
            return
        users.discard((request_id, index))
        if not users:
            del self._users[feature.content_hash]
            del self._sizes[feature.content_hash]
            self._freed.append(feature.content_hash)

    def release_all(self, request_id: str, features: list[ImageFeature]) -> None:
        """Release every image of a request (finished, aborted or preempted)."""
        for index, feature in enumerate(features):
            self.release(request_id, index, feature)

    def take_freed(self) -> list[str]:
        """The content hashes dropped since the last call (for the runner to delete)."""
        freed, self._freed = self._freed, []
        return freed
