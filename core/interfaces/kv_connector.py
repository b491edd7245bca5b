"""KV-cache connectors: load KV blocks instead of computing them, save them for reuse.

A connector has two roles.  The scheduler side lives next to the scheduler
and decides, without side effects, how many prompt tokens of a request can
be loaded; the worker side lives next to the model runner and moves blocks
between the paged cache and the connector's store around the forward pass:
``start_load_kv`` before it, ``save_kv_layer`` / ``wait_for_save`` after it,
``get_finished`` to report asynchronous transfers that completed.  The
order of the calls for one request, step by step, is in
docs/plugin-guide.md ("The KV-connector protocol").

With tensor or pipeline parallelism the scheduler side runs on rank 0 only
and every rank runs a worker side over its own part of the cache (its KV
heads, its stage's layers), configured with its :class:`KVShard`; the
per-rank ``model_id`` keeps the ranks' entries apart, and the runner joins
the ranks' reports (a transfer is finished once every rank reported it,
and a block failed to load if it failed on any rank).

Entries in a store that another process or machine can write must be
authenticated: anyone who can write the store (another local user, a host
on the network that reaches Redis) could otherwise put KV data there that
every later request loads, and the outputs would be silently wrong.
:func:`sign_entry` and :func:`verify_entry` are the helpers every connector
uses for that: an HMAC-SHA256 over the entry's identifying header and its
bytes, under a secret key that every runner sharing the store holds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel


@dataclass(frozen=True)
class KVShard:
    """Which part of the model's KV cache one rank's worker side holds.

    Rank ``r`` of a run with ``T`` tensor-parallel ranks per stage is shard
    ``r % T`` of pipeline stage ``r // T``: it holds its shard's KV heads
    (``T`` > 1) of its stage's layers (more than one stage).  The default,
    ``KVShard()``, is the whole model in one process.
    """

    tensor_parallel_rank: int = 0
    """This rank's position among the tensor-parallel ranks of its stage, from 0."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per stage (``runtime.tensor_parallel_size``)."""
    pipeline_stage: int = 0
    """This rank's pipeline stage, from 0."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (``runtime.pipeline_parallel_size``)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(
                f"tensor-parallel rank {self.tensor_parallel_rank} of {self.tensor_parallel_size}: "
                "expected a size of at least 1 and 0 <= rank < size"
            )
        if self.pipeline_parallel_size < 1 or not 0 <= self.pipeline_stage < self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline stage {self.pipeline_stage} of {self.pipeline_parallel_size}: "
                "expected a size of at least 1 and 0 <= stage < size"
            )

    @classmethod
    def of_rank(cls, rank: int, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> KVShard:
        """The shard of global rank ``rank``: 2 ranks per stage, rank 3 -> tensor-parallel rank 1 of stage 1."""
        stage, shard = divmod(rank, tensor_parallel_size)
        return cls(shard, tensor_parallel_size, stage, pipeline_parallel_size)

    @property
    def rank(self) -> int:
        """The global rank holding this shard (``stage * tensor_parallel_size + tensor_parallel_rank``)."""
        return self.pipeline_stage * self.tensor_parallel_size + self.tensor_parallel_rank

    @property
    def is_whole(self) -> bool:
        """Whether this is the whole model (one rank, no tensor or pipeline parallelism)."""
        return self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1

    @property
    def name(self) -> str:
        """A short, key-safe name saying the layout and the position: ``tp1of2``, ``pp0of2``, ``tp1of2-pp0of2``;
        ``""`` for the whole model."""
        parts = []
        if self.tensor_parallel_size > 1:
            parts.append(f"tp{self.tensor_parallel_rank}of{self.tensor_parallel_size}")
        if self.pipeline_parallel_size > 1:
            parts.append(f"pp{self.pipeline_stage}of{self.pipeline_parallel_size}")
        return "-".join(parts)

    def siblings(self) -> tuple[KVShard, ...]:
        """Every shard of this layout, in rank order (this one among them)."""
        return tuple(
            KVShard.of_rank(
                rank, tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size
            )
            for rank in range(self.tensor_parallel_size * self.pipeline_parallel_size)
        )


def _shard_suffix(shard: KVShard) -> str:
    return f"@{shard.name}" if not shard.is_whole else ""


KVConnectorRole = Literal["both", "producer", "consumer"]
"""``producer`` only saves, ``consumer`` only loads, ``both`` does both."""


@dataclass(frozen=True)
class KVConnectorConfig(ServingConfig):
    """What a run asks of its connector (on rank 0, and, with several ranks, of each rank's worker side)."""

    role: KVConnectorRole = "both"
    """``producer`` only saves, ``consumer`` only loads, ``both`` does both."""
    block_size: int = 16
    model_id: str = ""
    """Identity of the model, its KV layout and this rank's shard; entries of another identity are never loaded.

    For the whole model it is the engine's model identity; for a shard
    (:attr:`shard`) that identity followed by ``@`` and :attr:`KVShard.name`
    (``...-float32-2x1x16x1x64@tp1of2``), so a connector that keys and checks
    its entries by ``model_id`` keeps each rank's heads apart, and never
    loads entries saved with another sharding.  Build the config of another
    shard with :meth:`with_shard`.
    """
    shard: KVShard = field(default_factory=KVShard)
    """The part of the model this worker side holds (the scheduler side, on rank 0, has rank 0's)."""

    def __post_init__(self) -> None:
        suffix = _shard_suffix(self.shard)
        if suffix and not self.model_id.endswith(suffix):  # a shard's identity always names the shard
            object.__setattr__(self, "model_id", self.model_id + suffix)

    def with_shard(self, shard: KVShard) -> KVConnectorConfig:
        """This run's config as the worker side of ``shard`` gets it: the same settings, that shard's ``model_id``.

        The scheduler side uses it to name another rank's entries (to check
        that every rank holds a block before promising to load it).
        """
        base = self.model_id.removesuffix(_shard_suffix(self.shard))
        return replace(self, shard=shard, model_id=base + _shard_suffix(shard))


@dataclass(frozen=True)
class KVConnectorCapabilities(Capabilities):
    """What a connector offers."""

    async_load: bool = False
    async_save: bool = False
    cross_process: bool = False
    """Processes on one machine can share its store."""
    cross_machine: bool = False
    roles: tuple[KVConnectorRole, ...] = ("both", "producer", "consumer")

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if isinstance(config, KVConnectorConfig) and config.role not in self.roles:
            found.append(f"role {config.role!r} not supported (supports {', '.join(self.roles)})")
        return found


class RequestView(Protocol):
    """What a connector may read of a request (read-only, so the scheduler's own request type satisfies it)."""

    @property
    def request_id(self) -> str:
        """The request's id."""

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt's token ids."""

    @property
    def num_computed_tokens(self) -> int:
        """How many of the request's tokens are in the KV cache."""

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """Chained hash of each full prompt block, as used by prefix caching."""


@dataclass
class KVConnectorMetadata:
    """Opaque per-step message from the scheduler side to the worker side."""

    payload: Any = None


class KVConnectorScheduler(ABC):
    """The scheduler-side role of a connector.

    With several ranks it runs on rank 0 alone (configured with rank 0's
    shard), and its metadata goes to every rank's worker side: promise a
    load only of blocks every rank can load (a block one rank cannot load is
    recomputed on all of them).
    """

    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` the store can supply, and whether loading is async.

        Must have no side effects: the scheduler may call it again for the
        same request if it cannot allocate blocks this step.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; the last ``num_external_tokens`` tokens are to be loaded.

        Called when the request is admitted (``block_ids``: all its blocks so
        far, in order) and again, with ``num_external_tokens == 0``, in every
        later step that gives it new blocks.  At admission
        ``request.num_computed_tokens`` counts local prefix-cache hits plus the
        external tokens; a local hit may be a block another request computes
        in this very step, so a block's KV exists only after the step whose
        forward pass wrote it (never save a block here, or in that step's
        ``start_load_kv``).
        """

    @abstractmethod
    def build_connector_meta(self, scheduled_request_ids: Sequence[str]) -> KVConnectorMetadata:
        """Build the message for the worker side for this step and reset per-step state."""

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        """A request finished; return ``True`` to keep its blocks until an async save completes.

        ``True`` commits the worker side to report ``request.request_id`` in
        the ``finished_sending`` set of a later :meth:`KVConnectorWorker.get_finished`:
        until then its blocks stay allocated and the engine keeps stepping.  If
        nothing else can run and it is not reported within
        ``kv_connector.stall_timeout`` seconds, the run fails naming the
        connector and the request.  Return ``False`` when there is nothing to
        save (a prompt shorter than a block, every block already stored).
        With several ranks every rank's worker side must report it: the
        blocks are freed once all of them did.
        """
        return False


class KVConnectorWorker(ABC):
    """The worker-side role of a connector.

    With several ranks each rank has its own, over its own part of the cache,
    and all of them see the same calls with the same metadata in the same
    order; each saves and loads its own shard's entries (under its
    :attr:`KVConnectorConfig.model_id`), never another rank's.
    """

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], split: Any) -> None:
        """Receive every layer's KV-cache tensor by layer name.

        On a rank of a sharded run these are the rank's own: its KV heads
        (tensor parallelism) of its stage's layers (pipeline parallelism),
        as its :attr:`KVConnectorConfig.shard` says.

        ``split`` is the backend's :meth:`AttentionBackend.split_kv_cache`,
        which gives key and value views of a layer's tensor.
        """

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start loading this step's blocks into the cache (before the forward pass)."""

    def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: B027 - optional: the default does nothing
        """Block until ``layer_name``'s blocks are loaded. Default: loads are whole-model."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attention_metadata: Any) -> None:  # noqa: B027 - optional: the default does nothing
        """Start saving one layer's new KV (called after the layer runs). Default: save in :meth:`wait_for_save`.

        ``kv_layer`` is the layer's whole cache tensor (the step's keys and
        values are in it now); ``attention_metadata`` is what the backend's
        metadata builder built for this step, the object the layer's
        :meth:`AttentionImpl.forward` read (its type is the builder's).
        """

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called after the forward pass; return once saves that must be synchronous are done."""

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        """Request ids whose async saves and async loads completed since the last call.

        Called after every step, also steps that run nothing while the
        connector holds requests.  ``finished_request_ids``: the requests that
        finished in the previous step.  With several ranks each rank reports
        its own transfers, each request once: the runner counts a request
        finished when every rank has reported it (not necessarily in the
        same step).
        """
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; the runner recomputes them.

        With several ranks the runner recomputes the union of every rank's
        failed blocks on every rank, so report only this rank's failures;
        a block another rank failed to load is recomputed here too.
        """
        return set()


def _entry_mac(key: bytes, header: Mapping[str, Any], payload: bytes | memoryview) -> hmac.HMAC:
    if len(key) < 16:
        raise ValueError(f"a KV store key has at least 16 bytes, got {len(key)}")
    # Canonical JSON is self-delimiting (it ends with its closing brace), so header || payload is unambiguous.
    mac = hmac.new(key, json.dumps(dict(header), sort_keys=True).encode(), hashlib.sha256)
    mac.update(memoryview(payload).cast("B"))
    return mac


def sign_entry(key: bytes, header: Mapping[str, Any], payload: bytes | memoryview) -> str:
    """The authentication code of one stored entry: HMAC-SHA256 (hex) under ``key``.

    ``header`` holds what identifies the entry (model id, block layout, block
    hash, payload length; JSON-serialisable), ``payload`` its KV bytes.  Store
    the code with the entry; :func:`verify_entry` checks it before loading.
    ``key`` is the store's secret (at least 16 bytes), shared by every runner
    that reads or writes the store and by nobody else.
    """
    return _entry_mac(key, header, payload).hexdigest()


def verify_entry(key: bytes, header: Mapping[str, Any], payload: bytes | memoryview, code: str) -> bool:
    """Whether ``code`` is :func:`sign_entry` of ``header`` and ``payload`` under ``key`` (constant-time).

    ``False`` means the entry was written without the key (forged) or damaged:
    report its blocks as load errors and never copy it into the cache.
    """
    return isinstance(code, str) and hmac.compare_digest(_entry_mac(key, header, payload).hexdigest(), code)


class KVConnector(Plugin):
    """A KV connector: a factory of its scheduler-side and worker-side roles."""

    kind: ClassVar[str] = "kv_connector"
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities()

    def __init__(self, options: BaseModel | None = None, *, config: KVConnectorConfig | None = None) -> None:
        """Create the connector with its validated ``options`` and the run's :class:`KVConnectorConfig`."""
        self.options = options if options is not None else self.Options()
        self.config = config if config is not None else KVConnectorConfig()

    @abstractmethod
    def scheduler_side(self) -> KVConnectorScheduler:
        """Create the scheduler-side role."""

    @abstractmethod
    def worker_side(self) -> KVConnectorWorker:
        """Create the worker-side role."""
