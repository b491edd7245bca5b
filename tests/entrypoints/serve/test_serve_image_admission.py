"""Images through ``patchbay serve`` never starve it (issue 57, items 8 and 9).

- Images are read and decoded on a pool of their own: eight image requests stuck decoding (as a FIFO once held
  its load forever) leave text requests answered, since tokenizing runs elsewhere.
- Admission counts what images hold once decoded (4 bytes a pixel, read from the headers): past
  ``multimodal.max_decoded_bytes_in_flight`` a request gets 503 before its images are decoded, one that never
  fits gets 400, and the bytes come back when requests end.
- Over HTTP an image part is an ``image_url``: ``{"type": "image", "image": PATH}`` (a Python caller's form)
  would read any path on the server.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mm_models import test_image
from serving import RunningServer, running_server

import patchbay.multimodal.images as images_module
from patchbay.contract.settings import load_settings

pytestmark = pytest.mark.slow

IMAGE = test_image(40, 32, seed=7)
DECODED_BYTES = 4 * 40 * 32


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(num_images: int, text: str = "What is this?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(IMAGE)}} for _ in range(num_images)]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 2}


def _settings(model_dir: Path, *extra: str):
    return load_settings(
        None,
        overrides=[
            f"model.path={model_dir}",
            "cache.num_blocks=128",
            "scheduler.max_num_seqs=16",
            "multimodal.max_images_per_prompt=4",
            "server.served_model_name=tiny-vl",
            *extra,
        ],
    )


class _HeldDecoding:
    """``decode_image`` held until released (a huge image, a stalled file): ``entered`` counts the calls held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        real = images_module.decode_image

        def held(data, *, limits, where):
            self.entered.release()
            self.release.wait(120)
            return real(data, limits=limits, where=where)

        monkeypatch.setattr(images_module, "decode_image", held)

    def wait_for(self, count: int) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=60), "the image was never decoded"


def _post_in_background(url: str, body: dict, answers: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=180)))
    thread.start()
    return thread


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl) -> Iterator[RunningServer]:
    with running_server(_settings(tiny_qwen2_vl)) as running:
        yield running


def test_images_stuck_decoding_never_hold_up_a_text_request(server, monkeypatch):
    held = _HeldDecoding(monkeypatch)
    url = f"{server.url}/v1/chat/completions"
    answers: list[httpx.Response] = []
    senders = [_post_in_background(url, _chat(1), answers) for _ in range(8)]
    try:
        held.wait_for(1)
        text = httpx.post(url, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=30)
        assert text.status_code == 200, text.text
    finally:
        held.release.set()
        for sender in senders:
            sender.join(180)
    assert [answer.status_code for answer in answers] == [200] * 8


def test_an_image_part_naming_a_server_path_is_refused(server, tmp_path):
    secret = tmp_path / "secret.png"
    IMAGE.save(secret)
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": str(secret)}, {"type": "text", "text": "?"}]}
        ],
        "max_tokens": 2,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages.0.content.0.image"


@pytest.fixture(scope="module")
def tight_server(tiny_qwen2_vl) -> Iterator[RunningServer]:
    budget = DECODED_BYTES + DECODED_BYTES // 2  # one request's image fits; two at once do not
    settings = _settings(tiny_qwen2_vl, f"multimodal.max_decoded_bytes_in_flight={budget}")
    with running_server(settings) as running:
        yield running


def test_admission_counts_decoded_image_bytes_before_decoding(tight_server, monkeypatch):
    url = f"{tight_server.url}/v1/chat/completions"
    never = httpx.post(url, json=_chat(2), timeout=60)
    assert never.status_code == 400 and "multimodal.max_decoded_bytes_in_flight" in never.text, never.text
    held = _HeldDecoding(monkeypatch)
    answers: list[httpx.Response] = []
    first = _post_in_background(url, _chat(1), answers)
    try:
        held.wait_for(1)
        busy = httpx.post(url, json=_chat(1), timeout=60)
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "images_busy"
    finally:
        held.release.set()
        first.join(180)
    assert answers[0].status_code == 200, answers[0].text
    again = httpx.post(url, json=_chat(1), timeout=120)  # the first request's bytes came back when it ended
    assert again.status_code == 200, again.text
