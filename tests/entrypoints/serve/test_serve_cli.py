"""``patchbay serve`` as a process: CONFIG and --set, MODEL (nothing, a directory, a .gguf file) with typed flags
answering the official openai client, and SIGTERM letting a request in flight finish before a clean exit."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from processes import clean_env, patchbay_command

import patchbay


def test_sigterm_finishes_the_stream_in_flight_refuses_new_ones_and_exits_cleanly(tiny_llama, tmp_path):
    config = tmp_path / "serve.yaml"
    # The reference attention backend needs no C++ kernel build, so the process starts fast.
    config.write_text(
        f"model: {{path: {tiny_llama}}}\ncache: {{num_blocks: 128}}\nattention: {{name: reference}}\n"
        "server: {port: 8123, shutdown_grace_period: 60}\n"
    )
    process = subprocess.Popen(
        [
            *patchbay_command(),
            "serve",
            str(config),
            "--set",
            "server.port=0",
            "--set",
            "server.served_model_name=tiny-cli",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        banner = process.stdout.readline()
        assert "tiny-cli on http://127.0.0.1:" in banner, (banner, process.stderr.read() if process.poll() else "")
        url = banner.split(" on ")[1].split("/v1")[0]
        assert not url.endswith(":0") and not url.endswith(":8123")
        assert httpx.get(f"{url}/ready").status_code == 200

        first_chunk = threading.Event()
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                timeout=60,
                json={
                    "model": "tiny-cli",
                    "prompt": "Hello",
                    "max_tokens": 120,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[len("data: ") :])
                        first_chunk.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(60)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{url}/health", timeout=5)
        client.join(60)
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(60) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- patchbay serve [MODEL] with typed flags ----------------------------------------------------------------


@contextlib.contextmanager
def serve_process(*args: str, **env: str) -> Iterator[str]:
    """``patchbay serve ARGS...`` in a subprocess (PATCHBAY_* from ``env``): its base URL while it runs, then
    SIGTERM and a clean exit."""
    process = subprocess.Popen(
        [*patchbay_command(), "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(**env),
    )
    try:
        banner = process.stdout.readline()
        if " on http://" not in banner:
            process.wait(60)
            raise AssertionError(f"patchbay serve {' '.join(args)} did not start: {banner}{process.stderr.read()}")
        yield banner.split(" on ")[1].split("/v1")[0]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def ask(url: str, model: str, api_key: str = "none") -> str:
    """One chat completion through the official openai client; its answer's text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    return reply.choices[0].message.content or ""


# Small KV pools (one request of the bundled model's 8192 tokens) through the environment, so the commands stay
# as a user types them.
SMALL_POOL = {"PATCHBAY_CACHE__NUM_BLOCKS": "640"}


@pytest.mark.slow
def test_serve_without_a_model_serves_the_bundled_one():
    with serve_process(PATCHBAY_SERVER__PORT="0", **SMALL_POOL) as url:
        ask(url, "SmolLM2-135M-Instruct")
        assert httpx.get(f"{url}/version").json() == {"version": patchbay.__version__}


def test_serve_a_model_directory_with_typed_flags(tiny_llama):
    with serve_process(
        str(tiny_llama),
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--api-key",
        "k",
        PATCHBAY_ATTENTION__NAME="reference",
        **SMALL_POOL,
    ) as url:
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 256)]
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ask(url, "tiny", api_key="k")


@pytest.mark.slow
def test_serve_a_gguf_file_with_port_name_and_context_flags():
    from patchbay.toolkit.model_files import bundled_gguf

    with socket.socket() as probe:  # a free port, named as a user would name one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serve_process(
        str(bundled_gguf()), "--port", str(port), "--served-model-name", "m", "--max-model-len", "4096", **SMALL_POOL
    ) as url:
        assert url == f"http://127.0.0.1:{port}"
        ask(url, "m")
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 4096


def test_serve_names_a_model_argument_that_is_no_model(tmp_path):
    result = subprocess.run(
        [*patchbay_command(), "serve", str(tmp_path)], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert result.returncode == 2
    assert f"MODEL {tmp_path}: model.path: a directory without config.json" in result.stderr
