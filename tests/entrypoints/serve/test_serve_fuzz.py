"""Fuzzing the server (issue 30): generated request bodies, valid-ish and broken (wrong types, huge numbers,
nested junk, unicode), posted to the server in this process get only a 2xx, or a 4xx in OpenAI's error
shape; never a 500, and never a value silently coerced (a wrong-typed field is always a 400).

Examples are derandomized, so CI runs the same ones every time.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchbay.contract.settings import load_settings
from serving import running_server

MAX_MODEL_LEN = 64

FUZZ = settings(
    derandomize=True,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def client(tiny_llama):
    settings_ = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            f"model.max_model_len={MAX_MODEL_LEN}",
            "cache.num_blocks=64",
            "runtime.threads=1",
            "attention.name=torch_sdpa",
            "server.max_body_bytes=65536",
        ],
    )
    with running_server(settings_) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        yield http


text = st.text(max_size=12)  # hypothesis's text: any code point but lone surrogates
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), text, st.just("\ud800")
)
junk = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
)
"""Any JSON value (a lone surrogate among the strings), nested a few levels."""

# Per field: values of the right type (some of them out of range), and values of a wrong type that a lax
# parser would coerce ("3" or true for an integer, "0.5" for a number, "yes" or 1 for a boolean).
integers = st.integers(-(2**70), 2**70)
FIELDS = {
    "max_tokens": (st.one_of(st.integers(1, 4), integers), st.sampled_from(["3", True, 3.0, False, [2]])),
    "n": (st.integers(1, 2), st.sampled_from(["2", True, 2.0, {"n": 2}])),
    "seed": (st.one_of(st.integers(0, 2**31), integers), st.sampled_from(["1", True, 1.5, [1]])),
    "temperature": (st.one_of(st.floats(0, 2), st.integers(0, 2)), st.sampled_from(["0.5", True, [0.5], "inf"])),
    "top_p": (st.floats(0.01, 1), st.sampled_from(["1", True, {}])),
    "top_k": (st.integers(-1, 50), st.sampled_from(["5", True, 5.0])),
    "stream": (st.booleans(), st.sampled_from(["true", 1, "yes", 0])),
    "stop": (st.one_of(text, st.lists(text, max_size=2)), st.sampled_from([5, [1], True, ["a", 2]])),
    "logprobs": (st.integers(0, 3), st.sampled_from(["1", True, 1.0])),
    "ignore_eos": (st.booleans(), st.sampled_from(["yes", 1, "false"])),
    "presence_penalty": (st.floats(-2, 2), st.sampled_from(["0", False])),
    "stop_token_ids": (st.lists(st.integers(0, 100), max_size=2), st.sampled_from([[True], ["7"], [7.0], 7])),
}
prompts = st.one_of(
    text,
    st.lists(text, min_size=1, max_size=2),
    st.lists(st.integers(0, 1000), min_size=1, max_size=5),
)
bad_prompts = st.sampled_from([5, True, None, {"a": 1}, [True, 1], ["a", 1], [[1], "a"], "\ud800", [1.0]])


@st.composite
def bodies(draw):
    """A completions body and whether it holds a wrong-typed value (it must then be a 400)."""
    body = {}
    wrong = False
    body["prompt"] = draw(st.one_of(prompts, prompts, bad_prompts))
    if body["prompt"] in ([True, 1], ["a", 1], [[1], "a"], "\ud800", [1.0]) or not isinstance(
        body["prompt"], (str, list)
    ):
        wrong = True
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        good, bad = FIELDS[name]
        if draw(st.booleans()):
            body[name] = draw(bad)
            wrong = True
        else:
            body[name] = draw(good)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.sampled_from(["extra_junk", "nested", "ünïcode_kéy"]))] = draw(junk)
        wrong = True  # not a field anybody serves: a 400 naming it
    body.setdefault("max_tokens", 2)
    if isinstance(body["max_tokens"], int) and not isinstance(body["max_tokens"], bool) and body["max_tokens"] > 4:
        body["max_tokens"] = draw(st.sampled_from([5, 2**40]))  # short, or far past the context: a 400
    return body, wrong


def _post(client: httpx.Client, path: str, body: object) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as a client in another language would send it.
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _check_error_shape(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), body


def _check_answer(response: httpx.Response, body: dict) -> None:
    """A 2xx did what was asked: one choice per prompt and ``n``, at most ``max_tokens`` each, no error event."""
    prompt = body["prompt"]
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    expected = num_prompts * body.get("n", 1)
    if body.get("stream"):
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", response.text[-300:]
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in chunk for chunk in chunks), response.text[-500:]
        finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
        assert finished == set(range(expected))
        return
    answer = response.json()
    assert len(answer["choices"]) == expected
    assert {c["finish_reason"] for c in answer["choices"]} <= {"stop", "length"}
    assert answer["usage"]["completion_tokens"] <= expected * body["max_tokens"]


@FUZZ
@given(case=bodies())
def test_generated_completion_bodies_get_2xx_or_an_openai_shaped_4xx(client, case):
    body, wrong = case
    response = _post(client, "/v1/completions", body)
    assert response.status_code < 500, (body, response.text[:500])
    if response.status_code >= 400:
        assert 400 <= response.status_code < 500
        _check_error_shape(response)
        return
    assert not wrong, f"a wrong-typed value was coerced instead of refused: {body!r}"
    _check_answer(response, body)


raw_bodies = st.one_of(
    junk.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=64),
    st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@settings(FUZZ, max_examples=60)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
def test_broken_bodies_get_an_openai_shaped_400(client, raw, path):
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (raw, response.status_code, response.text[:300])
    _check_error_shape(response)


@settings(FUZZ, max_examples=60)
@given(
    messages=st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "tool", 3, None]), "content": junk}
            ),
            max_size=3,
        ),
        junk,
    ),
    extra=st.dictionaries(st.sampled_from(sorted(FIELDS)), junk, max_size=2),
)
def test_generated_chat_bodies_never_get_a_500(client, messages, extra):
    body = {"messages": messages, "max_tokens": 2, **extra}
    response = _post(client, "/v1/chat/completions", body)
    assert response.status_code < 500, (body, response.text[:500])
    if response.status_code >= 400:
        _check_error_shape(response)
