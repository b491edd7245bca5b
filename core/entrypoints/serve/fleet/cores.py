"""Which cores each replica runs on, and the environment that keeps its threads there."""

from __future__ import annotations

import os

from patchbay.contract.settings import ConfigError, ConfigProblem


def available_cores() -> list[int]:
    """The cores this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(cores: list[int], replicas: int) -> list[list[int]]:
    """``cores`` in ``replicas`` disjoint runs, the first ones one core longer when they do not divide evenly:
    ``[0, 1, 2, 3, 4]`` over 2 replicas -> ``[[0, 1, 2], [3, 4]]``.  Fewer cores than replicas is an error."""
    if replicas > len(cores):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "runtime.data_parallel_size",
                    f"{replicas} replicas need a core each; this process may run on {len(cores)} ({cores})",
                )
            ]
        )
    share, extra = divmod(len(cores), replicas)
    runs, start = [], 0
    for replica in range(replicas):
        size = share + (1 if replica < extra else 0)
        runs.append(cores[start : start + size])
        start += size
    return runs


def pinned_environment(cores: list[int], processes: int) -> dict[str, str]:
    """OpenMP settings for a replica pinned to ``cores`` and made of ``processes`` processes (its tensor-parallel
    ranks and pipeline stages): alone, each of its threads is bound to one of the cores (``OMP_PLACES={2},{3}``,
    ``OMP_PROC_BIND=close``); with several processes they share the cores and only the thread count is set."""
    threads = max(1, len(cores) // processes)
    environment = {"OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        environment["OMP_PLACES"] = ",".join(f"{{{core}}}" for core in cores)
        environment["OMP_PROC_BIND"] = "close"
    return environment
