"""A run launched by ``torchrun``: what its environment says about this process, and the run's store.

``torchrun`` (``python -m torch.distributed.run``) starts one process per
rank, on one machine or several, and tells each its place through the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``: the env:// rendezvous).  patchbay then starts no ranks of
its own: rank 0 runs the engine, the others run the rank loop of
:mod:`patchbay.worker.parallel.rank_worker`, and all meet in a torch.distributed
store at ``runtime.master_addr``:``runtime.master_port`` (by default
torchrun's own, hosted by its agent on the first node).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun sets for each process it starts; all of them mean a torchrun launch."""


@dataclass(frozen=True)
class TorchrunLaunch:
    """This process's place in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Processes torchrun started on this machine."""
    master_addr: str
    master_port: int
    agent_store: bool
    """Whether torchrun's agent hosts the store at ``MASTER_ADDR:MASTER_PORT`` (else rank 0 must)."""
    attempt: int
    """torchrun's restart count: each attempt's keys in the store are its own."""


def torchrun_launch(environ: Mapping[str, str] = os.environ) -> TorchrunLaunch | None:
    """The launch ``environ`` describes; ``None`` when torchrun did not start this process."""
    if not all(name in environ for name in VARIABLES):
        return None
    try:
        return TorchrunLaunch(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            attempt=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    except ValueError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "<environment>",
                    "RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT",
                    f"torchrun's variables are not integers: {exc}",
                )
            ]
        ) from None


def check_world_size(settings: Settings, launch: TorchrunLaunch) -> None:
    """torchrun's ``WORLD_SIZE`` must be ``runtime.tensor_parallel_size`` x ``pipeline_parallel_size``: one
    process per rank."""
    runtime = settings.runtime
    size = runtime.world_size
    if launch.world_size != size:
        key = "runtime.pipeline_parallel_size" if runtime.pipeline_parallel_size > 1 else "runtime.tensor_parallel_size"
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    key,
                    f"torchrun started {launch.world_size} processes (WORLD_SIZE) and the run "
                    f"has {size} ranks (runtime.tensor_parallel_size {runtime.tensor_parallel_size}"
                    f" x runtime.pipeline_parallel_size {runtime.pipeline_parallel_size}); launch "
                    f"--nnodes x --nproc-per-node = {size} processes or change the settings",
                )
            ]
        )


def store_address(settings: Settings, launch: TorchrunLaunch) -> tuple[str, int]:
    """Where the run's store is: ``runtime.master_addr``/``master_port``, by default torchrun's."""
    runtime = settings.runtime
    return (
        runtime.master_addr or launch.master_addr,
        runtime.master_port if runtime.master_port is not None else launch.master_port,
    )


def rendezvous_store(settings: Settings, launch: TorchrunLaunch) -> dist.Store:
    """This rank's connection to the run's store (rank 0 hosts it unless torchrun's agent hosts it there)."""
    host, port = store_address(settings, launch)
    hosted_by_agent = launch.agent_store and (host, port) == (launch.master_addr, launch.master_port)
    store = dist.TCPStore(
        host,
        port,
        launch.world_size,
        is_master=launch.rank == 0 and not hosted_by_agent,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=settings.runtime.distributed_timeout),
    )
    return dist.PrefixStore(f"patchbay/attempt-{launch.attempt}", store)


def launch_device(device: torch.device, local_rank: int) -> torch.device:
    """A launched rank's device: the CPU, or the CUDA device numbered by its ``LOCAL_RANK`` on its machine."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device
