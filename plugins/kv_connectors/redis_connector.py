"""``redis``: KV blocks in a Redis server, so runners on different machines reuse each other's prefills.

Keys are ``<key_prefix><model identity>/<block hash hex>`` and values the
encoded block (header with model identity, layout and checksum, then the
payload), the same bytes ``shared_storage`` writes to a file.  Saves run on a
background thread; lookups batch their ``EXISTS`` in one pipeline.

When the server cannot be reached, ``on_unreachable: recompute`` (the
default) answers "no match", drops saves and counts both in ``stats``
(logged once); ``on_unreachable: error`` raises, naming the server.

YAML::

    kv_connector:
      name: redis
      options: {url: "redis://kv-cache.internal:6379/0", ttl_s: 3600}
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveFloat, PositiveInt

from patchbay.interfaces import KVConnectorCapabilities
from patchbay.plugins.kv_connectors._base import BlockStore, EntryTooLarge, StoreConnector, StoreUnreachable


class RedisOptions(BaseModel):
    """Options of ``kv_connector: {name: redis, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    url: str = "redis://127.0.0.1:6379/0"
    """Server URL (``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS, ``unix://``)."""
    key_prefix: str = "patchbay:"
    """Prefix of every key, to share a server with other data."""
    ttl_s: PositiveInt | None = None
    """Seconds an entry lives after it is written; ``None``: until the server evicts it."""
    max_block_bytes: ByteSize = Field(default=ByteSize(64 << 20), gt=0)
    """Blocks whose encoded size exceeds this are not saved (counted as ``skipped_saves``)."""
    timeout_s: PositiveFloat = 2.0
    """Connect and socket timeout of each request to the server."""
    on_unreachable: Literal["recompute", "error"] = "recompute"
    """An unreachable server: compute instead of load and drop saves, or raise."""


def redacted_url(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore(BlockStore):
    """Encoded blocks in Redis strings; connection failures become :class:`StoreUnreachable`."""

    def __init__(self, options: RedisOptions) -> None:
        import redis

        self.options = options
        self.client = redis.Redis.from_url(options.url, socket_timeout=options.timeout_s,
                                           socket_connect_timeout=options.timeout_s)
        self._down = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

    def redis_key(self, key: str) -> str:
        return f"{self.options.key_prefix}{key}"

    def _call(self, operation: str, function, *args, **kwargs) -> Any:
        try:
            return function(*args, **kwargs)
        except self._down as exc:
            raise StoreUnreachable(f"redis server at {redacted_url(self.options.url)} unreachable "
                                   f"during {operation}: {exc}") from exc

    def present(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipeline = self.client.pipeline(transaction=False)
        for key in keys:
            pipeline.exists(self.redis_key(key))
        return [bool(found) for found in self._call("EXISTS", pipeline.execute)]

    def count_present(self, keys: Sequence[str]) -> int:
        found = self.present(keys)
        return found.index(False) if False in found else len(found)

    def contains(self, key: str) -> bool:
        return bool(self._call("EXISTS", self.client.exists, self.redis_key(key)))

    def get(self, key: str) -> bytes | None:
        return self._call("GET", self.client.get, self.redis_key(key))

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.options.max_block_bytes:
            raise EntryTooLarge(f"encoded block of {len(data)} bytes exceeds max_block_bytes "
                             f"{int(self.options.max_block_bytes)}")
        self._call("SET", self.client.set, self.redis_key(key), data, ex=self.options.ttl_s)

    def replace_raw(self, key: str, data: bytes | None) -> None:
        if data is None:
            self._call("DEL", self.client.delete, self.redis_key(key))
        else:
            self._call("SET", self.client.set, self.redis_key(key), data)


class RedisConnector(StoreConnector):
    """Stores prompt KV blocks in a Redis server (key prefix, TTL, size limit) for runners on any machine."""

    Options: ClassVar[type[BaseModel]] = RedisOptions
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"), async_load=False, async_save=True, cross_process=True, cross_machine=True,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("redis") is None:
            return "needs the redis client package (pip install redis)"
        return None

    def open_store(self) -> RedisStore:
        return RedisStore(self.options)
