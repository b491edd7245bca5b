"""The server's limits (issue 30): request-body size, Host on loopback, no unauthenticated API docs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.serve.limits import BodyLimit, HostCheck, is_loopback


async def _echo_length(scope, receive, send):
    """A minimal ASGI app that reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
    )
    await send({"type": "http.response.body", "body": body})


def test_a_body_over_the_limit_gets_413_before_it_is_read_whole():
    """Issue 30: no request-body limit; one 100 MB body grew the server by gigabytes."""
    pulled = 0

    async def hundred_megabytes():
        nonlocal pulled
        for _ in range(100):
            pulled += 1
            yield b"x" * (1 << 20)

    async def run():
        transport = httpx.ASGITransport(app=BodyLimit(_echo_length, 4 << 20))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            streamed = await client.post("/v1/completions", content=hundred_megabytes())
            declared = await client.post("/v1/completions", content=b"y" * (5 << 20))
            small = await client.post("/v1/completions", content=b"z" * 1000)
        return streamed, declared, small

    streamed, declared, small = asyncio.run(run())
    for response in (streamed, declared):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert "server.max_body_bytes=4194304" in response.json()["error"]["message"]
    assert pulled <= 6  # the chunks past the limit were never read
    assert small.status_code == 200 and small.text == "1000"


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8000", True),
        ("localhost", True),
        ("[::1]:8000", True),
        ("LOCALHOST:1", True),
        ("attacker.example", False),
        ("attacker.example:8000", False),
        ("127.0.0.1.attacker.example", False),
        ("", False),
        ("proxy.internal:80", True),
    ],
)
def test_the_host_header_is_checked_on_loopback(host, allowed):
    """Issue 30: the Host header was not checked, so a DNS-rebound web page could call a keyless local server."""
    app = HostCheck(_echo_length, ["localhost", "127.0.0.1", "::1", "proxy.internal"])

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.get("/v1/models", headers={"host": host})

    response = asyncio.run(run())
    assert response.status_code == (200 if allowed else 400)
    if not allowed:
        assert response.json()["error"]["code"] == "host_not_allowed"


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")


def test_the_server_applies_its_limits_and_serves_no_docs(tiny_llama):
    """Issue 30: /docs, /redoc and /openapi.json answered without a key; bodies and Host went unchecked."""
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            "cache.num_blocks=64",
            "server.api_keys=a-key-for-tests",
            "server.max_body_bytes=65536",
        ],
    )
    with running_server(settings) as running, httpx.Client(base_url=running.url, timeout=30) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404
        assert client.get("/health").status_code == 200
        too_large = client.post(
            "/v1/completions",
            content=b"{" + b" " * 70000 + b"}",
            headers={"authorization": "Bearer a-key-for-tests", "content-type": "application/json"},
        )
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
        rebound = client.get("/health", headers={"host": "attacker.example"})
        assert rebound.status_code == 400 and "server.allowed_hosts" in rebound.json()["error"]["message"]


def test_api_keys_come_from_an_owner_only_key_file_or_the_environment(tmp_path, monkeypatch):
    """Issue 30: the docs' --set server.api_keys=... put the key on the command line, readable through ps."""
    from patchbay.contract.settings import ConfigError
    from patchbay.entrypoints.serve.keys import accepted_api_keys

    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\nsk-from-file-1\n\n  sk-from-file-2  \n")
    key_file.chmod(0o600)
    settings = load_settings(None, overrides=[f"server.api_key_file={key_file}", "server.api_keys=sk-inline"])
    assert accepted_api_keys(settings.server) == {"sk-inline", "sk-from-file-1", "sk-from-file-2"}
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match="server.api_key_file.*others may read it; chmod it to 0600"):
        accepted_api_keys(settings.server)
    missing = load_settings(None, overrides=[f"server.api_key_file={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match="server.api_key_file.*cannot read"):
        accepted_api_keys(missing.server)
    monkeypatch.setenv("PATCHBAY_SERVER__API_KEYS", "sk-env-1,sk-env-2")
    assert accepted_api_keys(load_settings(None).server) == {"sk-env-1", "sk-env-2"}


def test_bodies_that_are_not_json_get_400_in_openai_shape(tiny_llama):
    """Issue 30: deeply nested JSON got a 400 in FastAPI's ``{"detail": ...}`` shape.

    It must come in OpenAI's ``{"error": ...}`` shape instead.
    """
    settings = load_settings(None, overrides=[f"model.path={tiny_llama}", "cache.num_blocks=64"])
    bodies = [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "a", "max_tokens": ', b"\xff\xfe not json"]
    with running_server(settings) as running, httpx.Client(base_url=running.url, timeout=30) as client:
        for body in bodies:
            response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            assert set(response.json()) == {"error"} and response.json()["error"]["type"] == "invalid_request_error"
        unknown = client.get("/no/such/route")
        assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
        assert client.get("/health").status_code == 200


def test_connections_that_send_nothing_or_trickle_headers_are_closed(tiny_llama):
    """Issue 30: connections that sent nothing, or headers byte by byte, were never timed out."""
    import socket
    import time
    from urllib.parse import urlsplit

    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            "cache.num_blocks=64",
            "server.header_timeout=0.5",
            "server.idle_timeout=0.5",
        ],
    )
    with running_server(settings) as running:
        address = (urlsplit(running.url).hostname, urlsplit(running.url).port)
        silent = [socket.create_connection(address, timeout=20) for _ in range(5)]
        trickling = socket.create_connection(address, timeout=20)
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200:  # bounded: 200 bytes
            try:
                trickling.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        assert closed or trickling.recv(1024) == b""
        for connection in silent:
            assert connection.recv(1024) == b""  # closed by the server (the socket timeout bounds the wait)
            connection.close()
        trickling.close()
        with httpx.Client(base_url=running.url, timeout=30) as client:
            assert client.get("/health").status_code == 200  # a prompt client is served as before
