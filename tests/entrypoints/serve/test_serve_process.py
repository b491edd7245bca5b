"""``patchbay serve`` as a process (issue 57, items 12 and 15).

- The port listens only once the model is loaded, and a SIGTERM while it loads stops the start cleanly (exit
  status 0) instead of killing the process by the signal with connections accepted and then reset.
- A 400k-item ``/v1/responses`` input (24 MB) is parsed and read off the event loop, in pieces, and the
  collector's passes skip the server's own heap: ``/health`` answers within a second throughout.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from processes import clean_env, patchbay_command


def _config(tiny_llama: Path, tmp_path: Path) -> Path:
    config = tmp_path / "serve.yaml"
    # The reference attention backend needs no C++ kernel build, so the process starts fast.
    config.write_text(
        f"model: {{path: {tiny_llama}}}\ncache: {{num_blocks: 128}}\nattention: {{name: reference}}\n"
        "runtime: {threads: 1}\nserver: {served_model_name: m}\n"
    )
    return config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _lines(stream) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


@contextlib.contextmanager
def _process(tiny_llama: Path, tmp_path: Path, port: int) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(
        [*patchbay_command(), "serve", str(_config(tiny_llama, tmp_path)), "--set", f"server.port={port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_port_opens_after_the_model_loads_and_sigterm_while_loading_exits_cleanly(tiny_llama, tmp_path):
    port = _free_port()
    with _process(tiny_llama, tmp_path, port) as process:
        errors = _lines(process.stderr)
        accepted_while_loading = False
        loading = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and not loading:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                accepted_while_loading = True  # the banner is not out yet: the model is still loading
                break
            except OSError:
                pass
            with contextlib.suppress(queue.Empty):
                loading = "loading" in errors.get(timeout=0.02)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    assert not accepted_while_loading, "the port accepted a connection before the model was loaded"
    assert process.returncode == 0, f"exit status {process.returncode}: {output}"
    assert "SIGTERM while starting; stopped before serving" in output, output


def test_a_400k_item_input_does_not_stall_health(tiny_llama, tmp_path):
    port = _free_port()
    with _process(tiny_llama, tmp_path, port) as process:
        banner = process.stdout.readline()
        assert " on http://127.0.0.1:" in banner, (banner, process.stderr.read() if process.poll() else "")
        url = f"http://127.0.0.1:{port}"
        items = [{"type": "message", "role": "user", "content": "hello there"} for _ in range(400_000)]
        body = json.dumps({"input": items, "max_output_tokens": 1}).encode()
        answers: list[httpx.Response] = []
        done = threading.Event()

        def send() -> None:
            try:
                headers = {"Content-Type": "application/json"}
                answers.append(httpx.post(f"{url}/v1/responses", content=body, headers=headers, timeout=300))
            finally:
                done.set()

        sender = threading.Thread(target=send)
        sender.start()
        answered_while_reading = 0
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set():
                assert client.get("/health").status_code == 200
                answered_while_reading += not done.is_set()
                time.sleep(0.05)
        sender.join()
    assert answers and answers[0].status_code == 400, answers  # far past the model's context
    assert answers[0].json()["error"]["code"] == "context_length_exceeded"
    # Not a timing: a server that read the input on its event loop would answer no /health until it was done.
    assert answered_while_reading >= 3, f"/health answered {answered_while_reading} times while the input was read"
