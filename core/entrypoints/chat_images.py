"""Image parts of chat messages: found, placed for the chat template, and loaded, shared by ``patchbay serve`` and
:meth:`patchbay.LLM.chat`.

A message's ``content`` may be a list of parts in OpenAI's shape: ``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": ...}}`` (a ``data:``, ``file://`` or ``http(s)://`` URL, as
:func:`patchbay.multimodal.images.load_image_url` takes it) and, for callers in Python,
``{"type": "image", "image": ...}`` (a path, bytes, a ``PIL.Image.Image`` or a numpy array).
:func:`split_image_parts` leaves each image where it was as a ``{"type": "image"}`` part, which the model's
chat template turns into its image placeholder, and returns the images in prompt order;
:func:`load_chat_images` decodes them.  Errors name the part (``messages.1.content.2.image_url``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from patchbay.contract.settings import MultimodalSettings
from patchbay.entrypoints.chat import ChatRequestError


@dataclass(frozen=True)
class ImagePart:
    """One image of a conversation, in prompt order."""

    source: Any
    """A URL string (``image_url`` parts) or any source :func:`load_image` takes (``image`` parts)."""
    where: str
    """The request field it came from (``messages.1.content.2.image_url``), for errors."""
    is_url: bool


def split_image_parts(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """The messages as the chat template takes them, and their images in order.

    A content list without images becomes its texts joined (as text-only templates expect); one with images
    stays a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts.
    """
    images: list[ImagePart] = []
    found = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": _template_content(content, f"messages.{index}.content", images)}
        found.append(message)
    return found, images


def _template_content(parts: list[Any], where: str, images: list[ImagePart]) -> str | list[dict[str, Any]]:
    placed: list[dict[str, Any]] = []
    before = len(images)
    for number, part in enumerate(parts):
        at = f"{where}.{number}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ChatRequestError(f"{at}.text", f"must be a string, got {type(text).__name__}")
            placed.append({"type": "text", "text": text})
        elif kind == "image_url":
            images.append(ImagePart(_image_url(part.get("image_url"), f"{at}.image_url"), f"{at}.image_url", True))
            placed.append({"type": "image"})
        elif kind == "image" and "image" in part:
            images.append(ImagePart(part["image"], f"{at}.image", False))
            placed.append({"type": "image"})
        else:
            shown = kind if kind is not None else type(part).__name__
            raise ChatRequestError(at, f"a content part is text, image_url or image; got {shown!r}")
    if len(images) == before:
        return "".join(part["text"] for part in placed)
    return placed


def _image_url(value: Any, where: str) -> str:
    """The URL of an ``image_url`` field: ``{"url": ...}`` (OpenAI's shape) or the URL string itself."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ChatRequestError(where, 'an image_url part needs {"url": "data:image/...;base64,..."}')
    return url


def refuse_images_for_text_model(images: Sequence[ImagePart], model: str) -> None:
    """A text-only model given images: refused naming the first image part."""
    if images:
        first = images[0].where.rsplit(".", 1)[0]
        raise ChatRequestError(first, f"{model} is a text-only model; it takes no image parts")


def load_chat_images(images: Sequence[ImagePart], limits: MultimodalSettings, field: str = "messages") -> list[Any]:
    """Each image decoded (RGB ``PIL.Image.Image``), the count checked first (too many: an error naming
    ``field``); raises :class:`patchbay.multimodal.images.ImageInputError` naming the part at fault."""
    from patchbay.multimodal.images import check_image_count, load_image, load_image_url

    check_image_count(len(images), limits, field)
    return [
        load_image_url(image.source, limits=limits, where=image.where)
        if image.is_url
        else load_image(image.source, limits=limits, where=image.where)
        for image in images
    ]
