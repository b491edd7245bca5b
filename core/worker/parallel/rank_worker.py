"""A rank other than 0 (a tensor-parallel shard or a pipeline stage), as a process of its own.

Rank 0 (the engine's process) talks to it over a step channel
(:mod:`patchbay.worker.parallel.step_channel`): first a :class:`RankSetup` (settings
and what rank 0 resolved), then, once rank 0 has chosen them, the runner's
:class:`RunnerSpec`, then one pickled ``SchedulerOutput`` per step, and an
empty message when the run ends.  Each step runs ``execute_model`` exactly
as rank 0 does, so the forward pass's all-reduces (or the stages' sends and
receives) pair up and the persistent batches and seeded samplers stay
identical.  A tensor-parallel rank's outputs are dropped (rank 0's are the
run's); with pipeline stages, the last stage's first rank sends each step's
output to rank 0 (it is the only stage that samples) as soon as it has it.
Structured output needs no grammar here: each step carries the token
bitmask rows rank 0's matchers filled (``SchedulerOutput.grammar_bitmasks``),
which this rank applies to its logits as rank 0 does.
With a KV connector each rank runs its own worker side over its shard, and
the ranks exchange their transfer reports after each step
(:mod:`patchbay.worker.parallel.kv_transfers`): that, not this rank's output, is how
rank 0 learns of them.

Two launches reach :func:`run_rank`:

- ``python -m patchbay.worker.parallel.rank_worker FD RANK``, started by rank 0 on its
  machine, reading a pipe at file descriptor ``FD``;
- :func:`run_torchrun_rank`, when ``torchrun`` started ``patchbay run`` /
  ``patchbay serve`` as a rank other than 0: it connects to rank 0 over TCP.

The rank exits 0 when rank 0 ends the run, and 1 on any error, with a
traceback on stderr, or when its channel closes before the end (rank 0
died); a collective whose peer died raises at once, so a rank never
outlives the run.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import Settings
from patchbay.worker.parallel import distributed
from patchbay.worker.parallel.distributed import RankSetup
from patchbay.worker.cpu.caching_allocator import set_up_heap
from patchbay.worker.model.checkpoints import run_model_dir
from patchbay.worker.parallel.kv_transfers import RankTransferReports
from patchbay.worker.parallel.pipeline_parallel import last_stage_rank
from patchbay.worker.runner_build import (
    RunnerSpec,
    build_runner,
    kv_connector_worker,
    load_rank_model,
    rank_lora,
    shards_vocabulary,
)
from patchbay.worker.parallel.step_channel import connect_to_rank_0, pipe_end
from patchbay.worker.parallel.torchrun import TorchrunLaunch, launch_device, rendezvous_store

END_OF_RUN = b""
"""The message rank 0 sends when the run ends normally (any step is a non-empty pickle)."""


class RankZeroGoneError(RuntimeError):
    """Rank 0's step channel closed before it ended the run: rank 0 failed or died."""


def _receive(connection: Connection, rank: int) -> bytes:
    try:
        return connection.recv_bytes()
    except (EOFError, ConnectionResetError):
        raise RankZeroGoneError(
            f"tensor-parallel rank {rank}: rank 0 closed the step channel before ending the run "
            "(it failed or died; its own error says why)"
        ) from None


def run_rank(
    connection: Connection,
    rank: int,
    *,
    local_rank: int | None = None,
    model_dir: Path | None = None,
    store: dist.Store | None = None,
) -> None:
    """Build this rank's runner from what rank 0 sends, then run its steps until rank 0 ends the run.

    By default (rank 0 started this rank on its machine) the rank's device is
    counted from rank 0's, and the model directory and store are rank 0's;
    a rank launched apart gives its ``local_rank`` (its CUDA device number on
    its machine), its own ``model_dir`` and its connection to the ``store``.
    """
    setup: RankSetup = pickle.loads(_receive(connection, rank))
    settings = setup.settings
    threads = distributed.rank_threads(settings)
    if threads is not None:
        torch.set_num_threads(threads)
    set_up_heap(settings.runtime.cpu_allocator)
    device = (
        distributed.rank_device(torch.device(setup.device), rank)
        if local_rank is None
        else launch_device(torch.device(setup.device), local_rank)
    )
    group = distributed.RankGroup(setup, rank, device, store)
    try:
        torch.manual_seed(settings.runtime.seed)
        registry = registry_for(settings.plugins)
        loaded = load_rank_model(
            settings,
            registry,
            model_dir or setup.model_dir,
            dtype=setup.dtype,
            device=device,
            tuning=setup.tuning,
            rank=rank,
            all_reduce=group.all_reduce,
            all_gather=group.all_gather,
            link=group,
            shard_vocabulary=shards_vocabulary(settings, registry),
        )
        lora = rank_lora(loaded.model, settings, registry, device=device, dtype=setup.dtype, rank=rank)
        spec: RunnerSpec = pickle.loads(_receive(connection, rank))
        # With a connector every rank saves and loads its own shard, and joins its reports with the others' each step.
        kv_connector = kv_reports = None
        if spec.kv_connector is not None:
            kv_connector = kv_connector_worker(settings, registry, spec.kv_connector, rank)
            kv_reports = RankTransferReports(group, setup.world_size)
        runner = build_runner(
            loaded.model,
            settings,
            registry,
            spec,
            device=device,
            dtype=setup.dtype,
            kv_connector=kv_connector,
            kv_reports=kv_reports,
            rank=rank,
            lora=lora,
        )
        torch.manual_seed(settings.runtime.seed)  # as rank 0 does once built: the samplers start alike
        runtime = settings.runtime
        sends_outputs = runtime.pipeline_parallel_size > 1 and rank == last_stage_rank(
            runtime.pipeline_parallel_size, runtime.tensor_parallel_size
        )
        group.barrier()
        while (message := _receive(connection, rank)) != END_OF_RUN:
            scheduler_output = pickle.loads(message)
            output = runner.execute_model(scheduler_output)
            if sends_outputs and not scheduler_output.is_empty:
                group.send_object(output, 0)
    finally:
        group.close()


def run_torchrun_rank(settings: Settings, launch: TorchrunLaunch) -> None:
    """Rank ``launch.rank`` (not 0) of a torchrun launch: join rank 0 through the run's store and run its steps.

    The caller has checked the launch against the settings (``patchbay.worker.parallel.torchrun.check_world_size``).

    The model is the one ``model.path`` of this machine's ``settings`` names
    (each machine loads its own copy); the rest of the settings are rank 0's.
    """
    assert launch.rank != 0, "rank 0 runs the engine"
    logging.basicConfig(
        level=logging.WARNING, format=f"patchbay rank {launch.rank}: %(levelname)s %(name)s: %(message)s"
    )
    model_dir = run_model_dir(settings, registry_for(settings.plugins))
    store = rendezvous_store(settings, launch)
    with connect_to_rank_0(store, launch.rank) as connection:
        run_rank(connection, launch.rank, local_rank=launch.local_rank, model_dir=model_dir, store=store)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a rank that rank 0 started itself (see the module docstring)."""
    fd, rank = (int(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    logging.basicConfig(level=logging.WARNING, format=f"patchbay rank {rank}: %(levelname)s %(name)s: %(message)s")
    try:
        with pipe_end(fd) as connection:
            run_rank(connection, rank)
    except RankZeroGoneError as exc:
        sys.exit(f"patchbay: {exc}")


if __name__ == "__main__":
    main()
