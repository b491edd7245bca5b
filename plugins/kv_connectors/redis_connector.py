"""``redis``: KV blocks in a Redis server, so runners on different machines reuse each other's prefills.

Keys are ``<key_prefix><namespace>/<block hash hex>``, the namespace a hash of the
model identity, block layout and the store key's id (over several
ranks the model identity names the rank's shard: one key per rank) and values the
encoded block (header with model identity, layout and HMAC, then the
payload), the same bytes ``shared_storage`` writes to a file.  Saves run on a
background thread; lookups batch their ``EXISTS`` in one pipeline.

When the server cannot be reached, ``on_unreachable: recompute`` (the
default) answers "no match", drops saves and counts both in ``stats``
(logged once); ``on_unreachable: error`` raises, naming the server.  After
``breaker_failures`` timeouts or refused connections in a row the connector
stops asking for a while (1 s, doubling up to ``breaker_max_s``), so a server
that accepts connections but never answers costs a run a few timeouts, not
one per call.  A server that answers with an error (``-ERR``, a key of the
wrong type, out of memory on a save) or with something that is not Redis
fails that lookup, load or save alone: a miss that is recomputed, or a
dropped save, counted in ``stats``.  The password of ``url`` (``user:pass@``
or ``?password=``) is never printed.

YAML::

    kv_connector:
      name: redis
      options: {url: "redis://kv-cache.internal:6379/0", ttl_s: 3600}
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveFloat, PositiveInt

from patchbay.contract.redaction import is_secret_name, redact_url
from patchbay.interfaces import KVConnectorCapabilities
from patchbay.plugins.kv_connectors._auth import AuthOptions
from patchbay.plugins.kv_connectors._base import (
    BlockStore,
    EntryTooLarge,
    StoreConnector,
    StoreError,
    StoreUnreachable,
)
from patchbay.plugins.kv_connectors._blocks import BlockDecodeError


class RedisOptions(AuthOptions):
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
    breaker_failures: PositiveInt = 3
    """Timeouts or refused connections in a row after which calls stop for a back-off period."""
    breaker_max_s: PositiveFloat = 60.0
    """Longest back-off (it starts at 1 s and doubles while the server stays down)."""


redacted_url = redact_url
"""``url`` without its password (``user:pass@host`` or ``?password=...``), for messages."""


class RedisStore(BlockStore):
    """Encoded blocks in Redis strings; connection failures become :class:`StoreUnreachable`."""

    def __init__(self, options: RedisOptions) -> None:
        import redis

        self.options = options
        self.client = redis.Redis.from_url(
            options.url, socket_timeout=options.timeout_s, socket_connect_timeout=options.timeout_s
        )
        self._down = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._failed = redis.exceptions.RedisError
        self._failures_in_a_row = 0
        self._backoff_s = 0.0
        self._closed_until = 0.0
        self.num_skipped_calls = 0
        """Calls not made because the breaker was open."""

    def redis_key(self, key: str) -> str:
        return f"{self.options.key_prefix}{key}"

    def _call(self, operation: str, function, *args, **kwargs) -> Any:
        where = redacted_url(self.options.url)
        now = time.monotonic()
        if now < self._closed_until:
            self.num_skipped_calls += 1
            raise StoreUnreachable(
                f"redis server at {where} skipped during {operation}: it failed "
                f"{self._failures_in_a_row} times in a row, next try in "
                f"{self._closed_until - now:.1f} s"
            )
        try:
            result = function(*args, **kwargs)
        except self._down as exc:
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.options.breaker_failures:
                self._backoff_s = min(self.options.breaker_max_s, max(1.0, 2 * self._backoff_s))
                self._closed_until = time.monotonic() + self._backoff_s
            raise StoreUnreachable(
                f"redis server at {where} unreachable during {operation}: {_redacted(exc, self.options.url)}"
            ) from None
        except self._failed as exc:  # it answered, with an error or with something that is not Redis
            self._failures_in_a_row = 0
            raise StoreError(
                f"redis server at {where} failed {operation}: {type(exc).__name__}: {_redacted(exc, self.options.url)}"
            ) from None
        self._failures_in_a_row = 0
        self._backoff_s = 0.0
        return result

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

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        if max_bytes is None:
            data = self._call("GET", self.client.get, self.redis_key(key))
        else:
            # At most one byte past the limit crosses the network: enough to know the entry is too large.
            data = self._call("GETRANGE", self.client.getrange, self.redis_key(key), 0, max_bytes)
            if data is not None and len(data) > max_bytes:
                raise BlockDecodeError(f"entry of more than {max_bytes} bytes, the most a block takes")
        if data is not None and not isinstance(data, bytes):
            raise BlockDecodeError(f"redis answered a {type(data).__name__} for an entry")
        return data or None

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.options.max_block_bytes:
            raise EntryTooLarge(
                f"encoded block of {len(data)} bytes exceeds max_block_bytes {int(self.options.max_block_bytes)}"
            )
        self._call("SET", self.client.set, self.redis_key(key), data, ex=self.options.ttl_s)

    def replace_raw(self, key: str, data: bytes | None) -> None:
        if data is None:
            self._call("DEL", self.client.delete, self.redis_key(key))
        else:
            self._call("SET", self.client.set, self.redis_key(key), data)


def _redacted(exc: BaseException, url: str) -> str:
    """The exception's text with the URL's password (if any) replaced."""
    text = str(exc)
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    for name, value in parse_qsl(urlsplit(url).query) if "?" in url else []:
        if is_secret_name(name) and value:
            text = text.replace(value, "***")
    return text.replace(password, "***") if password else text


class RedisConnector(StoreConnector):
    """Stores prompt KV blocks in a Redis server (key prefix, TTL, size limit) for runners on any machine."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = RedisOptions
    options: RedisOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"),
        async_load=False,
        async_save=True,
        cross_process=True,
        cross_machine=True,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("redis") is None:
            return "needs the redis client package (pip install redis)"
        return None

    def open_store(self) -> RedisStore:
        return RedisStore(self.options)
