"""A prompt's images turned into what the engine schedules: placeholder tokens, processor tensors, content hashes.

A request carries ``multi_modal_data={"image": image or [images]}`` (vLLM's
shape) and one image marker per image in its prompt (``<image>`` for LLaVA,
``<|image_pad|>`` inside ``<|vision_start|>...<|vision_end|>`` for Qwen2-VL,
as the model's chat template writes them).  :func:`request_images` is the one
place images enter the engine; :class:`ImageInputs` runs the model's Hugging
Face image processor on each image and repeats its marker as many times as
the encoder yields rows, the expansion the model's own processor does on the
text, done here on the token ids.  A front end that needs the expanded
length before admitting a request (the server counts image tokens against the
context) processes the images once with :meth:`patchbay.engine.Engine.process_images`
and hands the engine the :class:`ProcessedImages` in place of the raw images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchbay.scheduling.multimodal import ImageFeature


class MultiModalInputError(ValueError):
    """A request's images cannot be used (wrong type, a text-only model, markers and images that do not pair up).

    The message names the request; the server answers it with 400.
    """


@dataclass(frozen=True)
class ProcessedImages:
    """A prompt's images after the image processor: what ``multi_modal_data`` may carry so it runs once.

    Made by :meth:`patchbay.engine.Engine.process_images` from the prompt's token ids; the engine takes it
    only with those same token ids.
    """

    source_token_ids: tuple[int, ...]
    """The prompt's token ids it was made from (one marker per image)."""
    token_ids: list[int]
    """The prompt with each marker expanded to its image's placeholder tokens: what the engine runs."""
    features: list[ImageFeature]
    """Each image's placeholder range, content hash and processor tensors, in prompt order."""

    @property
    def num_prompt_tokens(self) -> int:
        """The expanded prompt's length (what the context and ``usage`` count)."""
        return len(self.token_ids)


def request_images(request_id: str, multi_modal_data: Any) -> list[Any]:
    """The images of ``multi_modal_data`` (``{"image": PIL.Image | list[PIL.Image]}``) as a list of ``PIL.Image``.

    The single spot where images enter the engine. Other sources (files, bytes, arrays, ``data:`` URLs) are decoded
    and checked before, by the entry points (:mod:`patchbay.multimodal.images`, under the ``multimodal:`` limits).
    """
    from PIL import Image

    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        keys = sorted(multi_modal_data) if isinstance(multi_modal_data, dict) else type(multi_modal_data).__name__
        raise MultiModalInputError(
            f"request {request_id!r}: multi_modal_data must be {{'image': image or list of images}}, got {keys}"
        )
    images = multi_modal_data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise MultiModalInputError(
                f"request {request_id!r}: image {index} is a {type(image).__name__}, not a PIL.Image"
            )
    return images


def content_hash(image: Any) -> str:
    """sha256 (hex) of an image's decoded pixels, size and mode: the same picture from any source hashes alike."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class ImageInputs:
    """One vision-language model's image processor and placeholder rule."""

    def __init__(self, model_dir: Path, config: Any, architecture: str) -> None:
        from transformers import AutoImageProcessor

        self.architecture = architecture
        self.family: str = config.model_type
        self.image_token_id = int(config.image_token_id)
        self._merge = int(getattr(config.vision_config, "spatial_merge_size", 1))
        self._patch = int(getattr(config.vision_config, "patch_size", 1))
        self._keeps_cls = getattr(config, "vision_feature_select_strategy", "default") == "full"
        self.processor = AutoImageProcessor.from_pretrained(model_dir)

    @classmethod
    def for_model(cls, model_dir: Path, vision_family: str | None, architecture: str) -> ImageInputs | None:
        """The image inputs of a vision-language model (``vision_family`` set), ``None`` for a text-only one."""
        if vision_family is None:
            return None
        from transformers import AutoConfig

        return cls(model_dir, AutoConfig.from_pretrained(model_dir), architecture)

    def process(self, request_id: str, token_ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageFeature]]:
        """``token_ids`` with each image marker repeated to the image's placeholder count, and the images'
        features (placeholder range, content hash, processor tensors), in prompt order."""
        markers = [index for index, token in enumerate(token_ids) if token == self.image_token_id]
        if len(markers) != len(images):
            raise MultiModalInputError(
                f"request {request_id!r}: the prompt has {len(markers)} image markers (token {self.image_token_id}) "
                f"for {len(images)} images; put one marker per image (the chat template does)"
            )
        expanded: list[int] = []
        features: list[ImageFeature] = []
        cursor = 0
        for index, (marker, image) in enumerate(zip(markers, images, strict=True)):
            try:
                data = self._tensors(image)
            except Exception as exc:  # the processor's own complaint, tied to the request and image
                raise MultiModalInputError(
                    f"request {request_id!r}: image {index} cannot be processed: {type(exc).__name__}: {exc}"
                ) from exc
            count = self._num_placeholders(data)
            expanded.extend(token_ids[cursor:marker])
            features.append(ImageFeature(content_hash(image), len(expanded), count, data))
            expanded.extend([self.image_token_id] * count)
            cursor = marker + 1
        expanded.extend(token_ids[cursor:])
        return expanded, features

    def _tensors(self, image: Any) -> dict[str, Any]:
        output = self.processor(images=[image], return_tensors="pt")
        keep = ("pixel_values", "image_grid_thw")
        return {key: output[key] for key in keep if key in output}

    def _num_placeholders(self, data: dict[str, Any]) -> int:
        if self.family == "qwen2_vl":
            return int(data["image_grid_thw"].prod()) // self._merge**2
        height, width = data["pixel_values"].shape[-2:]
        return (height // self._patch) * (width // self._patch) + (1 if self._keeps_cls else 0)
