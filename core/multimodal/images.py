"""Images from every source a prompt may name, decoded whole and checked against the ``multimodal:`` limits.

:func:`load_image` takes a file path, encoded bytes, a ``PIL.Image.Image``, a
numpy array or a URL (:func:`load_image_url`: ``data:``, ``file://`` under
``multimodal.allowed_local_media_path``, ``http(s)://`` when
``multimodal.allow_remote_urls`` is on) and returns an RGB image.  A
``file://`` file is opened without a check-then-open race (each component
from the folder before it; links walked inside the folder only) and must be
a regular file: a FIFO or device is refused, not waited on.  Each
failure raises :class:`ImageInputError` naming the part at fault (``where``)
and what is wrong with it: corrupt or truncated data, a format that is not
an image, more pixels than ``multimodal.max_image_pixels`` (read from the
header, before decoding), a file outside the allowed folder, a refused URL.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from PIL import Image

from patchbay.contract.settings import MultimodalSettings
from patchbay.toolkit.local_files import (
    LeadsOutside,
    LocalFileError,
    open_regular_file,
    open_under,
    read_capped,
    relative_parts,
)

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The encodings decoded; Pillow's other readers (EPS, PDF, ICNS ...) are never reached by untrusted bytes."""

_MAGIC_NAMES = {
    b"%PDF": "a PDF document",
    b"PK\x03\x04": "a ZIP archive",
    b"<svg": "an SVG drawing (vector images are not decoded)",
    b"<?xml": "an XML document",
    b"%!PS": "a PostScript document",
}


class ImageInputError(ValueError):
    """An image patchbay cannot take; ``where`` names the part at fault (``messages.1.content.2.image_url``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


def check_image_count(count: int, limits: MultimodalSettings, where: str) -> None:
    """Refuse a prompt with more images than ``multimodal.max_images_per_prompt``."""
    if count > limits.max_images_per_prompt:
        raise ImageInputError(
            where,
            f"{count} images; at most {limits.max_images_per_prompt} are allowed per prompt "
            "(multimodal.max_images_per_prompt)",
        )


def load_images(sources: Sequence[Any], *, limits: MultimodalSettings, where: str) -> list[Image.Image]:
    """Each source through :func:`load_image` (the count checked first); errors name ``where[i]``."""
    check_image_count(len(sources), limits, where)
    return [load_image(source, limits=limits, where=f"{where}[{index}]") for index, source in enumerate(sources)]


def load_image(source: Any, *, limits: MultimodalSettings, where: str) -> Image.Image:
    """An RGB image from a path, bytes, a ``PIL.Image.Image``, a numpy array or a URL string (see the module)."""
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, limits, where)
        return _as_rgb(source)
    if isinstance(source, np.ndarray):
        return _from_array(source, limits, where)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits=limits, where=where)
    if isinstance(source, str) and _scheme(source) in ("data", "file", "http", "https"):
        return load_image_url(source, limits=limits, where=where)
    if isinstance(source, (str, os.PathLike)):
        return decode_image(_read_capped(Path(source), limits, where), limits=limits, where=where)
    raise ImageInputError(
        where,
        "an image is a file path, bytes, a PIL image, a numpy array or a data:/file:// URL; "
        f"got {type(source).__name__}",
    )


def load_image_url(url: str, *, limits: MultimodalSettings, where: str) -> Image.Image:
    """An RGB image from a ``data:``, ``file://`` or (if allowed) ``http(s)://`` URL."""
    return decode_image(_url_bytes(url, limits, where), limits=limits, where=where)


def _url_bytes(url: str, limits: MultimodalSettings, where: str) -> bytes:
    if not isinstance(url, str):
        raise ImageInputError(where, f"an image URL is a string, got {type(url).__name__}")
    scheme = _scheme(url)
    if scheme == "data":
        return _data_url_bytes(url, limits, where)
    if scheme == "file":
        return _local_file_bytes(url, limits, where)
    if scheme in ("http", "https"):
        return _remote_bytes(url, limits, where)
    shown = url if len(url) <= 40 else url[:40] + "..."
    raise ImageInputError(where, f"{shown!r} is not a data:, file:// or http(s):// URL")


@dataclass(frozen=True)
class EncodedImage:
    """An image's encoded bytes, read and its header checked, not decoded yet."""

    data: bytes
    width: int
    height: int
    where: str

    @property
    def decoded_bytes(self) -> int:
        """What decoding it holds: four bytes a pixel (RGBA, the widest mode it passes through)."""
        return 4 * self.width * self.height


def read_encoded_url(url: str, *, limits: MultimodalSettings, where: str) -> EncodedImage:
    """A URL's image bytes (as :func:`load_image_url` reads them) with its size from the header, not decoded: what
    decoding it will hold is known before it is decoded."""
    data = _url_bytes(url, limits, where)
    image = _open_checked(data, limits, where)
    return EncodedImage(data, image.width, image.height, where)


def decode_encoded(image: EncodedImage, *, limits: MultimodalSettings) -> Image.Image:
    """:func:`read_encoded_url`'s image decoded whole into an RGB image."""
    return decode_image(image.data, limits=limits, where=image.where)


def decode_image(data: bytes, *, limits: MultimodalSettings, where: str) -> Image.Image:
    """Encoded image bytes decoded whole into an RGB image, the pixel count checked from the header first."""
    image = _open_checked(data, limits, where)
    try:
        image.load()  # Pillow reads lazily: decode now so truncated or corrupt data fails here, not in the engine
    except Exception as exc:  # noqa: BLE001 - any decoder failure is corrupt or truncated data
        raise ImageInputError(
            where, f"corrupt or truncated {image.format} image ({type(exc).__name__}: {exc})"
        ) from None
    return _as_rgb(image)


def _open_checked(data: bytes, limits: MultimodalSettings, where: str) -> Image.Image:
    """``data`` opened lazily (header read, nothing decoded), its size and pixel count checked."""
    if not data:
        raise ImageInputError(where, "the image data is empty")
    if len(data) > limits.max_image_bytes:
        raise ImageInputError(
            where,
            f"{len(data)} bytes of image data; the limit is {limits.max_image_bytes} (multimodal.max_image_bytes)",
        )
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check would only warn below twice its default; ours is below, from the header.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as exc:  # over twice Pillow's own limit: refused from the header too
        raise ImageInputError(
            where, f"over the pixel limit ({exc}); the limit is {limits.max_image_pixels} (multimodal.max_image_pixels)"
        ) from None
    except Image.UnidentifiedImageError:
        raise ImageInputError(where, _unsupported(data)) from None
    except Exception as exc:  # noqa: BLE001 - a malformed header is the input's fault, whatever the reader raises
        raise ImageInputError(where, f"corrupt image data ({type(exc).__name__}: {exc})") from None
    _check_pixels(image.width, image.height, limits, where)
    return image


def _scheme(text: str) -> str:
    head, colon, _ = text.partition(":")
    return head.lower() if colon and head.isalpha() else ""


def _unsupported(data: bytes) -> str:
    kinds = ", ".join(ACCEPTED_FORMATS)
    stripped = data.lstrip()
    for magic, name in _MAGIC_NAMES.items():
        if stripped.startswith(magic):
            return f"unsupported format: the data is {name}, not an image in a supported format ({kinds})"
    return f"unsupported format: not an image in a supported format ({kinds}); it starts with {data[:8]!r}"


def _check_pixels(width: int, height: int, limits: MultimodalSettings, where: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageInputError(where, f"the image is {width}x{height}: it has no pixels")
    if width * height > limits.max_image_pixels:
        raise ImageInputError(
            where,
            f"the image is {width}x{height} = {width * height} pixels; the limit is {limits.max_image_pixels} "
            "(multimodal.max_image_pixels)",
        )


def _as_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB; transparency is laid over white, as the Hugging Face image processors do."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _from_array(array: np.ndarray, limits: MultimodalSettings, where: str) -> Image.Image:
    """An HxW, HxWx3 or HxWx4 array of uint8, or of floats in [0, 1], as an RGB image."""
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise ImageInputError(where, f"an image array is HxW, HxWx3 or HxWx4; got shape {tuple(array.shape)}")
    _check_pixels(array.shape[1], array.shape[0], limits, where)
    if array.dtype == np.uint8:
        pixels = array
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0.0 or array.max() > 1.0:
            raise ImageInputError(where, "a float image array holds values in [0, 1]; this one has values outside")
        pixels = np.round(array * 255.0).astype(np.uint8)
    else:
        raise ImageInputError(where, f"an image array is uint8 or float in [0, 1]; got dtype {array.dtype}")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    mode = {2: "L", 3: "RGB", 4: "RGBA"}[pixels.ndim if pixels.ndim == 2 else pixels.shape[2]]
    return _as_rgb(Image.fromarray(np.ascontiguousarray(pixels), mode=mode))


def _data_url_bytes(url: str, limits: MultimodalSettings, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageInputError(where, "a data: URL needs a comma before its data (data:image/png;base64,...)")
    media_type, *parameters = header[len("data:") :].split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise ImageInputError(where, f"the data: URL holds {media_type or 'text/plain'!r}, not an image/* type")
    if "base64" not in (p.strip().lower() for p in parameters):
        raise ImageInputError(where, "an image data: URL must be base64-encoded (data:image/png;base64,...)")
    # base64 grows data by 4/3: refuse an oversized payload before decoding it.
    if len(payload) > (limits.max_image_bytes * 4) // 3 + 4:
        raise ImageInputError(
            where, f"the data: URL holds more than {limits.max_image_bytes} bytes (multimodal.max_image_bytes)"
        )
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(where, f"the data: URL is not valid base64 ({exc})") from None


def _local_file_bytes(url: str, limits: MultimodalSettings, where: str) -> bytes:
    """The bytes of a ``file://`` URL's file under ``multimodal.allowed_local_media_path``, opened safely
    (:func:`patchbay.local_files.open_under`); errors name the URL's path only, never the folder's."""
    allowed = limits.allowed_local_media_path
    if allowed is None:
        raise ImageInputError(
            where, "file:// image URLs are refused; set multimodal.allowed_local_media_path to a folder to allow them"
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageInputError(where, f"a file:// URL names a file on this machine, not on {parsed.netloc!r}")
    text = urllib.parse.unquote(parsed.path)
    if "\0" in text:
        raise ImageInputError(where, "a file:// URL's path must not hold a NUL character")
    path = PurePosixPath(text)
    if not path.is_absolute():
        raise ImageInputError(where, "a file:// URL needs an absolute path (file:///folder/image.png)")
    root = Path(os.path.abspath(allowed))
    spellings = [root, root.resolve()]
    parts = relative_parts(path, spellings)
    if parts is None:  # decided from the text alone: nothing is looked up, so nothing is said about the disk
        raise ImageInputError(where, f"{text!r} is outside multimodal.allowed_local_media_path; it is not read")
    try:
        data = read_capped(open_under(root, parts, roots=spellings), limits.max_image_bytes)
    except LeadsOutside as exc:
        raise ImageInputError(
            where, f"{text!r} is outside multimodal.allowed_local_media_path ({exc}); it is not read"
        ) from None
    except FileNotFoundError:
        raise ImageInputError(where, f"no image file at {text!r}") from None
    except LocalFileError as exc:
        raise ImageInputError(where, f"cannot read image file {text!r}: {exc}") from None
    if data is None:
        raise ImageInputError(where, f"{text!r} is over {limits.max_image_bytes} bytes (multimodal.max_image_bytes)")
    return data


def _read_capped(path: Path, limits: MultimodalSettings, where: str) -> bytes:
    """A plain path's bytes (a path the caller gave, links followed; a FIFO or device is refused, not waited on)."""
    try:
        data = read_capped(open_regular_file(path), limits.max_image_bytes)
    except LocalFileError as exc:
        raise ImageInputError(where, f"cannot read image file {str(path)!r}: {exc}") from None
    if data is None:
        raise ImageInputError(
            where, f"{str(path)!r} is over {limits.max_image_bytes} bytes (multimodal.max_image_bytes)"
        )
    return data


def _remote_bytes(url: str, limits: MultimodalSettings, where: str) -> bytes:
    if not limits.allow_remote_urls:
        raise ImageInputError(
            where,
            "remote image URLs are not fetched; send the image as a data: URL "
            "(or set multimodal.allow_remote_urls: true on the server)",
        )
    # Only http(s) handlers: a redirect to file:// or ftp:// finds no handler and fails.
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    request = urllib.request.Request(url, headers={"User-Agent": "patchbay"})
    try:
        with opener.open(request, timeout=limits.remote_fetch_timeout) as response:
            data = response.read(limits.max_image_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise ImageInputError(where, f"fetching the image failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageInputError(where, f"fetching the image failed: {reason}") from None
    if len(data) > limits.max_image_bytes:
        raise ImageInputError(
            where, f"the remote image is over {limits.max_image_bytes} bytes (multimodal.max_image_bytes)"
        )
    return data


def load_multi_modal_data(data: Any, *, limits: MultimodalSettings, where: str) -> dict[str, list[Image.Image]]:
    """A prompt's ``multi_modal_data`` (``{"image": source | [sources]}``) with every image loaded (RGB), the
    count checked against ``multimodal.max_images_per_prompt``."""
    if not isinstance(data, dict):
        raise ImageInputError(where, f'must be an object like {{"image": [...]}}, got {type(data).__name__}')
    unknown = sorted(str(key) for key in data if key != "image")
    if unknown:
        raise ImageInputError(f"{where}.{unknown[0]}", "only 'image' inputs are taken")
    sources = data.get("image", [])
    if not isinstance(sources, (list, tuple)):
        sources = [sources]
    return {"image": load_images(list(sources), limits=limits, where=f"{where}.image")}
