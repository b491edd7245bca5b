"""``patchbay serve`` with ``runtime.data_parallel_size`` N above 1: N replicas behind vLLM's router.

The process splits its cores among N replica processes (each pinned to its
share, its threads bound one per core), waits until every replica answers
``/health``, then starts ``vllm-router`` on ``server.host:server.port``.  It
then supervises: a replica that dies is taken out of the router's worker
list at once, started again, and put back once it answers ``/health``; a
router that dies is started again.  SIGTERM or SIGINT stops the router,
then lets each replica shut down gracefully (``server.shutdown_grace_period``).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.entrypoints.serve.command import bind
from patchbay.entrypoints.serve.fleet.cores import available_cores, pinned_environment, split_cores
from patchbay.entrypoints.serve.fleet.replicas import Replica, ReplicaSet
from patchbay.entrypoints.serve.fleet.router import RouterProcess, local_url, router_command, router_program

logger = logging.getLogger(__name__)

SUPERVISE_EVERY = 0.2
"""Seconds between two looks at the replicas and the router."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def sources_as_overrides(sources: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """Typed flags' settings sources as the replicas' ``--set`` overrides, values in YAML's flow form
    (``("--port 9000", {"server": {"port": 9000}})`` -> ``server.port=9000``)."""
    overrides = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            overrides.append(f"{prefix}={json.dumps(value, default=str)}")

    for _, nested in sources:
        walk("", nested)
    return overrides


def replica_overrides(settings: Settings, rank: int, port: int, cores: list[int]) -> list[str]:
    """The ``--set`` overrides that make replica ``rank`` of ``settings``: its rank, address and threads, and KV
    events on when the router reads them."""
    runtime = settings.runtime
    overrides = [
        f"runtime.data_parallel_rank={rank}",
        f"server.host={settings.router.replica_host}",
        f"server.port={port}",
    ]
    if runtime.threads is None and runtime.world_size == 1:
        overrides.append(f"runtime.threads={len(cores)}")
    if settings.router.policy == "kv_aware":
        overrides.append("kv_events.enable_kv_cache_events=true")
    if settings.router.prefill_replicas:
        role = "producer" if rank < settings.router.prefill_replicas else "consumer"
        overrides.append(f"kv_connector.role={role}")
    return overrides


def plan_replicas(settings: Settings, config: str | None, overrides: Sequence[str]) -> list[Replica]:
    """One :class:`Replica` per rank: its cores, port, command line and pinned environment (not started)."""
    size = settings.runtime.data_parallel_size
    router = settings.router
    if router.replica_ports and len(router.replica_ports) != size:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "router.replica_ports",
                    f"{len(router.replica_ports)} ports for runtime.data_parallel_size {size} replicas",
                )
            ]
        )
    if router.prefill_replicas and (router.prefill_replicas >= size or settings.kv_connector is None):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "router.prefill_replicas",
                    f"{router.prefill_replicas} prefill replicas of {size} need at least one decode replica and "
                    "a kv_connector: section whose store both reach",
                )
            ]
        )
    ports = list(router.replica_ports) or [free_port(router.replica_host) for _ in range(size)]
    processes = settings.runtime.world_size
    replicas = []
    for rank, cores in enumerate(split_cores(available_cores(), size)):
        command = [sys.executable, "-m", "patchbay.entrypoints.serve.fleet.replica", config or "default"]
        for override in [*overrides, *replica_overrides(settings, rank, ports[rank], cores)]:
            command += ["--set", override]
        replicas.append(
            Replica(rank, router.replica_host, ports[rank], cores, command, pinned_environment(cores, processes))
        )
    return replicas


def serve_fleet(
    settings: Settings, config: str | None, overrides: Sequence[str], *, stream: TextIO = sys.stdout
) -> int:
    """Run the replicas and the router until SIGTERM/SIGINT; the exit status of ``patchbay serve``."""
    from patchbay.entrypoints.serve.state import model_name_of

    logging.basicConfig(level=logging.INFO, format="patchbay serve: %(message)s")
    program = router_program(settings.router.executable)
    server = settings.server
    with bind(server.host, server.port) as probe:  # a clear error now, not the router's later
        port = int(probe.getsockname()[1])  # server.port, or a free one for port 0
    replicas = plan_replicas(settings, config, overrides)
    replica_set = ReplicaSet(replicas, settings.router.restart_delay)
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    router: RouterProcess | None = None
    try:
        replica_set.start()
        replica_set.wait_until_healthy(settings.router.startup_timeout)
        model_name = model_name_of(settings)
        command = router_command(settings, replicas, program, port, free_port(), model_name)
        router = RouterProcess(command, local_url(server.host, port))
        router.start()
        router.wait_until_listening(server.host, port)
        print(
            f"patchbay serve: {model_name} on http://{server.host}:{port}/v1 through vllm-router "
            f"({router_summary(settings, replicas)})",
            file=stream,
            flush=True,
        )
        while not stop.wait(SUPERVISE_EVERY):
            changes = replica_set.supervise_once()
            router.supervise_once()
            if not settings.router.prefill_replicas:  # in prefill/decode mode the health checks alone decide
                for replica in changes.died:
                    router.remove_worker(replica.url)
                for replica in changes.back:
                    router.add_worker(replica.url)
    except RuntimeError as exc:
        print(f"patchbay serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if router is not None:
            router.stop()
        replica_set.stop(settings.server.shutdown_grace_period + 10.0)
    print("patchbay serve: stopped", file=stream, flush=True)
    return 0


def router_summary(settings: Settings, replicas: Sequence[Replica]) -> str:
    """``policy cache_aware; replica 0 at http://127.0.0.1:8101 on cores [0], ...``"""
    parts = [f"replica {r.rank} at {r.url} on cores {r.cores}" for r in replicas]
    return f"policy {settings.router.policy}; " + ", ".join(parts)
