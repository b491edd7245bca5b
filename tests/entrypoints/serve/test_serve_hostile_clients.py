"""A hostile client against a real server (issue 57, items 7, 11, 12 and 14).

- Stored responses belong to the API key that made them: another key neither reads nor continues them, and
  they are bounded in bytes per key; ``metadata`` is held to OpenAI's bounds.
- A body trickled a byte at a time loses its connection once it falls behind ``server.min_body_rate``.
- Text no tokenizer can take (a lone surrogate) anywhere in a body, and a content part that is no object, are
  400s naming the field, never 500s.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.chat import BUNDLED_TOOLS_TEMPLATE

KEYS = ("sk-tenant-a", "sk-tenant-b")


@pytest.fixture(scope="module")
def server(tiny_llama):
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            f"chat.template={BUNDLED_TOOLS_TEMPLATE}",
            "cache.num_blocks=256",
            "model.max_model_len=2048",
            "server.served_model_name=m",
            f"server.api_keys={','.join(KEYS)}",
            "server.header_timeout=1",
            "server.min_body_rate=1024",
        ],
    )
    with running_server(settings) as running:
        yield running


def _post(server, path: str, body: dict, key: str = KEYS[0], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


# -- item 7: stored responses belong to their key ------------------------------------------------------------


def test_a_stored_response_is_read_and_continued_by_its_own_key_only(server):
    made = _post(server, "/v1/responses", {"input": "Say hi", "max_output_tokens": 3})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    mine = httpx.get(
        f"{server.url}/v1/responses/{response_id}", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30
    )
    assert mine.status_code == 200 and mine.json()["id"] == response_id
    theirs = httpx.get(
        f"{server.url}/v1/responses/{response_id}", headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=30
    )
    assert theirs.status_code == 404, theirs.text
    continued = _post(
        server,
        "/v1/responses",
        {"input": "And again", "previous_response_id": response_id, "max_output_tokens": 2},
        key=KEYS[1],
    )
    assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"


def test_stored_responses_are_bounded_in_bytes_per_key():
    from patchbay.entrypoints.serve.response_routes import StoredResponses

    store = StoredResponses(capacity=100, max_bytes=1000)
    for index in range(5):
        store.for_owner("a").keep({"id": f"a{index}"}, [], 300)
    store.for_owner("b").keep({"id": "b0"}, [], 300)
    kept = [f"a{index}" for index in range(5) if _kept(store, "a", f"a{index}")]
    assert kept == ["a2", "a3", "a4"], "the oldest were not dropped past the byte bound"
    assert _kept(store, "b", "b0"), "one key's flood dropped another key's response"
    store.for_owner("a").keep({"id": "huge"}, [], 5000)
    assert not _kept(store, "a", "huge") and _kept(store, "a", "a4")


def _kept(store, owner: str, response_id: str) -> bool:
    try:
        store.get(owner, response_id, "response_id")
        return True
    except Exception:  # noqa: BLE001 - the 404
        return False


def test_metadata_is_held_to_openai_s_bounds(server):
    many = _post(server, "/v1/responses", {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}})
    assert _error(many)["param"] == "metadata"
    long_value = _post(server, "/v1/responses", {"input": "hi", "metadata": {"note": "x" * 513}})
    assert _error(long_value)["param"] == "metadata"


# -- item 11: a body trickled a byte at a time -----------------------------------------------------------------


def test_a_trickled_body_loses_its_connection(server):
    host, port = server.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 1000\r\n\r\n"
        )
        closed = False
        while time.monotonic() - started < 20:
            try:
                connection.sendall(b" ")
                connection.settimeout(0.5)
                if connection.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
    assert closed, "the server kept a connection whose body came a byte every half second"
    assert time.monotonic() - started < 10
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


# -- item 14: client errors are 400s --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": "a \ud800 b"}, "input"),
        ("/v1/responses", {"input": "hi", "instructions": "be \udc00 brief"}, "instructions"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x\ud83d"}]}]},
            "input.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "description": "odd \ud800"}}],
            },
            "tools.0.function.description",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "text"],
                    }
                ]
            },
            "input.0.content.1.type",
        ),
    ],
    ids=["input", "instructions", "input_text", "tool-description", "non-object-part"],
)
def test_bad_text_and_parts_are_400s_naming_the_field(server, path, body, param):
    raw = json.dumps(body)  # ensure_ascii: lone surrogates travel as JSON escapes, as a hostile client sends them
    response = httpx.post(
        f"{server.url}{path}",
        content=raw,
        headers={"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert _error(response)["param"] == param
