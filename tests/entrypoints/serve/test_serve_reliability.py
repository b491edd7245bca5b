"""The server under hostile input (issue 30): uncompilable and slow grammars are 400s that fail alone, a
prompt list is counted before it is tokenized, and a mixed attack (a big body, hundreds of idle
connections, a huge grammar) leaves ``/health`` and normal requests answering."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

import httpx

from patchbay.contract.settings import load_settings
from serving import running_server

BIG_CHOICE = [f"value number {i} of the list" for i in range(8000)]
"""A ``choice`` xgrammar takes seconds to compile (about 4 s on one core)."""


def _settings(tiny_llama, *extra: str):
    return load_settings(
        None,
        overrides=[f"model.path={tiny_llama}", "cache.num_blocks=64", "runtime.threads=1", *extra],
    )


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_an_uncompilable_constraint_is_a_400_naming_the_field_not_a_500(tiny_llama):
    """Grammars as a denial of service: an uncompilable schema came back as a 500."""
    with running_server(_settings(tiny_llama)) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        bad_regex = client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 2, "structured_output": {"regex": "("}}
        )
        error = _assert_openai_error(bad_regex, 400)
        assert "cannot compile structured_output.regex" in error["message"] and "parenthesis" in error["message"]
        missing_ref = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
        for stream in (False, True):
            bad_schema = client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "stream": stream,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": missing_ref}},
                },
            )
            error = _assert_openai_error(bad_schema, 400)
            assert "cannot compile structured_output.json_schema" in error["message"]
        fine = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert fine.status_code == 200
        running.wait_until_idle()


def test_a_grammar_past_compile_timeout_is_a_400_and_the_next_grammar_compiles(tiny_llama):
    """Grammars as a denial of service: a long compile blocked every structured request behind it."""
    settings = _settings(tiny_llama, "structured_output.compile_timeout=0.3")
    with running_server(settings) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        slow = client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 2, "structured_output": {"choice": BIG_CHOICE}}
        )
        error = _assert_openai_error(slow, 400)
        assert "structured_output.compile_timeout=0.3 s" in error["message"]
        # The runaway compile still runs in the background; another constraint compiles and generates now.
        quick = client.post(
            "/v1/completions",
            json={"prompt": "a", "max_tokens": 3, "structured_output": {"choice": ["yes", "no"]}},
        )
        assert quick.status_code == 200, quick.text
        assert quick.json()["choices"][0]["text"] in ("yes", "no")
        running.wait_until_idle()


def test_a_list_of_200k_prompts_is_refused_before_any_is_tokenized(tiny_llama):
    """The server can be starved by one client: 200k tiny prompts were tokenized before admission refused them."""
    with running_server(_settings(tiny_llama)) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        encoded = []
        encode = running.llm.encode

        def counting_encode(prompt, *args, **kwargs):
            encoded.append(prompt)
            return encode(prompt, *args, **kwargs)

        running.llm.encode = counting_encode  # type: ignore[method-assign]
        refused = client.post("/v1/completions", json={"prompt": ["a"] * 200_000, "max_tokens": 1})
        error = _assert_openai_error(refused, 400)
        assert error["param"] == "n" and "200000 sequences can never be admitted" in error["message"]
        assert encoded == []
        answered = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert answered.status_code == 200 and encoded == ["a", "b"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_big_body_idle_connections_and_a_huge_grammar_at_once_leave_the_server_answering(tiny_llama):
    """The server can be starved by one client; grammars as a denial of service (the issue's load test):
    a 100 MB body (declared), 300 idle connections and a huge ``choice`` at once, over loopback."""
    settings = _settings(
        tiny_llama,
        "server.max_body_bytes=1048576",
        "server.idle_timeout=1",
        "server.header_timeout=1",
        "structured_output.compile_timeout=0.5",
    )
    with running_server(settings) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        address = (urlsplit(running.url).hostname, urlsplit(running.url).port)
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200  # warm
        rss_before = _rss_bytes()
        results: dict[str, object] = {}

        def idle_connections() -> None:
            sockets = [socket.create_connection(address, timeout=30) for _ in range(300)]
            closed = 0
            for sock in sockets:
                try:
                    closed += sock.recv(1024) == b""  # the server closed it (the socket timeout bounds the wait)
                except OSError:
                    pass
                finally:
                    sock.close()
            results["idle_closed"] = closed

        def big_body() -> None:
            sock = socket.create_connection(address, timeout=30)
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 << 20}\r\n\r\n"
            )
            sock.sendall(head.encode() + b"x" * (256 << 10))  # a quarter MB of the declared 100 MB
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            sock.close()
            results["big_body"] = answer.split(b"\r\n", 1)[0]

        def huge_grammar() -> None:
            with httpx.Client(base_url=running.url, timeout=60) as own:
                body = {"prompt": "a", "max_tokens": 2, "structured_output": {"choice": BIG_CHOICE}}
                results["grammar"] = own.post("/v1/completions", json=body)

        attackers = [threading.Thread(target=t) for t in (idle_connections, big_body, huge_grammar)]
        for thread in attackers:
            thread.start()
        answered = []
        while any(thread.is_alive() for thread in attackers) or len(answered) < 3:
            answered.append(client.get("/health").status_code)
            completion = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            answered.append(completion.status_code)
        for thread in attackers:
            thread.join(60)
        assert set(answered) == {200}, answered
        assert results["big_body"] == b"HTTP/1.1 413 Request Entity Too Large"
        assert results["idle_closed"] == 300
        grammar = results["grammar"]
        assert isinstance(grammar, httpx.Response)
        assert "structured_output.compile_timeout=0.5 s" in _assert_openai_error(grammar, 400)["message"]
        running.wait_until_idle()
        assert _rss_bytes() - rss_before < 512 << 20, "the attack grew the server by half a gigabyte or more"
