"""Ranks 1..N-1 (tensor-parallel shards or pipeline stages) as seen from the engine's process (rank 0):
launch, steps, failure, teardown.

Each rank runs :mod:`patchbay.worker.parallel.rank_worker`, reading rank 0's
messages from a step channel (:mod:`patchbay.worker.parallel.step_channel`): a pipe
to a child process rank 0 started, or a TCP connection from a rank
``torchrun`` launched.  A rank whose process ends makes the run fail within
moments: rank 0 checks its children before sending each step, and a
collective with a dead peer raises at once; either way the error is a
:class:`RankDiedError` naming the rank and how it ended.  The ranks end
when rank 0 ends the run (:meth:`ParallelRanks.close`, also run
when the engine is collected or the interpreter exits) or when rank 0's
process dies (its pipes and sockets close with it); a rank rank 0 did not
start is noticed ending when its connection closes.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from patchbay.contract.settings import (
    ConfigError,
    ConfigProblem,
    InputSettings,
    OutputSettings,
    ServerSettings,
    Settings,
)
from patchbay.engine.step_failures import EngineDeadError
from patchbay.scheduling.scheduler_output import SchedulerOutput
from patchbay.worker.parallel import step_channel
from patchbay.worker.parallel.distributed import STORE_HOST, CollectiveError, RankGroup, RankSetup, joined_key
from patchbay.worker.parallel.pipeline_parallel import last_stage_rank
from patchbay.worker.parallel.rank_worker import END_OF_RUN, RankZeroGoneError, run_torchrun_rank
from patchbay.worker.parallel.step_channel import StepChannelError
from patchbay.worker.parallel.torchrun import check_world_size, rendezvous_store, store_address, torchrun_launch
from patchbay.worker.runner_build import RunnerSpec
from patchbay.worker.cpu.tuning import Tuning

logger = logging.getLogger(__name__)

EXIT_GRACE = 5.0
"""Seconds a rank gets to exit on its own (after a failed collective, or at close) before it is killed."""


class RankDiedError(EngineDeadError):
    """A rank's process (a tensor-parallel shard or a pipeline stage) ended, so the run cannot go on."""


def distributed_backend(settings: Settings, device: torch.device) -> str:
    """``runtime.distributed_backend`` resolved: ``auto`` is NCCL on CUDA and gloo elsewhere."""
    name = settings.runtime.distributed_backend
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "runtime.distributed_backend",
                    f"nccl joins CUDA devices; this run is on {device} (use auto or gloo)",
                )
            ]
        )
    if name == "nccl" and not dist.is_nccl_available():
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>", "runtime.distributed_backend", "this torch is built without NCCL (use auto or gloo)"
                )
            ]
        )
    return name


def parallel_settings(settings: Settings) -> str:
    """The settings that spread the run over several ranks, with their values, for messages."""
    runtime = settings.runtime
    named = [
        f"runtime.{key} {getattr(runtime, key)}"
        for key in ("tensor_parallel_size", "pipeline_parallel_size")
        if getattr(runtime, key) > 1
    ]
    return " and ".join(named)


def check_parallel(settings: Settings, device: torch.device) -> None:
    """Settings a run over several ranks (shards or stages) cannot serve are :class:`ConfigError` naming the keys."""
    size = settings.runtime.world_size
    problems = []
    # Ranks torchrun launched may be on other machines, each with its own devices.
    if device.type == "cuda" and torchrun_launch() is None and (device.index or 0) + size > torch.cuda.device_count():
        key = (
            "runtime.pipeline_parallel_size"
            if settings.runtime.pipeline_parallel_size > 1
            else "runtime.tensor_parallel_size"
        )
        problems.append(
            ConfigProblem(
                "<run>",
                key,
                f"{size} ranks from {device} need {(device.index or 0) + size} CUDA devices; "
                f"this machine has {torch.cuda.device_count()}",
            )
        )
    if problems:
        raise ConfigError(problems)


@dataclass
class _ChildRank:
    """A rank this process started on its machine, reading a pipe."""

    rank: int
    process: subprocess.Popen[bytes]
    connection: Connection
    ranks_per_stage: int | None
    """``runtime.tensor_parallel_size`` when the run has pipeline stages; ``None``: it has not."""

    def ended(self) -> str | None:
        """How the process ended (``None``: it runs)."""
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}" + (" (its traceback is above, on stderr)" if code else "")

    def describe(self) -> str:
        if self.ranks_per_stage is None:
            return f"tensor-parallel rank {self.rank} (pid {self.process.pid})"
        stage, shard = divmod(self.rank, self.ranks_per_stage)
        within = f", tensor-parallel rank {shard}" if self.ranks_per_stage > 1 else ""
        return f"pipeline stage {stage}{within} (rank {self.rank}, pid {self.process.pid})"

    def finish(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) for the process to exit, then kill it."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit within %g s; killing it", self.describe(), EXIT_GRACE)
            self.process.kill()
            self.process.wait()


@dataclass
class _LaunchedRank:
    """A rank torchrun started (on this machine or another), connected to this process over TCP."""

    rank: int
    connection: Connection

    def ended(self) -> str | None:
        """How the rank ended, as far as rank 0 can tell (``None``: its connection is open)."""
        if step_channel.peer_closed(self.connection):
            return "closed its step channel (its process ended or its machine went away)"
        return None

    def describe(self) -> str:
        return f"tensor-parallel rank {self.rank} (launched by torchrun)"

    def finish(self, deadline: float) -> None:
        """Nothing to wait for: the rank exits once its channel closes, and its launcher waits for it."""


class ParallelRanks:
    """The run's other ranks (tensor-parallel shards, pipeline stages or both), started and joined into the process
    group with this process as rank 0.

    Rank 0 starts ranks 1..N-1 itself, unless ``torchrun`` launched this
    process (:mod:`patchbay.worker.parallel.torchrun`): then the ranks connect to it.
    """

    def __init__(
        self, settings: Settings, model_dir: Path, *, device: torch.device, dtype: str, tuning: Tuning | None
    ) -> None:
        """Start (or await) ranks 1..N-1, send them the run's setup and join the process group with them."""
        world_size = settings.runtime.world_size
        timeout = settings.runtime.distributed_timeout
        launch = torchrun_launch()
        if launch is not None:
            check_world_size(settings, launch)
            if launch.rank != 0:
                raise ConfigError(
                    [
                        ConfigProblem(
                            "<environment>",
                            "RANK",
                            f"torchrun's rank {launch.rank} runs the rank loop (patchbay run/serve do), not an engine",
                        )
                    ]
                )
            store_host, store_port = store_address(settings, launch)
            self._store = rendezvous_store(settings, launch)
        else:
            store_host = settings.runtime.master_addr or STORE_HOST
            self._store = dist.TCPStore(
                store_host,
                settings.runtime.master_port or 0,
                world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout),
            )
            store_port = self._store.port
        # The ranks build a model and a runner: the run's inputs, outputs and server (API keys) are rank 0's alone.
        rank_settings = settings.model_copy(
            update={"inputs": InputSettings(), "outputs": OutputSettings(), "server": ServerSettings()}
        )
        self.setup = RankSetup(
            rank_settings,
            model_dir,
            str(device),
            dtype,
            tuning,
            store_host,
            store_port,
            distributed_backend(settings, device),
        )
        self.ranks: list[_ChildRank | _LaunchedRank] = []
        self.group: RankGroup | None = None
        """Rank 0's membership of the process group (its ``all_reduce`` is what the sharded model calls)."""
        self._closed = False
        self._runners_started = False
        try:
            if launch is None:
                for rank in range(1, world_size):
                    self.ranks.append(self._start(rank))
            else:
                self.ranks = self._accept(store_host, world_size, timeout)
            self._send(pickle.dumps(self.setup, protocol=pickle.HIGHEST_PROTOCOL))
            self._wait_until_joining(timeout)
            self.group = RankGroup(self.setup, 0, device, self._store)
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int) -> _ChildRank:
        read_fd, connection = step_channel.open_pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "patchbay.worker.parallel.rank_worker", str(read_fd), str(rank)],
                pass_fds=(read_fd,),
            )
        except BaseException:
            connection.close()
            raise
        finally:
            os.close(read_fd)
        runtime = self.setup.settings.runtime
        return _ChildRank(
            rank, process, connection, runtime.tensor_parallel_size if runtime.pipeline_parallel_size > 1 else None
        )

    def _accept(self, host: str, world_size: int, timeout: float) -> list[_ChildRank | _LaunchedRank]:
        listener = step_channel.StepListener(host, self._store)
        try:
            connected = listener.accept(set(range(1, world_size)), timeout)
        except step_channel.StepChannelError as exc:
            raise RankDiedError(str(exc)) from None
        finally:
            listener.close()
        return [_LaunchedRank(rank, connected[rank]) for rank in sorted(connected)]

    def _wait_until_joining(self, timeout: float) -> None:
        """Wait for every rank to reach the process group, failing as soon as one of them ends."""
        deadline = time.monotonic() + timeout
        waiting = list(self.ranks)
        while waiting:
            self.check_alive("while starting")
            waiting = [rank for rank in waiting if not self._store.check([joined_key(rank.rank)])]
            if waiting and time.monotonic() > deadline:
                raise RankDiedError(
                    f"{waiting[0].describe()} did not join the process group within "
                    f"{timeout:g} s (runtime.distributed_timeout)"
                )
            time.sleep(0.02)

    def start_runners(self, spec: RunnerSpec) -> None:
        """Send the runner's spec (once rank 0 has built its own) and wait until every rank has built its runner."""
        self._send(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        assert self.group is not None
        try:
            self.group.barrier()
        except Exception as exc:
            died = self.failure(exc, "while building its model runner")
            if died is not None:
                raise died from exc
            raise
        self._runners_started = True

    def send_step(self, scheduler_output: SchedulerOutput) -> None:
        """Hand a step to every other rank; raise :class:`RankDiedError` when one has ended.

        Compiled grammars stay here (they need not pickle): the step carries
        rank 0's bitmask rows (``grammar_bitmasks``) instead.
        """
        self._send(pickle.dumps(scheduler_output.without_grammars(), protocol=pickle.HIGHEST_PROTOCOL))

    def receive_output(self) -> Any:
        """The last pipeline stage's output of the oldest step it has not returned yet (waiting for it); raise
        :class:`RankDiedError` when a rank ended."""
        assert self.group is not None
        runtime = self.setup.settings.runtime
        try:
            return self.group.recv_object(last_stage_rank(runtime.pipeline_parallel_size, runtime.tensor_parallel_size))
        except Exception as exc:
            died = self.failure(exc, "while rank 0 waited for a step's output")
            if died is not None:
                raise died from exc
            raise

    def _send(self, payload: bytes) -> None:
        self.check_alive()
        for rank in self.ranks:
            try:
                rank.connection.send_bytes(payload)
            except OSError as exc:  # the rank closed its end: it is exiting
                died = self.failure(exc)
                if died is not None:
                    raise died from exc
                raise

    def check_alive(self, when: str = "") -> None:
        """Raise :class:`RankDiedError` naming the first rank whose process has ended."""
        for rank in self.ranks:
            ended = rank.ended()
            if ended is not None:
                raise RankDiedError(f"{rank.describe()} {ended}{' ' + when if when else ''}; the run cannot go on")

    def failure(self, exc: BaseException, when: str = "") -> RankDiedError | None:
        """The error naming the rank whose end made ``exc`` (raised on rank 0 in a step) happen; ``None`` if none did.

        A collective fails at once when a peer's process ends, possibly
        before that process is reaped, so its end is waited for a moment.
        Any other error is rank 0's own: the ranks that fail after it are
        not to blame.
        """
        if not isinstance(exc, (OSError, CollectiveError)):
            return None
        deadline = time.monotonic() + EXIT_GRACE
        while True:
            for rank in self.ranks:
                ended = rank.ended()
                if ended is not None:
                    return RankDiedError(
                        f"{rank.describe()} {ended}{' ' + when if when else ''}; the run cannot "
                        f"go on (rank 0 saw {type(exc).__name__}: {exc})"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def close(self) -> None:
        """End the other ranks and leave the group.

        Once the runners started, the ranks are told the run ended (they exit
        0); before, their channel just closes (they exit 1: rank 0 failed).
        Ranks this process started are killed if they outlive a grace.
        """
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            if self._runners_started:
                try:
                    rank.connection.send_bytes(END_OF_RUN)
                except OSError:
                    pass  # the rank is gone already
            rank.connection.close()
        # Leaving closes rank 0's sockets, which frees a rank blocked in a collective rank 0 will never join.
        if self.group is not None:
            self.group.close()
        deadline = time.monotonic() + EXIT_GRACE
        for rank in self.ranks:
            rank.finish(deadline)


def run_launched_rank(settings: Settings) -> int | None:
    """Run this process's rank when ``torchrun`` launched it as a rank other than 0.

    Returns the process's exit status once rank 0 ends the run (0), or once
    its channel closed early (1, the reason on stderr); ``None`` when this
    process is to run the engine itself (rank 0, or no torchrun launch).
    A ``WORLD_SIZE`` other than the run's ranks (``runtime.tensor_parallel_size``
    x ``pipeline_parallel_size``) is a :class:`ConfigError` on every rank.
    """
    launch = torchrun_launch()
    if launch is None:
        return None
    check_world_size(settings, launch)
    if launch.rank == 0:
        return None
    try:
        run_torchrun_rank(settings, launch)
    except (RankZeroGoneError, StepChannelError) as exc:
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 1
    return 0
