"""The replicas: one ``patchbay serve`` process each, pinned to its cores, started again when it dies.

A replica is ``python -m patchbay.entrypoints.serve.fleet.replica CONFIG --set ...``: the operator's file and
overrides, plus its rank, its port and its threads.  It inherits the environment (API keys given there reach
every replica) and writes its own output to this process's standard error.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

QUICK_DEATH = 60.0
"""A replica that dies within this many seconds of its start waits twice as long before the next start."""
LONGEST_DELAY = 60.0


@dataclass
class Replica:
    """One replica's process and where it serves."""

    rank: int
    host: str
    port: int
    cores: list[int]
    command: list[str]
    environment: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay: float = 1.0
    """Seconds before the next start after a death (grows after quick deaths)."""
    restart_at: float | None = None
    """When a dead replica starts again (``None``: it is running, or stopped for good)."""
    ever_healthy: bool = False
    awaiting_health: bool = False
    """Started again after a death and not yet answering ``/health``."""
    deaths: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Start the process, pinned to the replica's cores before it runs a line of Python."""
        cores = set(self.cores)

        def pin() -> None:  # runs in the child between fork and exec
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)

        self.process = subprocess.Popen(
            self.command,
            env={**os.environ, **self.environment},
            stdout=sys.stderr,
            stdin=subprocess.DEVNULL,
            preexec_fn=pin,
        )
        self.started_at = time.monotonic()
        self.restart_at = None
        logger.info("replica %d: pid %d on cores %s, %s", self.rank, self.process.pid, self.cores, self.url)

    def exit_description(self) -> str | None:
        """How the process ended (``None`` while it runs)."""
        if self.process is None:
            return "not started"
        status = self.process.poll()
        if status is None:
            return None
        if status < 0:
            return f"killed by signal {-status}"
        return f"exited with status {status}"

    def healthy(self, timeout: float = 2.0) -> bool:
        """``GET /health`` answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False


@dataclass
class ReplicaChanges:
    """What one look at the replicas found: those that died, and those started again that now serve."""

    died: list[Replica] = field(default_factory=list)
    back: list[Replica] = field(default_factory=list)


class ReplicaSet:
    """Starts the replicas, watches them, and starts each again after it dies (with a growing delay when it
    dies soon after starting)."""

    def __init__(self, replicas: list[Replica], restart_delay: float) -> None:
        self.replicas = replicas
        self.restart_delay = restart_delay
        for replica in replicas:
            replica.delay = restart_delay

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def wait_until_healthy(self, timeout: float) -> None:
        """Wait for every replica's ``/health``; a replica that dies first, or the timeout, raises ``RuntimeError``
        naming it."""
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while not replica.healthy():
                ended = replica.exit_description()
                if ended is not None:
                    raise RuntimeError(f"replica {replica.rank} ({replica.url}) {ended} before it served")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {replica.rank} ({replica.url}) did not answer /health in {timeout} s")
                time.sleep(0.2)
            replica.ever_healthy = True

    def supervise_once(self) -> ReplicaChanges:
        """Notice deaths and schedule restarts; start replicas whose restart is due; report the replicas that died
        and the restarted ones that answer ``/health`` again."""
        now = time.monotonic()
        changes = ReplicaChanges()
        for replica in self.replicas:
            if replica.restart_at is not None:
                if now >= replica.restart_at:
                    replica.restarts += 1
                    replica.start()
                    replica.awaiting_health = True
                continue
            ended = replica.exit_description()
            if ended is None:
                if replica.awaiting_health and replica.healthy(timeout=0.5):
                    replica.awaiting_health = False
                    logger.info("replica %d (%s) serves again", replica.rank, replica.url)
                    changes.back.append(replica)
                continue
            changes.died.append(replica)
            replica.awaiting_health = False
            lived = now - replica.started_at
            replica.delay = min(replica.delay * 2, LONGEST_DELAY) if lived < QUICK_DEATH else self.restart_delay
            replica.restart_at = now + replica.delay
            replica.deaths.append(ended)
            logger.error(
                "replica %d (pid %d, %s) %s after %.0f s; its requests in flight failed; starting it again in %.1f s",
                replica.rank,
                replica.process.pid if replica.process is not None else -1,
                replica.url,
                ended,
                lived,
                replica.delay,
            )
        return changes

    def stop(self, timeout: float) -> None:
        """SIGTERM every replica (each shuts down gracefully), then SIGKILL those still running after ``timeout``."""
        running = [r.process for r in self.replicas if r.process is not None and r.process.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for replica in self.replicas:
            replica.restart_at = None
