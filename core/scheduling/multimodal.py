"""A request's images as the scheduler sees them: where their placeholder tokens sit, and what they are.

The scheduler is device-free: an image is its placeholder range in the
prompt, its encoder-output size and its content hash; the processor's
tensors ride along (``data``) for the runner, untouched here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageFeature:
    """One image of a request's prompt."""

    content_hash: str
    """sha256 (hex) of the decoded pixels, size and mode: identical images share it (and their encoder output)."""
    offset: int
    """Index of the image's first placeholder token in the prompt."""
    length: int
    """Placeholder tokens of the image; its encoder output has as many rows."""
    data: Any = None
    """The processor's tensors for this image (``pixel_values``, ``image_grid_thw`` ...), for the runner's encoder."""

    @property
    def end(self) -> int:
        """One past the image's last placeholder token."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the token range ``[start, end)`` holds any of the image's placeholder tokens."""
        return self.offset < end and start < self.end
