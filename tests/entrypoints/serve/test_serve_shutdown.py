"""Shutting down ``patchbay serve`` (issue 30): past ``server.shutdown_grace_period`` streams end with an
``abort`` chunk and ``data: [DONE]``, non-streamed requests get a 503 in OpenAI's shape (not a plain-text
500 with ``CancelledError`` tracebacks); a second SIGTERM ends the grace period at once; SIGTERM then
SIGINT exits cleanly.  Each test runs a real ``patchbay serve`` process on the tiny model."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from processes import clean_env, patchbay_command

LONG = {"prompt": "Hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
"""A request that runs for seconds on the tiny model: still in flight when the signals come."""


@contextlib.contextmanager
def _serve(tiny_llama, tmp_path, grace: float) -> Iterator[tuple[subprocess.Popen, str]]:
    config = tmp_path / "serve.yaml"
    # The reference attention backend needs no C++ kernel build, so the process starts fast.
    config.write_text(
        f"model: {{path: {tiny_llama}}}\ncache: {{num_blocks: 128}}\nattention: {{name: reference}}\n"
        f"runtime: {{threads: 1}}\nserver: {{port: 0, shutdown_grace_period: {grace}}}\n"
    )
    process = subprocess.Popen(
        [*patchbay_command(), "serve", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        banner = process.stdout.readline()
        assert " on http://127.0.0.1:" in banner, (banner, process.stderr.read() if process.poll() else "")
        yield process, banner.split(" on ")[1].split("/v1")[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class _InFlight:
    """One streamed and one non-streamed long completion, each on its own thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lines: list[str] = []
        self.plain: httpx.Response | None = None
        self.first_chunk = threading.Event()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._plain)]
        for thread in self.threads:
            thread.start()

    def _stream(self) -> None:
        body = {**LONG, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[len("data: ") :])
                    self.first_chunk.set()

    def _plain(self) -> None:
        self.plain = httpx.post(f"{self.url}/v1/completions", json=LONG, timeout=120)

    def wait_until_running(self) -> None:
        assert self.first_chunk.wait(60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{self.url}/metrics", timeout=10).text
            running = next(line for line in metrics.splitlines() if line.startswith("patchbay_num_requests_running"))
            if float(running.rsplit(" ", 1)[1]) >= 2:
                return
            time.sleep(0.02)
        raise AssertionError("both requests never ran at once")

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)

    def check_aborted(self) -> None:
        """The stream ended with an ``abort`` chunk, then [DONE]; the plain request got a 503 in OpenAI's shape."""
        assert self.lines[-1] == "[DONE]"
        last = json.loads(self.lines[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert self.plain is not None and self.plain.status_code == 503, self.plain
        error = self.plain.json()["error"]
        assert error["code"] == "shutting_down" and "server.shutdown_grace_period" in error["message"]


def _exits_cleanly(process: subprocess.Popen) -> str:
    assert process.wait(60) == 0
    stderr = process.stderr.read()
    assert "Traceback" not in stderr and "CancelledError" not in stderr and "Exception in ASGI" not in stderr
    assert "stopped" in process.stdout.read()
    return stderr


def test_past_the_grace_period_clients_get_an_abort_in_openai_shape(tiny_llama, tmp_path):
    """Shutdown: streams were cut without a final chunk, non-streamed requests got a plain-text 500."""
    with _serve(tiny_llama, tmp_path, grace=0) as (process, url):
        in_flight = _InFlight(url)
        in_flight.wait_until_running()
        process.send_signal(signal.SIGTERM)
        in_flight.join()
        in_flight.check_aborted()
        _exits_cleanly(process)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_grace_period_at_once_and_the_exit_is_clean(tiny_llama, tmp_path, second):
    """Shutdown: a second SIGTERM did not force the exit; SIGTERM then SIGINT exited 1 after tracebacks."""
    with _serve(tiny_llama, tmp_path, grace=600) as (process, url):
        in_flight = _InFlight(url)
        in_flight.wait_until_running()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(second)
        in_flight.join()  # well within the 600 s grace period: the second signal ended it
        in_flight.check_aborted()
        stderr = _exits_cleanly(process)
        assert "cut short by a second" in stderr
