"""``file://`` images opened safely (issue 57, items 5, 6, 8 and 14): no check-then-open race a swapped-in link
can win, errors that say nothing about the disk outside the media folder, a FIFO refused at once instead of
blocking its thread forever, and a NUL byte in the URL a clear error."""

from __future__ import annotations

import builtins
import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from patchbay.contract.settings import MultimodalSettings
from patchbay.multimodal.images import ImageInputError, load_image_url

WHERE = "messages.0.content.1.image_url"


def _png(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def media(tmp_path: Path) -> tuple[Path, Path]:
    """``(allowed folder, a private image outside it)``; the setting names the folder through a link, as a
    deployment often does, so its real path is something a client must not learn."""
    real = tmp_path / "real-media"
    real.mkdir()
    allowed = tmp_path / "media"
    allowed.symlink_to(real, target_is_directory=True)
    (real / "cat.png").write_bytes(_png((10, 200, 30)))
    secret = tmp_path / "private.png"
    secret.write_bytes(_png((255, 0, 0)))
    return allowed, secret


def _limits(allowed: Path) -> MultimodalSettings:
    return MultimodalSettings(allowed_local_media_path=allowed)


def test_a_link_swapped_in_between_the_check_and_the_open_is_not_followed_out(media, monkeypatch):
    """A local process replaces the image with a link to a private file at the worst moment: just before the file
    is opened (after any check of its name).  The read must not follow it out of the folder."""
    allowed, secret = media
    victim = allowed / "swap.png"
    victim.write_bytes(_png((0, 0, 255)))
    swapped = threading.Event()

    def swap(path: object) -> None:
        if not swapped.is_set() and str(path).endswith("swap.png"):
            swapped.set()
            victim.unlink()
            victim.symlink_to(secret)

    real_open, real_os_open = builtins.open, os.open

    def open_after_swap(file, *args, **kwargs):
        swap(file)
        return real_open(file, *args, **kwargs)

    def os_open_after_swap(path, *args, **kwargs):
        swap(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_after_swap)
    monkeypatch.setattr(os, "open", os_open_after_swap)
    try:
        image = load_image_url(victim.as_uri(), limits=_limits(allowed), where=WHERE)
    except ImageInputError as exc:
        assert "is outside multimodal.allowed_local_media_path" in str(exc)
    else:
        assert not np.array_equal(np.asarray(image), np.asarray(Image.open(secret).convert("RGB"))), (
            "the private file outside the folder was read"
        )
    assert swapped.is_set(), "the swap never happened, so this test proved nothing"


def test_file_url_errors_say_nothing_about_the_disk_outside_the_folder(media):
    allowed, secret = media
    messages = []
    for target in (secret, secret.with_name("missing.png"), secret.parent / "media" / ".." / "private.png"):
        with pytest.raises(ImageInputError) as caught:
            load_image_url(f"file://{target}", limits=_limits(allowed), where=WHERE)
        messages.append(str(caught.value).replace(str(target), "PATH"))
    assert messages[0] == messages[1], "an existing and a missing file outside the folder must read alike"
    for message in messages:
        assert "real-media" not in message, f"the folder's real path leaked: {message}"
    inside = load_image_url((allowed / "cat.png").as_uri(), limits=_limits(allowed), where=WHERE)
    assert inside.getpixel((0, 0)) == (10, 200, 30)


def test_a_fifo_in_the_media_folder_is_refused_at_once(media):
    allowed, _ = media
    fifo = allowed / "pipe.png"
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []
    loader = threading.Thread(
        target=lambda: outcome.append(
            _attempt(lambda: load_image_url(fifo.as_uri(), limits=_limits(allowed), where=WHERE))
        )
    )
    loader.start()
    loader.join(10)
    if loader.is_alive():  # blocked opening the FIFO: let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        loader.join(10)
        pytest.fail("loading a FIFO blocked its thread")
    assert isinstance(outcome[0], ImageInputError) and "not a regular file" in str(outcome[0]), outcome


def _attempt(call):
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        return exc


def test_a_nul_byte_in_a_file_url_is_a_clear_error(media):
    allowed, _ = media
    with pytest.raises(ImageInputError, match="must not hold a NUL character"):
        load_image_url(f"file://{allowed}/cat%00.png", limits=_limits(allowed), where=WHERE)
