"""3-D M-RoPE positions (Qwen2-VL): text tokens count up on all three axes, an image's placeholders take its grid.

The same rule as transformers' ``Qwen2VLModel.get_rope_index``: text tokens
get ``[p, p, p]`` for a running ``p``; an image of ``t x h x w`` merged
patches starts at the running position and gives each placeholder
``(p + ti, p + hi, p + wi)``; the running position then moves on by
``max(h, w)``.  Tokens past the prompt (generated ones, drafts) sit at their
index plus the request's *rope delta* (the last prompt position + 1 - prompt
length), on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from patchbay.scheduling.multimodal import ImageFeature


class MRopePositions:
    """One request's M-RoPE positions: computed for its prompt once, extended past it by the rope delta."""

    def __init__(self, num_prompt_tokens: int, features: Sequence[ImageFeature], spatial_merge_size: int) -> None:
        positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
        running = 0
        cursor = 0
        for feature in features:
            text = feature.offset - cursor
            positions[:, cursor : feature.offset] = running + np.arange(text)
            running += text
            t, h, w = (int(size) for size in feature.data["image_grid_thw"].reshape(-1, 3)[0])
            h, w = h // spatial_merge_size, w // spatial_merge_size
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            if grid.shape[1] != feature.length:
                raise ValueError(
                    f"an image of grid {t}x{h}x{w} has {grid.shape[1]} merged patches but {feature.length} "
                    "placeholder tokens"
                )
            positions[:, feature.offset : feature.end] = running + grid
            running += max(h, w)
            cursor = feature.end
        positions[:, cursor:] = running + np.arange(num_prompt_tokens - cursor)
        self.prompt = positions
        self.delta = int(positions.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
        """Added to the index of every token past the prompt."""

    def of(self, start: int, end: int) -> np.ndarray:
        """Positions ``[3, end - start]`` of tokens ``[start, end)``."""
        num_prompt = self.prompt.shape[1]
        if end <= num_prompt:
            return self.prompt[:, start:end]
        tail = np.arange(max(start, num_prompt), end, dtype=np.int64) + self.delta
        if start >= num_prompt:
            return np.broadcast_to(tail, (3, len(tail)))
        return np.concatenate([self.prompt[:, start:], np.broadcast_to(tail, (3, len(tail)))], axis=1)
