"""A real ``patchbay serve --data-parallel-size N`` (replicas behind vllm-router) in a subprocess, for the fleet
tests: where it listens, its replicas' addresses and process ids as its log says, and a clean stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from processes import clean_env, patchbay_command

READY = re.compile(r"patchbay serve: (\S+) on (http://\S+)/v1 through vllm-router \((.*)\)")
REPLICA_STARTED = re.compile(r"replica (\d+): pid (\d+) on cores \[([\d, ]*)\], (http://\S+)")


@dataclass
class RunningFleet:
    url: str
    """The router: ``http://127.0.0.1:PORT``."""
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)
    """Every line the fleet wrote to standard error so far (its replicas' and the router's too)."""

    def replicas(self) -> dict[int, tuple[int, str, list[int]]]:
        """Rank to (latest pid, URL, cores), from the log's start lines."""
        found = {}
        for line in list(self.log):
            match = REPLICA_STARTED.search(line)
            if match:
                cores = [int(core) for core in match[3].split(",") if core.strip()]
                found[int(match[1])] = (int(match[2]), match[4], cores)
        return found

    def replica_metrics(self, rank: int) -> dict[str, float]:
        """One replica's ``/metrics`` (asked directly, not through the router): sample line to value."""
        text = httpx.get(f"{self.replicas()[rank][1]}/metrics", timeout=10).text
        return dict(_samples(text))


def _samples(text: str) -> Iterator[tuple[str, float]]:
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            yield name, float(value)


def _pump(stream, log: list[str]) -> None:  # noqa: ANN001 - a text stream
    for line in stream:
        log.append(line.rstrip("\n"))


@contextlib.contextmanager
def running_fleet(config: Path, overrides: Sequence[str], *, timeout: float = 300) -> Iterator[RunningFleet]:
    """``patchbay serve CONFIG --set ...`` until the block exits (SIGTERM, then the exit status must be 0)."""
    command = [*patchbay_command(), "serve", str(config)]
    for override in overrides:
        command += ["--set", override]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True
    )
    log: list[str] = []
    threading.Thread(target=_pump, args=(process.stderr, log), daemon=True).start()
    deadline = time.monotonic() + timeout
    url = None
    assert process.stdout is not None
    while url is None:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"patchbay serve ended ({process.wait()}) before it served:\n" + "\n".join(log[-40:]))
        match = READY.search(line)
        if match:
            url = match[2]
        if time.monotonic() > deadline:
            raise RuntimeError("patchbay serve did not start in time:\n" + "\n".join(log[-40:]))
    threading.Thread(target=_pump, args=(process.stdout, log), daemon=True).start()
    fleet = RunningFleet(url, process, log)
    try:
        wait_for_router(fleet, len(fleet.replicas()))
        yield fleet
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert process.returncode == 0, "patchbay serve did not stop cleanly:\n" + "\n".join(log[-40:])


def wait_for_router(fleet: RunningFleet, replicas: int, timeout: float = 60) -> None:
    """Until the router answers ``/v1/models`` (it is up and has a healthy replica)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{fleet.url}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the router at {fleet.url} did not answer:\n" + "\n".join(fleet.log[-40:]))
