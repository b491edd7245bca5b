"""The server's request bodies are strict (issue 30): no coerced values, no 500 for a malformed field.

Findings: token ids given as booleans and ``n``/``seed``/``max_tokens`` as
strings or booleans were silently coerced; ``response_format.json_schema``
given as a string and a lone surrogate in a prompt were 500s; prompts were
tokenized on the event loop, so one huge prompt stalled every client.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hello", "max_tokens": 2}
LONE_SURROGATE = "a \ud800 b"  # json.dumps writes it as "\\ud800", as a hostile client would send it


@pytest.fixture(scope="module")
def server(tiny_llama):
    settings = load_settings(None, overrides=[f"model.path={tiny_llama}", "cache.num_blocks=64"])
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": [1, True]}, "prompt", "token ids must be integers, got bool"),
        ("/v1/completions", {**COMPLETION, "prompt": [[5, 6], [False]]}, "prompt", "item 1.0: token ids must be"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, "2"]}, "prompt", "token ids must be integers, got str"),
        ("/v1/completions", {**COMPLETION, "n": "2"}, "n", "valid integer"),
        ("/v1/completions", {**COMPLETION, "n": True}, "n", "valid integer"),
        ("/v1/completions", {**COMPLETION, "seed": "7"}, "seed", "valid integer"),
        ("/v1/completions", {**COMPLETION, "seed": False}, "seed", "valid integer"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "2"}, "max_tokens", "valid integer"),
        ("/v1/completions", {**COMPLETION, "max_tokens": True}, "max_tokens", "valid integer"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens", "valid integer"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "3"}, "max_completion_tokens", "valid integer"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": "{}"}},
            "response_format.json_schema",
            "an object with a 'schema' is required, got str",
        ),
        ("/v1/completions", {**COMPLETION, "prompt": LONE_SURROGATE}, "prompt", "lone surrogate"),
        ("/v1/completions", {**COMPLETION, "prompt": ["fine", LONE_SURROGATE]}, "prompt", "item 1: holds a lone"),
        ("/v1/completions", {**COMPLETION, "stop": [LONE_SURROGATE]}, "stop", "lone surrogate"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": LONE_SURROGATE}]},
            "messages.0.content",
            "lone surrogate",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]},
            "messages.0.content",
            "lone surrogate",
        ),
        ("/tokenize", {"prompt": LONE_SURROGATE}, "prompt", "lone surrogate"),
        ("/detokenize", {"tokens": [1, True]}, "tokens.1", "valid integer"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it_not_coerced_nor_a_500(client, path, body, param, message):
    """Issue 30 findings: coerced booleans and strings; 500s for a string json_schema and a lone surrogate."""
    response = _post(client, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]


def test_well_typed_bodies_still_run(client):
    body = {**COMPLETION, "prompt": [[5, 6], [7]], "n": 1, "seed": 3}
    assert _post(client, "/v1/completions", body).status_code == 200
    assert _post(client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 2}).status_code == 200


def test_logprobs_of_tokens_a_constraint_forbids_are_finite_json_not_a_500(client):
    # Where a choice's grammar forces the next token, every other token's logprob is -inf, which JSON cannot
    # carry: it is sent as -9999.0, as OpenAI and vLLM send it.
    body = {"structured_output": {"choice": ["yes", "no"]}, "max_tokens": 4}
    chat = _post(client, "/v1/chat/completions", {**CHAT, **body, "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    positions = chat.json()["choices"][0]["logprobs"]["content"]
    assert -9999.0 in [entry["logprob"] for position in positions for entry in position["top_logprobs"]]
    completion = _post(client, "/v1/completions", {**COMPLETION, **body, "logprobs": 2})
    assert completion.status_code == 200, completion.text
    top = completion.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert -9999.0 in [value for position in top for value in position.values()]


def test_a_prompt_being_tokenized_does_not_stall_health(server, client, monkeypatch):
    """Issue 30 finding: prompts were tokenized on the event loop; one huge prompt stalled even /health."""
    llm = server.llm
    tokenizing, release = threading.Event(), threading.Event()
    real_encode = llm.encode

    def slow_encode(prompt):
        tokenizing.set()
        release.wait(30)  # stands for a huge prompt's tokenization
        return real_encode(prompt)

    monkeypatch.setattr(llm, "encode", slow_encode)
    responses = []
    worker = threading.Thread(target=lambda: responses.append(_post(client, "/v1/completions", COMPLETION)))
    worker.start()
    try:
        assert tokenizing.wait(30)
        with httpx.Client(base_url=server.url, timeout=10) as other:
            assert other.get("/health").status_code == 200  # times out when the loop is busy tokenizing
    finally:
        release.set()
        worker.join(60)
    assert responses and responses[0].status_code == 200
