"""A real ``patchbay serve`` server on a loopback port, in a background thread, for the serving tests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from patchbay.contract.registry import Registry
from patchbay.contract.settings import Settings
from patchbay.engine import AsyncLLM
from patchbay.entrypoints.serve.command import bind, make_server


@dataclass
class RunningServer:
    url: str
    """``http://127.0.0.1:PORT``"""
    llm: AsyncLLM

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed: sample name (with its labels, minus ``model_name``) to value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            values[name] = float(value)
        return values

    def wait_until_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits and no KV block is in use; the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if (
                values["patchbay_num_requests_running"] == 0
                and values["patchbay_num_requests_waiting"] == 0
                and values["patchbay_kv_cache_blocks_in_use"] == 0
            ):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not return to idle within {timeout} s: {values}")
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(settings: Settings, registry: Registry | None = None) -> Iterator[RunningServer]:
    """Serve ``settings`` on 127.0.0.1 (a free port) until the block exits (plugins from ``registry`` if given)."""
    llm = AsyncLLM(settings, registry=registry)
    server = make_server(llm, settings)
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", llm)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
