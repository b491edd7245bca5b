"""``shared_storage``: KV blocks as files under a directory, shared by every process that can see it.

Layout: ``<path>/<namespace>/<first two hex digits of the hash>/<block hash>.kvb``,
``path`` defaulting to ``<cache dir>/kv-store`` (``~/.cache/patchbay/kv-store``), a
directory of this user's alone: created 0700, and refused when another user
owns it or others may write it.  Entries are authenticated (see ``_auth``), so
a shared ``path`` only lets in entries of runners that hold the same key;
entry files get the usual mode of new files (the umask), so a consumer
running as another user can read them.
The namespace is a hash of the model identity, block size, dtype and the
store key's id (see ``_blocks.store_namespace``), so runners with different
keys never read, nor discard, each other's entries.
Over several ranks the model id names the rank's shard, so each rank
writes its heads and layers to a directory of its own, and rank 0 plans a
load only when every rank's file is there.
Each file is written to a temporary name in its final directory and renamed
over the target (``os.replace``), so a reader sees a whole entry or none;
readers still check the header and its HMAC (another writer, a full disk, a
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
from patchbay.plugins.kv_connectors._auth import AuthOptions, private_directory
from patchbay.plugins.kv_connectors._base import BlockStore, StoreConnector
from patchbay.plugins.kv_connectors._blocks import BlockDecodeError
from patchbay.toolkit.paths import cache_dir


class SharedStorageOptions(AuthOptions):
    """Options of ``kv_connector: {name: shared_storage, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = None
    """Directory of the store; created if missing.  Default: ``<cache dir>/kv-store``, this user's alone."""
    fsync: bool = False
    """Flush each file to disk before renaming it into place (survives a power cut; slower)."""


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


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

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            with self.path_of(key).open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                if max_bytes is not None and size > max_bytes:
                    raise BlockDecodeError(f"entry file of {size} bytes, more than the {max_bytes} a block takes")
                return file.read(size + 1 if max_bytes is None else max_bytes + 1)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        target = self.path_of(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            os.fchmod(handle, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide entries from a consumer of another uid
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

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = SharedStorageOptions
    options: SharedStorageOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"),
        async_load=False,
        async_save=True,
        cross_process=True,
        cross_machine=False,
    )

    def open_store(self) -> DirectoryStore:
        path = self.options.path
        if path is None:
            path = private_directory(cache_dir() / "kv-store", "the default shared_storage directory")
        return DirectoryStore(Path(path).expanduser(), fsync=self.options.fsync)
