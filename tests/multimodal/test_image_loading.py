"""``load_image`` from every source kind, and every bad input refused with a message naming the part."""

from __future__ import annotations

import base64
import http.server
import io
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from patchbay.contract.settings import MultimodalSettings
from patchbay.multimodal.images import ImageInputError, load_image, load_image_url, load_images

WHERE = "request 3: messages.1.content.2.image_url"


def limits(**fields) -> MultimodalSettings:
    return MultimodalSettings(**fields)


def sample(mode: str = "RGB", size: tuple[int, int] = (7, 5)) -> Image.Image:
    """A small image with distinct pixels (a gradient), so a wrong decode cannot pass for a right one."""
    width, height = size
    values = (np.arange(width * height * 4, dtype=np.uint32) * 37 % 256).astype(np.uint8)
    rgba = Image.fromarray(values.reshape(height, width, 4), mode="RGBA")
    return rgba if mode == "RGBA" else rgba.convert("RGB").convert(mode)


def encoded(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def header_only_png(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` in its header, holding a few bytes of pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = zlib.compress(b"\x00" * 64)  # the start of the first row only: far from the whole image
    data = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    return b"\x89PNG\r\n\x1a\n" + chunk + data


def assert_refused(source, message_part: str, **settings) -> ImageInputError:
    with pytest.raises(ImageInputError) as caught:
        load_image(source, limits=limits(**settings), where=WHERE)
    message = str(caught.value)
    assert message.startswith(WHERE + ": "), message
    assert message_part in message, message
    assert caught.value.where == WHERE
    assert isinstance(caught.value, ValueError)
    return caught.value


# -- every source kind ------------------------------------------------------------------------------------


def test_a_pil_image_comes_back_as_rgb_with_its_pixels():
    image = sample()
    loaded = load_image(image, limits=limits(), where=WHERE)
    assert loaded.mode == "RGB"
    assert np.array_equal(pixels(loaded), pixels(image))


def test_transparency_is_laid_over_white_as_the_hf_processors_do():
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent: white
    rgba.putpixel((1, 0), (10, 20, 30, 255))  # opaque: itself
    loaded = load_image(rgba, limits=limits(), where=WHERE)
    assert pixels(loaded).tolist() == [[[255, 255, 255], [10, 20, 30]]]


@pytest.mark.parametrize("format", ["PNG", "BMP", "WEBP", "TIFF", "GIF"])
def test_lossless_encoded_bytes_decode_to_the_same_pixels(format):
    image = sample("P") if format == "GIF" else sample()  # GIF holds a palette: start from one
    buffer = io.BytesIO()
    image.save(buffer, format=format, **({"lossless": True} if format == "WEBP" else {}))
    loaded = load_image(buffer.getvalue(), limits=limits(), where=WHERE)
    assert loaded.mode == "RGB"
    assert np.array_equal(pixels(loaded), pixels(image.convert("RGB")))


def test_jpeg_bytes_decode_to_an_rgb_image_of_the_right_size():
    loaded = load_image(encoded(sample(size=(16, 9)), "JPEG"), limits=limits(), where=WHERE)
    assert (loaded.mode, loaded.size) == ("RGB", (16, 9))


def test_bytearray_and_memoryview_are_bytes_too():
    data = encoded(sample())
    for source in (bytearray(data), memoryview(data)):
        assert np.array_equal(pixels(load_image(source, limits=limits(), where=WHERE)), pixels(sample()))


def test_a_grayscale_and_a_palette_image_become_rgb():
    for mode in ("L", "P"):
        image = sample(mode)
        loaded = load_image(encoded(image), limits=limits(), where=WHERE)
        assert loaded.mode == "RGB"
        assert np.array_equal(pixels(loaded), pixels(image.convert("RGB")))


def test_a_file_path_as_str_or_path(tmp_path):
    path = tmp_path / "picture.png"
    path.write_bytes(encoded(sample()))
    for source in (str(path), path):
        assert np.array_equal(pixels(load_image(source, limits=limits(), where=WHERE)), pixels(sample()))


def test_numpy_arrays_of_every_accepted_shape_and_dtype():
    rgb = pixels(sample())
    assert np.array_equal(pixels(load_image(rgb, limits=limits(), where=WHERE)), rgb)
    gray = rgb[:, :, 0]
    assert np.array_equal(pixels(load_image(gray, limits=limits(), where=WHERE)), np.stack([gray] * 3, axis=2))
    rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 255, np.uint8)], axis=2)
    assert np.array_equal(pixels(load_image(rgba, limits=limits(), where=WHERE)), rgb)
    as_float = rgb.astype(np.float32) / 255.0
    assert np.array_equal(pixels(load_image(as_float, limits=limits(), where=WHERE)), rgb)


def test_a_data_url():
    loaded = load_image(data_url(encoded(sample())), limits=limits(), where=WHERE)
    assert np.array_equal(pixels(loaded), pixels(sample()))
    # load_image_url takes the same URL, and base64 may be wrapped over lines
    wrapped = data_url(encoded(sample())).replace("base64,", "base64,\n", 1)
    assert np.array_equal(pixels(load_image_url(wrapped, limits=limits(), where=WHERE)), pixels(sample()))


def test_a_file_url_under_the_allowed_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "a picture.png"
    path.write_bytes(encoded(sample()))
    url = path.as_uri()  # percent-encodes the space
    loaded = load_image(url, limits=limits(allowed_local_media_path=tmp_path), where=WHERE)
    assert np.array_equal(pixels(loaded), pixels(sample()))


def test_a_symlink_inside_the_allowed_folder_to_a_file_inside_it_is_read(tmp_path):
    (tmp_path / "real.png").write_bytes(encoded(sample()))
    (tmp_path / "link.png").symlink_to(tmp_path / "real.png")
    loaded = load_image((tmp_path / "link.png").as_uri(), limits=limits(allowed_local_media_path=tmp_path), where=WHERE)
    assert np.array_equal(pixels(loaded), pixels(sample()))


def test_load_images_checks_the_count_and_names_each_image():
    good = encoded(sample())
    assert len(load_images([good, good], limits=limits(max_images_per_prompt=2), where="prompt 0")) == 2
    with pytest.raises(ImageInputError, match=r"^prompt 0: 3 images; at most 2 .*max_images_per_prompt"):
        load_images([good, good, good], limits=limits(max_images_per_prompt=2), where="prompt 0")
    with pytest.raises(ImageInputError, match=r"^prompt 0\[1\]: corrupt"):
        load_images([good, good[: len(good) // 2]], limits=limits(), where="prompt 0")


# -- remote URLs -------------------------------------------------------------------------------------------


@pytest.fixture
def image_server() -> Iterator[str]:
    """A local HTTP server: /image.png is a PNG, /big is 4 KiB of PNG-prefixed bytes, anything else 404."""
    body = encoded(sample())

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path == "/image.png":
                payload = body
            elif self.path == "/big":
                payload = body + b"\x00" * 4096
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_remote_url_is_fetched_only_when_allowed(image_server):
    url = f"{image_server}/image.png"
    assert_refused(url, "remote image URLs are not fetched")
    loaded = load_image(url, limits=limits(allow_remote_urls=True), where=WHERE)
    assert np.array_equal(pixels(loaded), pixels(sample()))


def test_a_remote_fetch_failure_and_an_oversized_body_name_the_part(image_server):
    assert_refused(f"{image_server}/missing.png", "HTTP 404", allow_remote_urls=True)
    size = len(encoded(sample()))
    limit = size + 100
    assert_refused(f"{image_server}/big", f"over {limit} bytes", allow_remote_urls=True, max_image_bytes=limit)


# -- bad input ---------------------------------------------------------------------------------------------


def test_corrupt_bytes_are_refused():
    data = bytearray(encoded(sample(size=(32, 32))))
    data[60:90] = b"\xff" * 30  # inside the compressed pixel data, past the header
    assert_refused(bytes(data), "corrupt")


def test_truncated_bytes_are_refused_though_the_header_reads():
    data = encoded(sample(size=(64, 64)))
    assert_refused(data[: len(data) // 2], "corrupt or truncated PNG image")


def test_truncated_jpeg_is_refused():
    data = encoded(sample(size=(64, 64)), "JPEG")
    assert_refused(data[: len(data) // 2], "corrupt or truncated JPEG image")


def test_a_pdf_is_an_unsupported_format():
    assert_refused(b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", "unsupported format: the data is a PDF")


def test_an_image_format_pillow_reads_but_patchbay_does_not_accept_is_unsupported():
    buffer = io.BytesIO()
    sample(size=(16, 16)).save(buffer, format="ICO")
    assert_refused(buffer.getvalue(), "unsupported format")


def test_random_bytes_are_an_unsupported_format():
    assert_refused(os.urandom(64), "unsupported format")


def test_empty_data_is_refused():
    assert_refused(b"", "empty")


def test_a_header_only_png_over_the_pixel_limit_is_refused_before_decoding():
    # 100000 x 100000 would be 30 GB decoded; the file is under 100 bytes and its header must be enough to refuse it.
    error = assert_refused(header_only_png(100_000, 100_000), "10000000000 pixels")
    assert "multimodal.max_image_pixels" in str(error)
    # under Pillow's own bomb limit, patchbay's is the one that refuses
    error = assert_refused(header_only_png(5000, 5000), "5000x5000 = 25000000 pixels; the limit is 16777216")


def test_the_pixel_limit_applies_to_every_source_kind():
    image = sample(size=(10, 10))
    for source in (image, pixels(image), encoded(image), data_url(encoded(image))):
        assert_refused(source, "100 pixels; the limit is 99", max_image_pixels=99)
    assert load_image(image, limits=limits(max_image_pixels=100), where=WHERE).size == (10, 10)


def test_bad_numpy_arrays_are_refused():
    assert_refused(np.zeros((2, 2, 2), np.uint8), "shape (2, 2, 2)")
    assert_refused(np.zeros((2,), np.uint8), "shape (2,)")
    assert_refused(np.zeros((2, 2), np.int64), "dtype int64")
    assert_refused(np.full((2, 2), 1.5, np.float32), "outside")
    assert_refused(np.full((2, 2), np.nan, np.float32), "outside")


def test_an_unknown_source_type_is_refused():
    assert_refused(12, "got int")


def test_a_missing_file_path_is_refused(tmp_path):
    assert_refused(str(tmp_path / "nope.png"), "cannot read image file")


def test_bad_data_urls_are_refused():
    assert_refused("data:image/png;base64", "needs a comma")
    assert_refused("data:text/plain;base64,aGVsbG8=", "not an image/* type")
    assert_refused("data:image/png,rawbytes", "must be base64-encoded")
    assert_refused("data:image/png;base64,@@@@", "not valid base64")
    assert_refused(data_url(b"%PDF-1.4 not an image"), "a PDF document")
    assert_refused(data_url(encoded(sample())), "multimodal.max_image_bytes", max_image_bytes=20)


def test_file_urls_are_refused_without_an_allowed_folder(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encoded(sample()))
    assert_refused(path.as_uri(), "file:// image URLs are refused; set multimodal.allowed_local_media_path")


def test_a_file_url_outside_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(encoded(sample()))
    assert_refused(outside.as_uri(), "is outside multimodal.allowed_local_media_path", allowed_local_media_path=allowed)


def test_path_traversal_out_of_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(encoded(sample()))
    for url in (f"file://{allowed}/../secret.png", f"file://{allowed}/%2e%2e/secret.png"):
        assert_refused(url, "is outside", allowed_local_media_path=allowed)


def test_a_symlink_escaping_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(encoded(sample()))
    (allowed / "innocent.png").symlink_to(tmp_path / "secret.png")
    (allowed / "dir").symlink_to(tmp_path)
    assert_refused((allowed / "innocent.png").as_uri(), "is outside", allowed_local_media_path=allowed)
    assert_refused((allowed / "dir" / "secret.png").as_uri(), "is outside", allowed_local_media_path=allowed)


def test_a_sibling_folder_sharing_the_allowed_prefix_is_outside(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    sibling = tmp_path / "media-private"
    sibling.mkdir()
    (sibling / "a.png").write_bytes(encoded(sample()))
    assert_refused((sibling / "a.png").as_uri(), "is outside", allowed_local_media_path=allowed)


def test_a_file_url_naming_another_host_or_a_missing_file_is_refused(tmp_path):
    assert_refused("file://example.com/etc/passwd", "not on 'example.com'", allowed_local_media_path=tmp_path)
    assert_refused((tmp_path / "none.png").as_uri(), "no image file at", allowed_local_media_path=tmp_path)


def test_other_url_schemes_are_refused():
    with pytest.raises(ImageInputError, match="not a data:, file:// or http"):
        load_image_url("ftp://example.com/a.png", limits=limits(), where=WHERE)


def test_the_allowed_folder_must_exist(tmp_path):
    with pytest.raises(ValueError, match="no folder at"):
        MultimodalSettings(allowed_local_media_path=tmp_path / "missing")


def test_the_count_limit_needs_a_positive_value():
    with pytest.raises(ValueError):
        MultimodalSettings(max_images_per_prompt=0)


def test_a_relative_file_url_path_is_refused(tmp_path):
    assert_refused("file:relative/a.png", "absolute path", allowed_local_media_path=tmp_path)


def test_messages_do_not_leak_file_contents(tmp_path):
    # A text file behind a file:// URL is refused by its format; the message quotes at most its first bytes.
    secret = tmp_path / "notes.txt"
    secret.write_bytes(b"password=hunter2 and much more text after it")
    error = assert_refused(secret.as_uri(), "unsupported format", allowed_local_media_path=tmp_path)
    assert "hunter2" not in str(error)


def test_paths_may_be_given_relative_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("here.png").write_bytes(encoded(sample()))
    assert load_image("here.png", limits=limits(), where=WHERE).size == (7, 5)
