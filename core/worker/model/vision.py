"""The vision half of a vision-language model: its image encoder (vision tower and projector) and its positions.

patchbay runs a vision-language model's language model like any decoder
(its attention through patchbay's backends, over the paged cache); the vision
tower runs with transformers' own attention, outside the cache.  This module
knows each supported family's calls: how to encode a batch of images into
one ``[placeholder_tokens, hidden]`` tensor each, and whether the language
model takes 3-D M-RoPE positions (Qwen2-VL) or plain ones (LLaVA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from patchbay.toolkit.model_files import ModelLoadError

SUPPORTED_FAMILIES = ("qwen2_vl", "llava")
"""``model_type`` of the vision-language models patchbay runs."""


@dataclass(frozen=True)
class MRopeConfig:
    """What 3-D M-RoPE positions are computed from (Qwen2-VL)."""

    image_token_id: int
    spatial_merge_size: int


class VisionEncoder:
    """Encodes images for one loaded vision-language model (transformers' ``get_image_features``)."""

    def __init__(self, model: Any, architecture: str) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"{architecture} ({config.model_type}) is a vision-language model patchbay does not run yet; "
                f"supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        self.family: str = config.model_type
        self.image_token_id: int = int(config.image_token_id)
        self._model = model.model
        self.mrope: MRopeConfig | None = (
            MRopeConfig(self.image_token_id, int(config.vision_config.spatial_merge_size))
            if self.family == "qwen2_vl"
            else None
        )
        """How to compute M-RoPE positions (``None``: the language model takes plain positions)."""
        self._options: dict[str, Any] = (
            {
                "vision_feature_layer": config.vision_feature_layer,
                "vision_feature_select_strategy": config.vision_feature_select_strategy,
            }
            if self.family == "llava"
            else {}
        )

    @torch.inference_mode()
    def encode(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Run the vision tower and projector once over ``images`` (each image's processor tensors, as
        :mod:`patchbay.engine.multimodal_inputs` made them); one ``[placeholder_tokens, hidden]`` per image."""
        if not images:
            return []
        # The processor's tensors are on the CPU, in float32: onto the model's device, pixels in its dtype.
        device, dtype = self._model.device, self._model.dtype
        pixels = torch.cat([image["pixel_values"] for image in images]).to(device=device, dtype=dtype)
        if self.family == "qwen2_vl":
            # Qwen2-VL's processor flattens an image's patches: [patches, dim] rows, concatenated over images.
            grids = torch.cat([image["image_grid_thw"] for image in images]).to(device)
            output = self._model.get_image_features(pixels, grids, return_dict=True)
        else:
            output = self._model.get_image_features(pixels, return_dict=True, **self._options)
        return list(output.pooler_output)


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (a vision tower beside a text model)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None
