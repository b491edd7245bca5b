"""``shared_storage``: KV blocks as files under a directory, shared by every process that can see it.

Layout: ``<path>/<model identity>/<first two hex digits of the hash>/<block hash>.kvb``,
where the model identity is a hash of the model id, block size and dtype.
Each file is written to a temporary name in its final directory and renamed
over the target (``os.replace``), so a reader sees a whole entry or none;
readers still check the header and checksum (another writer, a full disk, a
different model on a shared filesystem).  Saves run on a background thread
and finished requests are reported through ``get_finished``.

YAML (a producer that prefills and a consumer that decodes share ``path``)::

    kv_connector:
      name: shared_storage
      options: {path: /mnt/shared/patchbay-kv}
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import KVConnectorCapabilities
from patchbay.plugins.kv_connectors._base import BlockStore, StoreConnector


class SharedStorageOptions(BaseModel):
    """Options of ``kv_connector: {name: shared_storage, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Path(tempfile.gettempdir()) / "patchbay-kv"
    """Directory of the store; created if missing."""
    fsync: bool = False
    """Flush each file to disk before renaming it into place (survives a power cut; slower)."""


class DirectoryStore(BlockStore):
    """One file per key under ``root``; the key's last path part picks a fan-out subdirectory."""

    def __init__(self, root: Path, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync

    def path_of(self, key: str) -> Path:
        namespace, _, block_hash = key.partition("/")
        return self.root / namespace / block_hash[:2] / f"{block_hash}.kvb"

    def contains(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def get(self, key: str) -> bytes | None:
        try:
            return self.path_of(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        target = self.path_of(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
                if self.fsync:
                    file.flush()
                    os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


    def replace_raw(self, key: str, data: bytes | None) -> None:
        path = self.path_of(key)
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


class SharedStorageConnector(StoreConnector):
    """Stores prompt KV blocks as files under a shared directory, written atomically, for any process to load."""

    Options: ClassVar[type[BaseModel]] = SharedStorageOptions
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"), async_load=False, async_save=True, cross_process=True, cross_machine=False,
    )

    def open_store(self) -> DirectoryStore:
        return DirectoryStore(Path(self.options.path), fsync=self.options.fsync)
