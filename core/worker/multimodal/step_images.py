"""The images of the runner's running requests: encoding the scheduled ones, their M-RoPE positions, and their
rows merged into each step's input embeddings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from patchbay.scheduling.multimodal import ImageFeature
from patchbay.worker.model.vision import VisionEncoder
from patchbay.worker.multimodal.encoder_cache import EncoderOutputCache
from patchbay.worker.multimodal.mrope import MRopePositions


class StepImages:
    """Per running request, its images (and M-RoPE positions); the encoder cache they share."""

    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder
        self.cache = EncoderOutputCache()
        self._features: dict[str, list[ImageFeature]] = {}
        self._mrope: dict[str, MRopePositions] = {}
        self.num_encoded = 0
        """Images encoded since creation."""

    def add_request(self, req_id: str, num_prompt_tokens: int, features: Sequence[ImageFeature]) -> None:
        """A new or resumed request: remember its images and compute its prompt's M-RoPE positions (if used)."""
        self._features[req_id] = list(features)
        if self.encoder.mrope is not None:
            self._mrope[req_id] = MRopePositions(num_prompt_tokens, features, self.encoder.mrope.spatial_merge_size)

    def remove_request(self, req_id: str) -> None:
        self._features.pop(req_id, None)
        self._mrope.pop(req_id, None)

    def encode(self, free_hashes: list[str], scheduled: dict[str, list[int]]) -> None:
        """Drop the outputs the scheduler freed, then encode this step's scheduled images in one batch."""
        self.cache.free(free_hashes)
        features = [self._features[req_id][index] for req_id, indices in scheduled.items() for index in indices]
        before = len(self.cache)
        self.cache.encode(self.encoder, features)
        self.num_encoded += len(self.cache) - before

    def positions(self, req_ids: Sequence[str], starts: np.ndarray, counts: np.ndarray, flat: np.ndarray) -> np.ndarray:
        """The step's positions: ``flat`` (``[tokens]``) for a plain-RoPE model, else ``[3, tokens]`` M-RoPE ones
        (requests without images get their plain position on all three axes)."""
        if self.encoder.mrope is None:
            return flat
        positions = np.broadcast_to(flat, (3, len(flat))).copy()
        cursor = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist(), strict=True):
            mrope = self._mrope.get(req_id)
            if mrope is not None:
                positions[:, cursor : cursor + count] = mrope.of(start, start + count)
            cursor += count
        return positions

    def inputs_embeds(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,
        req_ids: Sequence[str],
        starts: np.ndarray,
        counts: np.ndarray,
    ) -> torch.Tensor | None:
        """The step's input embeddings with the image rows its chunks reach in place of their placeholder
        tokens' embeddings; ``None`` when no chunk reaches an image (the model embeds the ids itself)."""
        targets: list[int] = []
        rows: list[torch.Tensor] = []
        cursor = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist(), strict=True):
            end = start + count
            for feature in self._features.get(req_id, ()):
                if not feature.overlaps(start, end):
                    continue
                first, last = max(start, feature.offset), min(end, feature.end)
                rows.append(self.cache.get(feature)[first - feature.offset : last - feature.offset])
                targets.extend(range(cursor + first - start, cursor + last - start))
            cursor += count
        if not rows:
            return None
        embeds = embed(input_ids)
        index = torch.tensor(targets, dtype=torch.long, device=embeds.device)
        return embeds.index_copy(0, index, torch.cat(rows).to(embeds.dtype))
