"""A rank other than 0 (a tensor-parallel shard or a pipeline stage), as a process of its own.

``python -m patchbay.worker.rank_worker FD RANK``.

The engine's process (rank 0) starts one per rank and talks to it over the
read end of a pipe, file descriptor ``FD``: first a :class:`RankSetup`
(settings and what rank 0 resolved), then, once rank 0 has chosen them, the
runner's :class:`RunnerSpec`, then one pickled ``SchedulerOutput`` per
step.  Each step runs ``execute_model`` exactly as rank 0 does, so the
forward pass's all-reduces (or the stages' sends, receives and broadcast)
pair up and the persistent batches and seeded samplers stay identical; the
outputs are dropped (rank 0's are the run's).

The rank ends when the pipe closes (rank 0 finished or died: end of file),
and on any error, with a traceback on stderr and exit status 1; a
collective whose peer died raises at once, so a rank never outlives the run.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from multiprocessing.connection import Connection

import torch

from patchbay.contract.registry import registry_for
from patchbay.worker import distributed
from patchbay.worker.distributed import RankSetup
from patchbay.worker.runner_build import RunnerSpec, build_runner, load_rank_model


def run_rank(connection: Connection, rank: int) -> None:
    """Build this rank's runner from what rank 0 sends, then run its steps until the pipe closes."""
    setup: RankSetup = connection.recv()
    settings = setup.settings
    threads = distributed.rank_threads(settings)
    if threads is not None:
        torch.set_num_threads(threads)
    device = distributed.rank_device(torch.device(setup.device), rank)
    group = distributed.RankGroup(setup, rank)
    try:
        torch.manual_seed(settings.runtime.seed)
        loaded = load_rank_model(settings, setup.model_dir, dtype=setup.dtype, device=device, tuning=setup.tuning,
                                 rank=rank, all_reduce=group.all_reduce, link=group)
        try:
            spec: RunnerSpec = connection.recv()
        except EOFError:  # rank 0 failed to build (its error says why) and closed the pipe
            return
        runner = build_runner(loaded.model, settings, registry_for(settings.plugins), spec, device=device,
                              dtype=setup.dtype)
        torch.manual_seed(settings.runtime.seed)  # as rank 0 does once built: the samplers start alike
        group.barrier()
        while True:
            try:
                message = connection.recv_bytes()
            except EOFError:
                return
            runner.execute_model(pickle.loads(message))
    finally:
        group.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the rank's process (see the module docstring)."""
    fd, rank = (int(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    logging.basicConfig(level=logging.WARNING, format=f"patchbay rank {rank}: %(levelname)s %(name)s: %(message)s")
    with Connection(fd, writable=False) as connection:
        run_rank(connection, rank)


if __name__ == "__main__":
    main()
