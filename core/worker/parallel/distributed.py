"""The torch.distributed process group of a tensor-parallel run, as every rank joins it.

Rank 0 (the engine's process) hosts a ``TCPStore`` on the loopback
interface when it starts the ranks itself (under ``torchrun`` the store is
the launcher's, at ``runtime.master_addr``/``master_port``: see
:mod:`patchbay.worker.parallel.torchrun`); each rank posts a key in it once it is
about to join, so rank 0 can watch the ranks while it waits instead of
blocking in the group's rendezvous on a rank that already died.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from patchbay.contract.settings import Settings
from patchbay.worker.parallel.torchrun import torchrun_launch
from patchbay.worker.cpu.tuning import Tuning

STORE_HOST = "127.0.0.1"
HIDDEN_STATES_TAG = 0
"""The point-to-point tag of hidden states passed from one pipeline stage to the next."""
OUTPUT_TAG = 1
"""The tag of the last pipeline stage's step outputs, sent to rank 0."""


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to build its part of the run: the settings and what rank 0 resolved from them."""

    settings: Settings
    model_dir: Path
    device: str
    """Rank 0's device; rank ``r`` of a CUDA run uses the ``r``-th device after it."""
    dtype: str
    tuning: Tuning | None
    store_host: str
    store_port: int
    backend: str
    """``gloo`` or ``nccl`` (resolved from ``runtime.distributed_backend``)."""

    @property
    def world_size(self) -> int:
        return self.settings.runtime.world_size

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.settings.runtime.distributed_timeout)


def joined_key(rank: int) -> str:
    """The store key a rank sets just before it calls ``init_process_group``."""
    return f"patchbay/joining/{rank}"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank``: the CPU for every rank, or the ``rank``-th CUDA device from rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def rank_threads(settings: Settings) -> int | None:
    """Threads per rank: ``runtime.threads``, else the cores this process may run on shared evenly by the
    ranks on this machine (all of them, or torchrun's ``LOCAL_WORLD_SIZE``); ``None``: torch's default,
    without tensor parallelism.

    Pipeline stages count too: with batches in flight on every stage, they compute at the same time.
    """
    if settings.runtime.threads is not None:
        return settings.runtime.threads
    world_size = settings.runtime.world_size
    if world_size == 1:
        return None
    launch = torchrun_launch()
    ranks_here = launch.local_world_size if launch is not None else world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // ranks_here)


class CollectiveError(RuntimeError):
    """A collective of the run's process group failed: a rank's process ended, or one stayed silent too long."""


class RankGroup:
    """This rank's membership of the run's process group.

    The group is a process group object of its own, never torch.distributed's
    default (global) one, so a process may hold several runs' groups and
    its own use of torch.distributed is left alone.
    """

    def __init__(self, setup: RankSetup, rank: int, device: torch.device, store: dist.Store | None = None) -> None:
        """Join as ``rank`` (on ``device``) through ``store``, or else a new connection to the store of ``setup``.

        A rank other than 0 says in the store that it is joining.
        """
        if store is None:
            store = dist.TCPStore(
                setup.store_host, setup.store_port, setup.world_size, is_master=False, timeout=setup.timeout
            )
        if rank != 0:
            store.set(joined_key(rank), str(os.getpid()))
        self.rank = rank
        self.device = device
        """This rank's device: where NCCL's collectives want their tensors."""
        self._device = device if setup.backend == "nccl" else torch.device("cpu")
        """Where point-to-point tensors live: NCCL moves CUDA tensors only."""
        self._pending_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        """Sends started and not yet waited for, oldest first, each with its tensor (kept alive until sent)."""
        self._max_pending_sends = 2 * setup.settings.runtime.pipeline_parallel_size
        """A send older than this many has surely been received: with at most ``pipeline_parallel_size``
        batches in flight (two sends each, at most), its batch's output is back on rank 0."""
        self.all_reduce_seconds = 0.0
        """Seconds this rank spent in :meth:`all_reduce` and :meth:`all_gather` (waiting for the slowest rank
        included)."""
        self._store = store
        if setup.backend == "nccl":
            torch.cuda.set_device(device)  # NCCL works on the current device
        self._group: dist.ProcessGroup | None = _process_group(
            setup, dist.PrefixStore("patchbay/group", store), rank, setup.world_size
        )
        tensor_size = setup.settings.runtime.tensor_parallel_size
        self.tensor_size = tensor_size
        """The tensor-parallel ranks of this rank's pipeline stage (those :meth:`all_reduce` and :meth:`all_gather`
        span)."""
        self._tensor_group: dist.ProcessGroup | None = None
        """The tensor-parallel ranks of this rank's pipeline stage, when there are several stages and ranks each."""
        if tensor_size > 1 and tensor_size < setup.world_size:
            stage_store = dist.PrefixStore(f"patchbay/stage/{rank // tensor_size}", store)
            self._tensor_group = _process_group(setup, stage_store, rank % tensor_size, tensor_size)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the tensor-parallel ranks (of this rank's pipeline stage), in place."""
        group = self._tensor_group or self._group
        assert group is not None, "the rank left the group"
        started = time.perf_counter()
        try:
            group.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"all-reduce on rank {self.rank} failed: {exc}") from exc
        self.all_reduce_seconds += time.perf_counter() - started

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``tensor`` of every tensor-parallel rank (of this rank's pipeline stage; one shape on all),
        concatenated along the last dimension in rank order."""
        group = self._tensor_group or self._group
        assert group is not None, "the rank left the group"
        started = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.tensor_size)]
        try:
            group.allgather([parts], [tensor]).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"all-gather on rank {self.rank} failed: {exc}") from exc
        self.all_reduce_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def send(self, tensor: torch.Tensor, to_rank: int, tag: int = HIDDEN_STATES_TAG) -> None:
        """Start sending ``tensor`` to ``to_rank``, which receives it with :meth:`recv`; returns at once.

        The group keeps ``tensor`` until the send completes (do not write to
        it after); sends to one rank with one tag arrive in order.
        """
        assert self._group is not None, "the rank left the group"
        while len(self._pending_sends) >= self._max_pending_sends:
            self._wait_for_oldest_send()
        try:
            work = self._group.send([tensor], to_rank, tag)
        except RuntimeError as exc:
            raise CollectiveError(f"send from rank {self.rank} to rank {to_rank} failed: {exc}") from exc
        self._pending_sends.append((work, tensor))

    def _wait_for_oldest_send(self) -> None:
        work, _ = self._pending_sends.popleft()
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"a send from rank {self.rank} failed: {exc}") from exc

    def recv(self, tensor: torch.Tensor, from_rank: int, tag: int = HIDDEN_STATES_TAG) -> None:
        """Fill ``tensor`` (of the sent shape and dtype) with what ``from_rank`` sends."""
        assert self._group is not None, "the rank left the group"
        try:
            self._group.recv([tensor], from_rank, tag).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"receive on rank {self.rank} from rank {from_rank} failed: {exc}") from exc

    def send_object(self, value: object, to_rank: int) -> None:
        """Start sending a picklable ``value`` to ``to_rank`` (its size, then its bytes), which takes it with
        :meth:`recv_object`; returns at once."""
        payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.send(torch.tensor([payload.numel()], dtype=torch.int64, device=self._device), to_rank, OUTPUT_TAG)
        self.send(payload.to(self._device), to_rank, OUTPUT_TAG)

    def recv_object(self, from_rank: int) -> object:
        """The next value ``from_rank`` sent with :meth:`send_object` (waits for it)."""
        size = torch.empty(1, dtype=torch.int64, device=self._device)
        self.recv(size, from_rank, OUTPUT_TAG)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        self.recv(payload, from_rank, OUTPUT_TAG)
        return pickle.loads(payload.cpu().numpy().tobytes())

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order (every rank of the group calls it, each with its own).

        Two all-gathers: the lengths, then the payloads padded to the longest.
        """
        assert self._group is not None, "the rank left the group"
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        world_size = self._group.size()
        try:
            length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
            lengths = [torch.empty_like(length) for _ in range(world_size)]
            self._group.allgather([lengths], [length]).wait()
            sizes = [int(size.item()) for size in lengths]
            padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
            if payload:
                padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            padded = padded.to(device)
            gathered = [torch.empty_like(padded) for _ in range(world_size)]
            self._group.allgather([gathered], [padded]).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"all-gather on rank {self.rank} failed: {exc}") from exc
        return [bytes(part[:size].cpu().numpy()) for part, size in zip(gathered, sizes, strict=True)]

    def barrier(self) -> None:
        """Wait until every rank reaches this point (a rank that died makes it raise at once)."""
        assert self._group is not None, "the rank left the group"
        try:
            self._group.barrier().wait()
        except RuntimeError as exc:
            raise CollectiveError(f"barrier on rank {self.rank} failed: {exc}") from exc

    def close(self) -> None:
        """Leave the group, closing this rank's connections to the others (idempotent)."""
        groups = (self._tensor_group, self._group)
        self._tensor_group = self._group = None
        self._pending_sends.clear()
        for group in groups:
            if group is not None:
                group.shutdown()


def _process_group(setup: RankSetup, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """A process group of ``size`` ranks over ``store`` on the run's backend, joined as ``rank``."""
    # torch's stubs make these Backends without the collectives; at run time they have ProcessGroup's
    if setup.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, setup.timeout)  # type: ignore[return-value]
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = setup.timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)  # type: ignore[return-value]


class PausableCollectives:
    """A :class:`RankGroup`'s all-reduce, all-gather and stage exchanges, which rank 0 can pause while it runs a
    forward pass the other ranks do not (a memory profile: the values come out wrong, the sizes right)."""

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Skip every collective inside the block."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if not self._paused:
            self._group.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._paused:  # the gathered shape, this rank's part repeated
            return torch.cat([tensor] * self._group.tensor_size, dim=-1)
        return self._group.all_gather(tensor)

    def send(self, tensor: torch.Tensor, to_rank: int) -> None:
        if not self._paused:
            self._group.send(tensor, to_rank)

    def recv(self, tensor: torch.Tensor, from_rank: int) -> None:
        if not self._paused:
            self._group.recv(tensor, from_rank)
