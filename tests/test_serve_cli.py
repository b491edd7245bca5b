"""``patchbay serve CONFIG`` as a process: --set works, SIGTERM lets a request in flight finish, then it exits."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import clean_env, patchbay_command


def test_sigterm_finishes_the_stream_in_flight_refuses_new_ones_and_exits_cleanly(tiny_llama, tmp_path):
    config = tmp_path / "serve.yaml"
    # The reference attention backend needs no C++ kernel build, so the process starts fast.
    config.write_text(
        f"model: {{path: {tiny_llama}}}\ncache: {{num_blocks: 128}}\nattention: {{backend: reference}}\n"
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
