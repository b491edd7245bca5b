"""vLLM's router in front of the replicas: its command line, and its process.

``vllm-router`` (Rust, from PyPI) proxies OpenAI's routes to the replicas
(``--worker-urls``), health-checks them (``GET /health``) and picks one per
request by ``router.policy``.  Its ``cache_aware`` and ``kv_aware`` policies
read a request's token ids from a replica's ``/v1/completions/render`` or
``/v1/chat/completions/render``; ``kv_aware`` also subscribes to each
replica's KV-cache events (``--kv-event-source URL=tcp://...``).  Retries are
off: a request in flight on a replica that dies fails, with the router's
error, instead of running again elsewhere.

The supervisor takes a dead replica out of the router's worker list
(``POST /remove_worker?url=``) and puts it back once it serves again
(``POST /add_worker?url=``), as a fresh worker.  Health checks alone
bring it back late: the router's circuit breaker keeps a worker whose
requests failed out for a minute.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.engine import offset_port
from patchbay.entrypoints.serve.fleet.replicas import Replica

logger = logging.getLogger(__name__)

QUICK_DEATH = 10.0
"""A router that exits within this many seconds of its start counts as failing to start."""


def router_program(executable: str) -> str:
    """The router's program: ``executable`` as a path, else beside this Python's interpreter, else on ``PATH``."""
    if os.sep in executable:
        if Path(executable).is_file():
            return executable
    else:
        beside = Path(sys.executable).parent / executable
        if beside.is_file():
            return str(beside)
        found = shutil.which(executable)
        if found:
            return found
    raise ConfigError(
        [
            ConfigProblem(
                "<run>",
                "router.executable",
                f"{executable!r} not found (pip install vllm-router, which ships it; or give its path)",
            )
        ]
    )


def router_command(
    settings: Settings, replicas: Sequence[Replica], program: str, port: int, metrics_port: int, model_name: str
) -> list[str]:
    """The router's command line: listen on ``server.host:port``, send to ``replicas`` by ``router.policy``."""
    router = settings.router
    server = settings.server
    command = [program, "--host", server.host, "--port", str(port), "--policy", router.policy]
    if router.prefill_replicas:
        command.append("--vllm-pd-disaggregation")
        for replica in replicas[: router.prefill_replicas]:
            command += ["--prefill", replica.url]
        for replica in replicas[router.prefill_replicas :]:
            command += ["--decode", replica.url]
    else:
        command += ["--worker-urls", *(replica.url for replica in replicas)]
    command += [
        "--health-check-endpoint",
        "/health",
        "--health-check-interval-secs",
        str(router.health_check_interval),
        "--health-check-timeout-secs",
        str(max(1, router.health_check_interval)),
        "--health-failure-threshold",
        "1",
        "--health-success-threshold",
        "1",
        "--worker-startup-check-interval",
        "1",
        "--disable-retries",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--max-payload-size",
        str(server.max_body_bytes),
    ]
    if router.policy == "kv_aware" and router.prefill_replicas:  # the prefill side picks by KV events
        for replica in replicas[: router.prefill_replicas]:
            command += ["--pd-kv-events", f"{replica.url}={offset_port(settings.kv_events.endpoint, replica.rank)}"]
    elif router.policy == "kv_aware":
        for replica in replicas:
            endpoint = offset_port(settings.kv_events.endpoint, replica.rank)
            command += ["--kv-event-source", f"{replica.url}={endpoint}"]
        command += ["--kv-event-block-size", str(settings.cache.block_size), "--kv-event-model", model_name]
    return [*command, *router.extra_args]


def reachable_host(host: str) -> str:
    """Where this machine reaches a server listening on ``host``: loopback for a wildcard, else ``host``
    (``[...]`` is not added)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def local_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` of a server listening on ``host`` as this machine reaches it."""
    reached = reachable_host(host)
    return f"http://[{reached}]:{port}" if ":" in reached else f"http://{reached}:{port}"


class RouterProcess:
    """The router's process; started again (same command) if it dies.

    ``admin_url`` is where it listens (``http://127.0.0.1:PORT``), for its worker-list routes.
    """

    def __init__(self, command: list[str], admin_url: str) -> None:
        self.command = command
        self.admin_url = admin_url
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.quick_deaths = 0
        self.started_at = 0.0

    def start(self) -> None:
        """Start the router's process."""
        self.process = subprocess.Popen(self.command, stdout=sys.stderr, stdin=subprocess.DEVNULL)
        self.started_at = time.monotonic()
        logger.info("router: pid %d: %s", self.process.pid, " ".join(self.command))

    def wait_until_listening(self, host: str, port: int, timeout: float = 60.0) -> None:
        """Wait until the router accepts connections; ``RuntimeError`` if it exits first or takes too long."""
        deadline = time.monotonic() + timeout
        host = reachable_host(host)
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with status {self.process.returncode} before it listened")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm-router did not listen on {host}:{port} within {timeout} s") from None
                time.sleep(0.1)

    def supervise_once(self) -> None:
        """Start the router again if it died; ``RuntimeError`` once it died within seconds of 3 starts in a row."""
        if self.process is None or self.process.poll() is None:
            return
        status = self.process.returncode
        self.quick_deaths = self.quick_deaths + 1 if time.monotonic() - self.started_at < QUICK_DEATH else 0
        if self.quick_deaths >= 3:
            raise RuntimeError(f"vllm-router keeps exiting (status {status}) right after it starts; see its output")
        logger.error("router (pid %d) exited with status %s; starting it again", self.process.pid, status)
        self.restarts += 1
        self.start()

    def remove_worker(self, url: str) -> bool:
        """Stop sending to the replica at ``url`` now (its prefix-tree entries and circuit breaker go too)."""
        return self._worker_call("remove_worker", url)

    def add_worker(self, url: str) -> bool:
        """Send to the replica at ``url`` again, as a fresh worker (it must answer ``/health`` already)."""
        return self._worker_call("add_worker", url)

    def _worker_call(self, route: str, url: str, timeout: float = 30.0) -> bool:
        """``POST /{route}?url=...``; a failure is logged (the router's health checks still apply), not raised."""
        request = urllib.request.Request(
            f"{self.admin_url}/{route}?{urllib.parse.urlencode({'url': url})}", data=b"", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                ok = 200 <= response.status < 300
                detail = response.read(500).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            ok, detail = False, f"{exc.code} {exc.read(500).decode(errors='replace')}"
        except OSError as exc:
            ok, detail = False, str(exc)
        if ok:
            logger.info("router: %s %s", route, url)
        else:
            logger.error("router: %s %s failed (%s); its health checks decide instead", route, url, detail.strip())
        return ok

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router, SIGKILL it after ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
