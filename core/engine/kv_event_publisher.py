"""The engine's KV-cache events on the wire: a ZMQ publisher of vLLM's msgpack ``KVEventBatch``.

Each step's events (``patchbay.scheduling.kv_events``) become one batch,
sent as three frames ``(topic, sequence number as 8 big-endian bytes,
payload)`` from a thread of its own, exactly as vLLM's ``ZmqEventPublisher``
sends them, so a subscriber written for vLLM (vLLM's router with its
``kv_aware`` policy, llm-d's KV-cache indexer, Dynamo) reads patchbay's.
The payload is msgpack: the batch an array ``[ts, events, data_parallel_rank]``,
each event a map tagged ``"type": "BlockStored" | "BlockRemoved" |
"AllBlocksCleared"`` with vLLM's field names; block hashes are patchbay's
32-byte SHA-256 digests (vLLM's ``ExternalBlockHash`` is bytes or an int).

With a replay endpoint, a ZMQ ROUTER answers ``(identity, b"", start seq)``
with every buffered batch from that sequence number on, then the end marker
(sequence -1, empty payload), as vLLM's does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from patchbay.contract.settings import ConfigError, ConfigProblem, KVEventsSettings, Settings
from patchbay.scheduling.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
"""vLLM's name for the engine's own KV pool (its ``MEDIUM_GPU``), whatever the device; host and disk tiers
have others."""
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class WireBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """vLLM's ``BlockStored``, field for field."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """vLLM's ``AllBlocksCleared``."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: a positional array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


def offset_port(endpoint: str, rank: int) -> str:
    """``tcp://host:5557`` for replica ``rank`` is ``tcp://host:(5557 + rank)``; ``ipc://x`` gets ``_dp{rank}``."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


def to_wire(
    events: Sequence[KVCacheEvent], group_specs: Sequence[tuple[str, int | None]], rank: int, ts: float
) -> KVEventBatch:
    """One step's events as vLLM's batch; ``group_specs[g]`` is group ``g``'s kind and sliding window."""
    wire: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared] = []
    for event in events:
        if isinstance(event, BlockStored):
            kind, window = group_specs[event.group_idx]
            wire.append(
                WireBlockStored(
                    block_hashes=list(event.block_hashes),
                    parent_block_hash=event.parent_block_hash,
                    token_ids=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=event.lora_name,
                    group_idx=event.group_idx,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
        elif isinstance(event, BlockRemoved):
            wire.append(WireBlockRemoved(list(event.block_hashes), MEDIUM, event.group_idx))
        elif isinstance(event, AllBlocksCleared):
            wire.append(WireAllBlocksCleared())
    return KVEventBatch(ts, wire, rank)


class ZmqKVEventPublisher:
    """Publishes batches from a thread of its own; :meth:`publish` only queues.

    The sockets are bound in the thread before the constructor returns, so an
    address in use is a :class:`ConfigError` naming ``kv_events.endpoint``.
    """

    def __init__(self, settings: KVEventsSettings, rank: int, group_specs: Sequence[tuple[str, int | None]]) -> None:
        self.settings = settings
        self.rank = rank
        self.group_specs = list(group_specs)
        self.endpoint = offset_port(settings.endpoint, rank)
        self.replay_endpoint = offset_port(settings.replay_endpoint, rank) if settings.replay_endpoint else None
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=settings.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._ready = threading.Event()
        self._failure: ConfigError | None = None
        self._thread = threading.Thread(target=self._run, name="patchbay-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one step's events as a batch (nothing for an empty step)."""
        if events and self._thread.is_alive():
            self._queue.put(to_wire(events, self.group_specs, self.rank, time.time()))

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every batch queued so far is sent (for up to ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _bind(self, context: Any) -> tuple[Any, Any]:
        import zmq

        pub = context.socket(zmq.PUB)
        pub.set_hwm(self.settings.hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        replay = None
        where = "kv_events.endpoint"
        try:
            pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                where = "kv_events.replay_endpoint"
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            address = self.endpoint if where == "kv_events.endpoint" else self.replay_endpoint
            raise ConfigError([ConfigProblem("<run>", where, f"cannot bind {address}: {exc}")]) from None
        return pub, replay

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        try:
            pub, replay = self._bind(context)
        except ConfigError as exc:
            self._failure = exc
            self._ready.set()
            context.term()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        topic = self.settings.topic.encode()
        sequence = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._answer_replay(replay)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encoder.encode(batch)
                pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
                self._buffer.append((sequence, payload))
                sequence += 1
                self._queue.task_done()
        except Exception:  # noqa: BLE001 - the engine goes on; subscribers see a gap in the sequence numbers
            logger.exception("KV-event publisher on %s stopped", self.endpoint)
        finally:
            pub.close()
            if replay is not None:
                replay.close(0)
            context.term()

    def _answer_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-event replay request of %d frames ignored (expected identity, empty, seq)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                replay.send_multipart((identity, b"", sequence.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


def group_specs_of(groups: Sequence[Any]) -> list[tuple[str, int | None]]:
    """Each KV-cache group's kind as vLLM names it (``full_attention``, ``sliding_window``) and its window."""
    specs = []
    for group in groups:
        window = group.spec.sliding_window
        specs.append(("sliding_window" if window is not None else "full_attention", window))
    return specs


def kv_event_publisher(settings: Settings, groups: Sequence[Any]) -> ZmqKVEventPublisher | None:
    """The run's publisher (bound and started), or ``None`` when ``kv_events.enable_kv_cache_events`` is off."""
    if not settings.kv_events.enable_kv_cache_events:
        return None
    if not settings.cache.prefix_caching:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "kv_events.enable_kv_cache_events",
                    "KV-cache events describe the prefix cache, and cache.prefix_caching is off",
                )
            ]
        )
    return ZmqKVEventPublisher(settings.kv_events, settings.runtime.data_parallel_rank, group_specs_of(groups))
