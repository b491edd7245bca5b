"""The runner's encoder cache: each encoded image's output by content hash, dropped when the scheduler says.

The scheduler's :class:`patchbay.scheduling.encoder_cache_manager.EncoderCacheManager`
decides what is encoded and freed (and bounds the size); this side holds the tensors.
"""

from __future__ import annotations

import torch

from patchbay.scheduling.multimodal import ImageFeature
from patchbay.worker.model.vision import VisionEncoder


class EncoderOutputCache:
    """Encoder outputs (``[placeholder_tokens, hidden]``) by image content hash."""

    def __init__(self) -> None:
        self.outputs: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.outputs)

    def free(self, content_hashes: list[str]) -> None:
        """Drop the outputs no request needs any more."""
        for content_hash in content_hashes:
            self.outputs.pop(content_hash, None)

    def encode(self, encoder: VisionEncoder, features: list[ImageFeature]) -> None:
        """Encode ``features`` in one batch (each distinct image once) and keep their outputs."""
        todo: dict[str, ImageFeature] = {}
        for feature in features:
            if feature.content_hash not in self.outputs:
                todo.setdefault(feature.content_hash, feature)
        if not todo:
            return
        outputs = encoder.encode([feature.data for feature in todo.values()])
        for (content_hash, feature), output in zip(todo.items(), outputs, strict=True):
            if output.shape[0] != feature.length:
                raise RuntimeError(
                    f"the vision encoder gave {output.shape[0]} rows for an image of {feature.length} placeholder "
                    "tokens; the processor and the model disagree"
                )
            self.outputs[content_hash] = output

    def get(self, feature: ImageFeature) -> torch.Tensor:
        """The cached output of ``feature`` (the scheduler encodes every image before its placeholders run)."""
        output = self.outputs.get(feature.content_hash)
        if output is None:
            raise RuntimeError(
                f"no encoder output for image {feature.content_hash[:12]} at placeholder offset {feature.offset}: "
                "the scheduler and the runner disagree on the encoder cache"
            )
        return output
