"""KV-cache connectors: load KV blocks instead of computing them, save them for reuse.

A connector has two roles.  The scheduler side lives next to the scheduler
and decides, without side effects, how many prompt tokens of a request can
be loaded; the worker side lives next to the model runner and moves blocks
between the paged cache and the connector's store around the forward pass:
``start_load_kv`` before it, ``save_kv_layer`` / ``wait_for_save`` after it,
``get_finished`` to report asynchronous transfers that completed.  The
order of the calls for one request, step by step, is in
docs/plugin-guide.md ("The KV-connector protocol").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel


@dataclass(frozen=True)
class KVConnectorConfig(ServingConfig):
    """What a run asks of its connector."""

    role: Literal["both", "producer", "consumer"] = "both"
    """``producer`` only saves, ``consumer`` only loads, ``both`` does both."""
    block_size: int = 16
    model_id: str = ""
    """Identity of model and KV layout; entries of another identity are never loaded."""


@dataclass(frozen=True)
class KVConnectorCapabilities(Capabilities):
    """What a connector offers."""

    async_load: bool = False
    async_save: bool = False
    cross_process: bool = False
    """Processes on one machine can share its store."""
    cross_machine: bool = False
    roles: tuple[str, ...] = ("both", "producer", "consumer")

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if isinstance(config, KVConnectorConfig) and config.role not in self.roles:
            found.append(f"role {config.role!r} not supported (supports {', '.join(self.roles)})")
        return found


class RequestView(Protocol):
    """What a connector may read of a request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    num_computed_tokens: int
    block_hashes: Sequence[bytes]
    """Chained hash of each full prompt block, as used by prefix caching."""


@dataclass
class KVConnectorMetadata:
    """Opaque per-step message from the scheduler side to the worker side."""

    payload: Any = None


class KVConnectorScheduler(ABC):
    """The scheduler-side role of a connector."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` the store can supply, and whether loading is async.

        Must have no side effects: the scheduler may call it again for the
        same request if it cannot allocate blocks this step.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
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
        """
        return False


class KVConnectorWorker(ABC):
    """The worker-side role of a connector."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], split: Any) -> None:
        """Receive every layer's KV-cache tensor by layer name.

        ``split`` is the backend's :meth:`AttentionBackend.split_kv_cache`,
        which gives key and value views of a layer's tensor.
        """

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start loading this step's blocks into the cache (before the forward pass)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s blocks are loaded. Default: loads are whole-model."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attention_metadata: Any) -> None:
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
        finished in the previous step.
        """
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; the runner recomputes them."""
        return set()


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
