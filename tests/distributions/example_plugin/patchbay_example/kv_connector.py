"""``example_memory``: a KV connector whose store is a dict in this process.

It saves the full prompt blocks of every finished request, keyed by the
chained block hash prefix caching uses, and loads them for later requests
that share the prefix.  Stores are per ``namespace`` option and shared by
every connector of that namespace in the process, so a second run (or a
second engine) in the same process reuses the first one's prompts.

Timeline of one reuse::

    request A finishes  -> scheduler side queues A's full blocks for saving and holds them
    next step           -> worker side copies them into the store (wait_for_save),
                           get_finished reports A, the runner frees A's blocks
    request B arrives   -> scheduler side finds B's leading block hashes in the store,
                           the worker copies them into B's blocks (start_load_kv)

The scheduler side sends block *hashes*, never store keys: with tensor or
pipeline parallelism every rank's worker side turns them into keys of its
own ``model_id`` (which names its shard), so each rank saves and loads its
own heads and layers only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from patchbay.interfaces import (
    KVConnector,
    KVConnectorCapabilities,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    RequestView,
)

StoreKey = tuple[str, int, bytes]
"""(model id, block size, block hash): entries of another model, layout or shard are never found."""
StoreEntry = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Layer name -> (keys, values) of one block, on the CPU."""

_STORES: dict[str, OrderedDict[StoreKey, StoreEntry]] = {}


class InMemoryOptions(BaseModel):
    """Options of ``kv_connector: {name: example_memory, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="default", min_length=1)
    """Connectors with the same namespace in one process share a store."""
    capacity_blocks: PositiveInt | None = None
    """Most blocks kept; the oldest saved are dropped first.  ``None``: unbounded."""


class InMemoryKVConnector(KVConnector):
    """Keeps finished prompts' KV blocks in an in-process dict and loads them for matching prefixes."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = InMemoryOptions
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"),
        async_load=False,
        async_save=True,  # saves complete a step after request_finished; get_finished reports them
        cross_process=False,
        cross_machine=False,
    )

    @property
    def store(self) -> OrderedDict[StoreKey, StoreEntry]:
        return _STORES.setdefault(self.options.namespace, OrderedDict())

    def key(self, block_hash: bytes) -> StoreKey:
        return (self.config.model_id, self.config.block_size, bytes(block_hash))

    def scheduler_side(self) -> InMemoryScheduler:
        return InMemoryScheduler(self)

    def worker_side(self) -> InMemoryWorker:
        return InMemoryWorker(self)

    def corrupt_entry(self, block_hash: bytes, how: str) -> None:
        """The conformance kit's fault hook: damage the stored entry of ``block_hash`` as ``how`` says."""
        key = self.key(block_hash)
        if how == "missing":
            del self.store[key]
        elif how in ("other_model", "other_layout"):
            # The model id names the model and the block layout: the entry is now another model's.
            self.store[(f"another-{how}", *key[1:])] = self.store.pop(key)
        else:
            raise NotImplementedError("the store holds tensors in this process: nothing can truncate or flip them")

    @staticmethod
    def clear(namespace: str = "default") -> None:
        """Forget every block saved under ``namespace`` (tests use this between cases)."""
        _STORES.pop(namespace, None)


class InMemoryScheduler(KVConnectorScheduler):
    """Looks prompts up in the store and tells the worker what to load and save each step."""

    def __init__(self, connector: InMemoryKVConnector) -> None:
        self.connector = connector
        self.block_size = connector.config.block_size
        self._loads: list[tuple[bytes, int]] = []
        """(block hash, block id) to load this step."""
        self._saves: list[tuple[str, bytes, int]] = []
        """(request id, block hash, block id) to save this step."""

    def _hit_tokens(self, request: RequestView) -> int:
        """Tokens covered by the request's leading blocks found in the store, keeping the last prompt token."""
        hits = 0
        for block_hash in request.block_hashes:
            if self.connector.key(block_hash) not in self.connector.store:
                break
            hits += 1
        # The last prompt token is always computed: its logits give the first output token.
        return min(hits * self.block_size, len(request.prompt_token_ids) - 1)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        if self.connector.config.role == "producer":
            return 0, False
        return max(0, self._hit_tokens(request) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        # Load tokens [end - num_external_tokens, end); e.g. block_size 4, end 11, 7 external -> blocks 1, 2.
        end = self._hit_tokens(request)
        start = end - num_external_tokens
        for logical_block in range(start // self.block_size, -(-end // self.block_size)):
            self._loads.append((bytes(request.block_hashes[logical_block]), block_ids[logical_block]))

    def build_connector_meta(self, scheduled_request_ids: Sequence[str]) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata(payload={"load": self._loads, "save": self._saves})
        self._loads, self._saves = [], []
        return metadata

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        if self.connector.config.role == "consumer":
            return False
        computed_blocks = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
        saves = [
            (request.request_id, bytes(request.block_hashes[index]), block_ids[index])
            for index in range(computed_blocks)
            if self.connector.key(request.block_hashes[index]) not in self.connector.store
        ]
        self._saves.extend(saves)
        return bool(saves)  # hold the blocks until the worker has copied them


class InMemoryWorker(KVConnectorWorker):
    """Copies blocks between the paged KV caches and the store."""

    def __init__(self, connector: InMemoryKVConnector) -> None:
        self.connector = connector
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._saves: list[tuple[str, bytes, int]] = []
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], split: Any) -> None:
        self.kv_caches = dict(kv_caches)
        self.split = split

    def _layers(self):
        if self.split is None:
            raise RuntimeError("register_kv_caches was not called")
        for layer_name, kv_cache in self.kv_caches.items():
            key_cache, value_cache = self.split(kv_cache)
            yield layer_name, key_cache, value_cache

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        payload = metadata.payload or {}
        store = self.connector.store
        for block_hash, block_id in payload.get("load", []):
            entry = store.get(self.connector.key(block_hash))  # this rank's own entry
            if entry is None:  # evicted since the scheduler looked; the runner recomputes the block
                self._load_errors.add(block_id)
                continue
            for layer_name, key_cache, value_cache in self._layers():
                keys, values = entry[layer_name]
                key_cache[block_id].copy_(keys)
                value_cache[block_id].copy_(values)
        self._saves.extend(payload.get("save", []))

    def wait_for_save(self) -> None:
        store = self.connector.store
        capacity = self.connector.options.capacity_blocks
        for request_id, block_hash, block_id in self._saves:
            store_key = self.connector.key(block_hash)
            store[store_key] = {
                layer_name: (key_cache[block_id].to("cpu", copy=True), value_cache[block_id].to("cpu", copy=True))
                for layer_name, key_cache, value_cache in self._layers()
            }
            store.move_to_end(store_key)
            while capacity is not None and len(store) > capacity:
                store.popitem(last=False)
            self._finished_sending.add(request_id)
        self._saves = []

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        finished, self._finished_sending = self._finished_sending, set()
        return finished, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
