"""What the built-in connectors share: both roles over a key-value store of encoded blocks.

A connector subclass supplies only its store (:class:`BlockStore`: ``count_present``,
``get``, ``put``); this module decides what to load and save and moves
the bytes.

Scheduler side -> worker side, each step, ``KVConnectorMetadata.payload``::

    {"version": 1,
     "load": [[block_id, "hash hex"], ...],          # copy these stored blocks into the cache now
     "save": [[request_id, block_id, "hash hex"], ...],  # store these blocks after the forward pass
     "hold": [request_id, ...]}                      # finished requests whose blocks wait for their saves

Plain lists, strings and ints, so the payload can cross a process boundary as JSON.

Ranks: each rank's worker side keys its entries by its own shard's model
identity (``KVConnectorConfig.model_id`` names the shard), so the ranks of
a sharded run share a store without sharing an entry, and an entry saved
with another sharding is never found.  The scheduler side (rank 0) plans
for every rank: see :meth:`StoreConnector.lookup_namespaces`.

Saves: a scheduled request's full *prompt* blocks are saved once they are
computed (block ``i`` when ``(i + 1) * block_size <= num_computed_tokens``),
if the store lacks them; a finished request's remaining ones are saved the
step after :meth:`request_finished`, which returns ``True`` so the runner
holds the blocks until ``get_finished`` reports the request as sent.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from patchbay.interfaces import (
    KVConnector,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    RequestView,
)
from patchbay.plugins.kv_connectors._auth import resolve_key
from patchbay.plugins.kv_connectors._blocks import (
    BlockDecodeError,
    PagedCaches,
    damage_entry,
    decode_block,
    encode_block,
    max_entry_bytes,
    store_namespace,
)

logger = logging.getLogger("patchbay.plugins.kv_connectors")

PAYLOAD_VERSION = 1


class StoreUnreachable(ConnectionError):
    """The store cannot be reached at all (as opposed to one entry being bad)."""


class StoreError(OSError):
    """The store answered with an error (a Redis ``-ERR``, a key of the wrong type, out of memory, ...)."""


class EntryTooLarge(ValueError):
    """An entry over the store's size limit: not saved, counted as ``skipped_saves``."""


class BlockStore(ABC):
    """Encoded blocks by key.  Raise :class:`StoreUnreachable` when the store as a whole is down."""

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes | memoryview | None:
        """The stored entry, or ``None`` when there is none.

        An entry over ``max_bytes`` raises :class:`BlockDecodeError` without
        being read whole (a stored file grown to gigabytes must not be loaded
        into memory to be refused).
        """

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store an entry (atomically: a reader sees the old entry, the new one, or none)."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether an entry exists, without counting as a use."""

    @abstractmethod
    def replace_raw(self, key: str, data: bytes | None) -> None:
        """Overwrite (``None``: delete) an entry as is, unchecked: the fault tests' backdoor."""

    def count_present(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, exist (stops at the first missing one)."""
        for count, key in enumerate(keys):
            if not self.contains(key):
                return count
        return len(keys)

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists."""
        return [self.contains(key) for key in keys]


class StoreConnector(KVConnector):
    """A connector over a :class:`BlockStore`; subclasses implement :meth:`open_store`."""

    def __init__(self, options=None, *, config=None) -> None:
        super().__init__(options, config=config)
        self.key_bytes = self.auth_key()
        self.namespace = store_namespace(
            self.config.model_id, self.config.block_size, self.config.dtype, self.key_bytes
        )
        self.stats: dict[str, int] = {
            "loaded_blocks": 0,
            "saved_blocks": 0,
            "load_errors": 0,
            "store_errors": 0,
            "unreachable": 0,
            "skipped_saves": 0,
            "discarded_entries": 0,
            "dropped_saves": 0,
        }
        self._stats_lock = threading.Lock()
        self._warned_unreachable = False
        self._warned: set[str] = set()

    def auth_key(self) -> bytes:
        """The secret that signs and checks this store's entries (see ``_auth``)."""
        return resolve_key(self.options)

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        """Log ``message`` the first time a failure of ``kind`` happens; later ones are only counted in ``stats``."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message + " (further such failures are counted in stats, not logged)", *args)

    @abstractmethod
    def open_store(self) -> BlockStore:
        """A handle on the store (each role opens its own, as separate processes would)."""

    @property
    def on_unreachable(self) -> str:
        return getattr(self.options, "on_unreachable", "recompute")

    def key(self, block_hash_hex: str) -> str:
        """This rank's key of a block: its namespace names the model identity of the rank's shard."""
        return f"{self.namespace}/{block_hash_hex}"

    def lookup_namespaces(self) -> list[str]:
        """The namespaces whose entries the scheduler side requires for a block, in rank order.

        With several ranks and a store they all reach (``cross_process``), a
        block counts as stored only when every rank's entry is there, so a
        load is promised only where every rank can load its part.  A store
        of this process alone (host memory) shows rank 0 its own entries
        only; another rank that lacks one reports a load error and every
        rank recomputes the block.
        """
        config = self.config
        if config.shard.is_whole or not self.capabilities.cross_process:
            return [self.namespace]
        return [
            store_namespace(config.with_shard(shard).model_id, config.block_size, config.dtype, self.key_bytes)
            for shard in config.shard.siblings()
        ]

    def count(self, name: str, amount: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] = self.stats.get(name, 0) + amount

    def unreachable(self, exc: StoreUnreachable, what: str) -> None:
        """Apply the ``on_unreachable`` policy: raise, or count and log (once) and carry on."""
        self.count("unreachable")
        if self.on_unreachable == "error":
            raise exc
        if not self._warned_unreachable:
            self._warned_unreachable = True
            logger.warning(
                "KV connector %s: %s; %s (further failures are counted in stats, not logged)",
                type(self).__name__,
                exc,
                what,
            )

    def corrupt_entry(self, block_hash: bytes, how: str) -> None:
        """Damage the stored entry of ``block_hash`` (see :func:`damage_entry`): the conformance suite's backdoor."""
        store = self.open_store()
        key = self.key(bytes(block_hash).hex())
        data = store.get(key)
        if data is None:
            raise KeyError(f"no stored entry for block {bytes(block_hash).hex()}")
        store.replace_raw(key, damage_entry(bytes(data), how, self.key_bytes))

    def scheduler_side(self) -> StoreScheduler:
        return StoreScheduler(self)

    def worker_side(self) -> StoreWorker:
        return StoreWorker(self)


@dataclass
class _RequestState:
    request: RequestView
    block_ids: list[int] = field(default_factory=list)
    num_considered_blocks: int = 0
    """Prompt blocks already saved, queued or found in the store."""


class StoreScheduler(KVConnectorScheduler):
    """Answers prefix lookups from the store and writes each step's load and save lists."""

    def __init__(self, connector: StoreConnector) -> None:
        self.connector = connector
        self.block_size = connector.config.block_size
        self.store = connector.open_store()
        self.stats = connector.stats
        self.namespaces = connector.lookup_namespaces()
        self._requests: dict[str, _RequestState] = {}
        self._last_answer: dict[str, tuple[int, int]] = {}
        self._loads: list[list[Any]] = []
        self._saves: list[list[Any]] = []
        self._holds: list[str] = []

    # -- lookups ----------------------------------------------------------------------------

    def _stored(self, hashes: Sequence[str]) -> list[bool]:
        """Whether each block (by hash hex) is stored for every rank the lookups answer for."""
        if len(self.namespaces) == 1:
            return self.store.present([self.connector.key(block_hash) for block_hash in hashes])
        found = self.store.present(
            [f"{namespace}/{block_hash}" for block_hash in hashes for namespace in self.namespaces]
        )
        per_block = len(self.namespaces)
        # 2 ranks: [a0, a1, b0, b1] -> [a0 and a1, b0 and b1]
        return [all(found[index * per_block : (index + 1) * per_block]) for index in range(len(hashes))]

    def _count_stored(self, hashes: Sequence[str]) -> int:
        """How many of the blocks, from the first, are stored (see :meth:`_stored`)."""
        if len(self.namespaces) == 1:
            return self.store.count_present([self.connector.key(block_hash) for block_hash in hashes])
        stored = self._stored(hashes)
        return stored.index(False) if False in stored else len(stored)

    def _loadable_blocks(self, request: RequestView) -> int:
        # Never the last prompt token: its logits give the first output token.  5 tokens, block 2 -> 2 blocks.
        return min(len(request.block_hashes), max(0, len(request.prompt_token_ids) - 1) // self.block_size)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        if self.connector.config.role == "producer":
            return 0, False
        first = num_computed_tokens // self.block_size
        candidates = [block_hash.hex() for block_hash in request.block_hashes[first : self._loadable_blocks(request)]]
        if not candidates:
            return 0, False
        try:
            hits = self._count_stored(candidates)
        except StoreUnreachable as exc:
            self.connector.unreachable(exc, "prompts are computed instead of loaded")
            return 0, False
        except (OSError, ValueError) as exc:
            self.connector.count("store_errors")
            self.connector.warn_once(
                "lookup",
                "KV connector %s: a lookup failed (%s); prompts are computed instead of loaded",
                type(self.connector).__name__,
                exc,
            )
            return 0, False
        num_tokens = max(0, (first + hits) * self.block_size - num_computed_tokens)
        # Remembered only to place the loads if this very answer gets allocated; asking again overwrites it.
        self._last_answer[request.request_id] = (num_computed_tokens, num_tokens)
        return num_tokens, False

    # -- allocation and per-step messages ---------------------------------------------------------

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        state.request = request
        state.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        answer = self._last_answer.pop(request.request_id, None)
        # The loaded tokens start where the local prefix ends: what get_num_new_matched_tokens was asked with.
        start = answer[0] if answer is not None and answer[1] == num_external_tokens else request.num_computed_tokens
        end = start + num_external_tokens
        # start 32, 48 external, block 16 -> blocks 2, 3, 4
        for index in range(start // self.block_size, end // self.block_size):
            if index < len(state.block_ids) and index < len(request.block_hashes):
                self._loads.append([state.block_ids[index], request.block_hashes[index].hex()])
        # Loaded blocks are not marked as saved: if a load fails, the worker discards the bad entry and the
        # recomputed block is saved again once it is computed (the presence check skips the good ones).

    def _queue_saves(self, state: _RequestState, pending: set[str]) -> int:
        """Queue the request's newly computed prompt blocks the store lacks; returns how many were queued."""
        request = state.request
        limit = min(
            request.num_computed_tokens // self.block_size,
            len(request.prompt_token_ids) // self.block_size,
            len(request.block_hashes),
            len(state.block_ids),
        )
        candidates = range(state.num_considered_blocks, limit)
        if not candidates:
            return 0
        hashes = [request.block_hashes[index].hex() for index in candidates]
        try:
            stored = self._stored(hashes)
        except StoreUnreachable as exc:
            self.connector.count("store_errors", len(hashes))
            self.connector.count("dropped_saves", len(hashes))
            self.connector.unreachable(exc, "new KV blocks are not saved")
            state.num_considered_blocks = limit
            return 0
        except (OSError, ValueError) as exc:
            self.connector.count("store_errors", len(hashes))
            self.connector.count("dropped_saves", len(hashes))
            self.connector.warn_once(
                "presence",
                "KV connector %s: checking which blocks are stored failed (%s); they are not saved",
                type(self.connector).__name__,
                exc,
            )
            state.num_considered_blocks = limit
            return 0
        queued = 0
        for index, block_hash, exists in zip(candidates, hashes, stored, strict=True):
            if exists or block_hash in pending:
                continue
            pending.add(block_hash)
            self._saves.append([request.request_id, state.block_ids[index], block_hash])
            queued += 1
        state.num_considered_blocks = limit
        return queued

    def build_connector_meta(self, scheduled_request_ids: Sequence[str]) -> KVConnectorMetadata:
        if self.connector.config.role != "consumer":
            pending = {save[2] for save in self._saves}
            for request_id in scheduled_request_ids:
                state = self._requests.get(request_id)
                if state is not None:
                    self._queue_saves(state, pending)
        payload = {"version": PAYLOAD_VERSION, "load": self._loads, "save": self._saves, "hold": self._holds}
        self._loads, self._saves, self._holds = [], [], []
        return KVConnectorMetadata(payload=payload)

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        self._last_answer.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None) or _RequestState(request)
        if self.connector.config.role == "consumer" or not block_ids:
            return False
        state.request, state.block_ids = request, list(block_ids)
        if not self._queue_saves(state, {save[2] for save in self._saves}):
            return False
        self._holds.append(request.request_id)
        return True


class StoreWorker(KVConnectorWorker):
    """Copies blocks between the paged caches and the store; saves run on a background thread when async."""

    def __init__(self, connector: StoreConnector) -> None:
        self.connector = connector
        self.store = connector.open_store()
        self.stats = connector.stats
        self.caches: PagedCaches | None = None
        self._saves: list[list[Any]] = []
        self._holds: list[str] = []
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._save_failure: BaseException | None = None
        async_save = connector.capabilities.async_save
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-save") if async_save else None
        self._in_flight: list[Future] = []

    def register_kv_caches(self, kv_caches: dict[str, Any], split: Any) -> None:
        caches = PagedCaches(kv_caches, split)
        if caches.layout.block_size != self.connector.config.block_size:
            raise ValueError(
                f"KV cache blocks hold {caches.layout.block_size} tokens, "
                f"the connector was configured for {self.connector.config.block_size}"
            )
        self.caches = caches

    def _require_caches(self) -> PagedCaches:
        if self.caches is None:
            raise RuntimeError("register_kv_caches must be called before loading or saving")
        return self.caches

    # -- loads --------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        payload = metadata.payload or {}
        self._saves.extend(payload.get("save", []))
        self._holds.extend(payload.get("hold", []))
        loads = payload.get("load", [])
        if not loads:
            return
        caches = self._require_caches()
        good_ids, good_payloads = [], []
        limit = max_entry_bytes(caches.layout)
        for block_id, block_hash in loads:
            try:
                data = self.store.get(self.connector.key(block_hash), limit)
                if data is None:
                    raise BlockDecodeError("missing entry")
                good_payloads.append(
                    decode_block(
                        data,
                        model_id=self.connector.config.model_id,
                        layout=caches.layout,
                        block_hash=bytes.fromhex(block_hash),
                        key=self.connector.key_bytes,
                    )
                )
                good_ids.append(block_id)
            except StoreUnreachable as exc:
                self._load_failed(block_id, block_hash, None)
                self.connector.unreachable(exc, "blocks that were to be loaded are recomputed")
            except BlockDecodeError as exc:
                self._load_failed(block_id, block_hash, exc)
                if str(exc) != "missing entry":
                    self._discard(block_hash)
            except Exception as exc:  # noqa: BLE001 - a stored entry is untrusted input: any failure is a miss
                self._load_failed(block_id, block_hash, exc)
        caches.scatter(good_ids, good_payloads)
        self.connector.count("loaded_blocks", len(good_ids))

    def _discard(self, block_hash: str) -> None:
        """Remove an entry that can never load (damaged, foreign), so the recomputed block is saved in its place.

        Only entries under this store key's namespace are read, so what is
        discarded here was never a valid entry of a runner with another key.
        """
        try:
            self.store.replace_raw(self.connector.key(block_hash), None)
            self.connector.count("discarded_entries")
        except (OSError, ValueError):
            pass

    def _load_failed(self, block_id: int, block_hash: str, exc: BaseException | None) -> None:
        self._load_errors.add(block_id)
        self.connector.count("load_errors")
        if exc is not None:
            logger.warning(
                "KV block %s could not be loaded (%s: %s); block %d is recomputed",
                block_hash[:16],
                type(exc).__name__,
                exc,
                block_id,
            )

    # -- saves --------------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        if self._save_failure is not None:
            failure, self._save_failure = self._save_failure, None
            raise failure
        saves, holds = self._saves, self._holds
        self._saves, self._holds = [], []
        if not saves and not holds:
            return
        caches = self._require_caches()
        # The device-to-host copy happens now, so the blocks may be reused once this returns.
        payloads = caches.gather([block_id for _, block_id, _ in saves])
        job = ([block_hash for _, _, block_hash in saves], payloads, caches.layout, holds)
        if self._writer is None:
            self._write(*job)
        else:
            self._in_flight = [future for future in self._in_flight if not future.done()]
            self._in_flight.append(self._writer.submit(self._write, *job))

    def _write(self, hashes: list[str], payloads: list[memoryview], layout: Any, holds: list[str]) -> None:
        model_id = self.connector.config.model_id
        try:
            for block_hash, payload in zip(hashes, payloads, strict=True):
                entry = encode_block(model_id, layout, bytes.fromhex(block_hash), payload, key=self.connector.key_bytes)
                try:
                    self.store.put(self.connector.key(block_hash), entry)
                except StoreUnreachable as exc:
                    self.connector.count("store_errors")
                    self.connector.count("dropped_saves")
                    try:
                        self.connector.unreachable(exc, "new KV blocks are not saved")
                    except StoreUnreachable as failure:
                        self._save_failure = failure
                except EntryTooLarge:
                    self.connector.count("skipped_saves")
                except (OSError, ValueError) as exc:
                    self.connector.count("store_errors")
                    self.connector.count("dropped_saves")
                    self.connector.warn_once(
                        "save",
                        "KV connector %s: block %s could not be saved (%s)",
                        type(self.connector).__name__,
                        block_hash[:16],
                        exc,
                    )
                else:
                    self.connector.count("saved_blocks")
        finally:
            with self._lock:
                self._finished_sending.update(holds)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every save handed to the background thread (tests and shutdown)."""
        for future in list(self._in_flight):
            future.result(timeout=timeout)
        self._in_flight = []

    # -- reports ------------------------------------------------------------------------------

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            sent, self._finished_sending = self._finished_sending, set()
        return sent, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
