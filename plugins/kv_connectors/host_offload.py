"""``host_offload``: KV blocks copied to host memory (bounded, least recently used first out).

Each computed prompt block is copied to a process-wide store in host memory,
keyed by model identity and block hash; a later request with the same
prefix loads the blocks back instead of computing them.  Connectors with the
same ``namespace`` in one process share a store, so a second engine (or the
same one after its paged cache evicted the blocks) reuses them.  Over
several ranks each rank keeps its own heads and layers in its own process;
rank 0 sees only its own store, so a block another rank no longer holds is
that rank's load error, and every rank recomputes it.

YAML::

    kv_connector:
      name: host_offload
      options: {max_bytes: 4GiB}
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import ClassVar

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveInt

from patchbay.interfaces import KVConnectorCapabilities
from patchbay.plugins.kv_connectors._base import BlockStore, StoreConnector
from patchbay.plugins.kv_connectors._blocks import BlockDecodeError

_PROCESS_KEY = secrets.token_bytes(32)
"""Entries never leave this process, so they are signed with a key that never leaves it either."""


class HostOffloadOptions(BaseModel):
    """Options of ``kv_connector: {name: host_offload, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    max_bytes: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Most bytes of stored blocks (``"1GiB"``, ``"512MB"``, ...); the least recently used go first."""
    max_blocks: PositiveInt | None = None
    """Most blocks kept; ``None``: as many as ``max_bytes`` allows."""
    namespace: str = Field(default="default", min_length=1)
    """Connectors with the same namespace in one process share a store."""


class HostMemoryStore(BlockStore):
    """An LRU of encoded blocks, bounded by bytes and optionally by count; thread safe."""

    def __init__(self, max_bytes: int, max_blocks: int | None) -> None:
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.num_bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        with self._lock:
            data = self.entries.get(key)
            if data is not None:
                self.entries.move_to_end(key)
        if data is not None and max_bytes is not None and len(data) > max_bytes:
            raise BlockDecodeError(f"entry of {len(data)} bytes, more than the {max_bytes} a block takes")
        return data

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.num_bytes -= len(old)
            if len(data) > self.max_bytes:
                return  # would evict everything and still not fit
            self.entries[key] = data
            self.num_bytes += len(data)
            while self.num_bytes > self.max_bytes or len(self.entries) > (self.max_blocks or len(self.entries)):
                _, evicted = self.entries.popitem(last=False)
                self.num_bytes -= len(evicted)

    def replace_raw(self, key: str, data: bytes | None) -> None:
        """Overwrite or delete an entry as is (the conformance suite's backdoor)."""
        with self._lock:
            old = self.entries.pop(key, None)
            self.num_bytes -= len(old) if old is not None else 0
            if data is not None:
                self.entries[key] = data
                self.num_bytes += len(data)


_STORES: dict[str, HostMemoryStore] = {}
_STORES_LOCK = threading.Lock()


class HostOffloadConnector(StoreConnector):
    """Copies computed prompt KV blocks to a bounded LRU in host memory and loads them back on a prefix hit."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = HostOffloadOptions
    options: HostOffloadOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"),
        async_load=False,
        async_save=False,
        cross_process=False,
        cross_machine=False,
    )

    def auth_key(self) -> bytes:
        return _PROCESS_KEY

    def open_store(self) -> HostMemoryStore:
        options = self.options
        with _STORES_LOCK:
            store = _STORES.get(options.namespace)
            if store is None:
                store = _STORES[options.namespace] = HostMemoryStore(int(options.max_bytes), options.max_blocks)
            else:  # the latest connector's bounds apply to the shared store
                store.max_bytes, store.max_blocks = int(options.max_bytes), options.max_blocks
            return store

    @staticmethod
    def clear(namespace: str = "default") -> None:
        """Forget every block of ``namespace`` (tests use this between cases)."""
        with _STORES_LOCK:
            _STORES.pop(namespace, None)
