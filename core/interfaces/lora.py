"""LoRA: the batched adapter computation (``lora_kernel``) and where adapters come from (``lora_resolver``).

A LoRA adapter adds a low-rank product to a linear layer: ``y = x Wᵀ + s·(x Aᵀ) Bᵀ``
with ``A`` of shape ``[r, in]``, ``B`` of shape ``[out, r]`` and scale ``s``.
One step's batch mixes rows of several adapters (and rows of none).  The
runner keeps up to ``max_loras`` adapters in *slots*: per target layer, the
A matrices of every slot are stacked into ``[num_slots, max_rank, in]`` and
the B matrices into ``[num_slots, out, max_rank]``, an adapter of lower rank
padded with zeros.  Each token row names its slot (``-1``: no adapter).

Once per step the runner builds a :class:`LoRAMapping` of the rows' slots;
every target layer then calls its kernel's :meth:`LoRAKernel.shrink`
(``h = s·x Aᵀ`` per row) and :meth:`LoRAKernel.expand` (``y += h Bᵀ``), the
two halves of vLLM's punica operations.

A :class:`LoRAResolver` turns an adapter name a request uses into a local
directory in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), for names the settings do not list.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

NO_ADAPTER = -1
"""The slot index of a row that runs the base model only."""


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each token row of one step uses, built once per step and shared by every layer.

    Rows with an adapter are also listed grouped by slot (:attr:`order`,
    :attr:`active_slots`, :attr:`segment_starts`), so a kernel can run one
    matrix product per active slot instead of one per row.  The runner builds
    it with ``patchbay.worker.lora.mapping.build_lora_mapping``.
    """

    slots: torch.Tensor
    """``int64 [num_rows]``: each row's slot, :data:`NO_ADAPTER` for a row without one (on the run's device)."""
    order: torch.Tensor
    """``int64 [num_adapter_rows]``: the rows that have an adapter, grouped by slot in :attr:`active_slots` order."""
    active_slots: tuple[int, ...]
    """The slots some row uses, ascending."""
    segment_starts: tuple[int, ...]
    """Rows ``order[segment_starts[i]:segment_starts[i + 1]]`` use slot ``active_slots[i]``
    (``len(active_slots) + 1`` entries)."""

    @property
    def num_rows(self) -> int:
        """Rows in the step (with an adapter or not)."""
        return int(self.slots.shape[0])

    @property
    def has_adapters(self) -> bool:
        """Whether any row uses an adapter (a step of base rows only can skip LoRA entirely)."""
        return bool(self.active_slots)


@dataclass(frozen=True)
class LoRAKernelConfig(ServingConfig):
    """What a run asks of its LoRA kernel."""

    max_lora_rank: int = 16
    """The stacked weights' rank dimension (the largest rank any adapter may have)."""
    max_loras: int = 4
    """Slots: adapters active in one step."""


@dataclass(frozen=True)
class LoRAKernelCapabilities(Capabilities):
    """What a LoRA kernel can compute."""

    max_lora_rank: int | None = None
    """The largest stacked rank it supports; ``None``: any."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if (
            isinstance(config, LoRAKernelConfig)
            and self.max_lora_rank is not None
            and config.max_lora_rank > self.max_lora_rank
        ):
            found.append(f"max_lora_rank {config.max_lora_rank} exceeds the kernel's {self.max_lora_rank}")
        return found


class LoRAKernel(Plugin):
    """The batched LoRA computation: each row of a batch through its own adapter's low-rank product."""

    kind: ClassVar[str] = "lora_kernel"
    capabilities: ClassVar[LoRAKernelCapabilities] = LoRAKernelCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Prepare the kernel (compile or load native code here, not at registration)."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def shrink(
        self, x: torch.Tensor, lora_a: torch.Tensor, scalings: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """The scaled down-projection ``h[i] = scalings[slot] · x[i] A[slot]ᵀ`` of every row.

        ``x`` is ``[num_rows, in]``; ``lora_a`` is ``[num_slots, max_rank, in]``
        in ``x``'s dtype; ``scalings`` is float32 ``[num_slots]``.  Returns
        ``[num_rows, max_rank]`` in ``x``'s dtype; rows without an adapter
        are zero.
        """

    @abstractmethod
    def expand(self, output: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping) -> None:
        """Add the up-projection ``h[i] B[slot]ᵀ`` to ``output[i]``, in place, for every row with an adapter.

        ``output`` is ``[num_rows, out]`` (the base layer's product), ``h``
        what :meth:`shrink` returned and ``lora_b`` ``[num_slots, out,
        max_rank]``.  Rows without an adapter are left exactly as they were.
        """

    def add_lora(
        self,
        output: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scalings: torch.Tensor,
        mapping: LoRAMapping,
    ) -> None:
        """``output[i] += scalings[slot] · (x[i] A[slot]ᵀ) B[slot]ᵀ`` for every row with an adapter, in place.

        The default runs :meth:`shrink` then :meth:`expand`; a kernel that
        fuses the two overrides this.  A step without adapter rows changes
        nothing.
        """
        if not mapping.has_adapters:
            return
        self.expand(output, self.shrink(x, lora_a, scalings, mapping), lora_b, mapping)


@dataclass(frozen=True)
class LoRAResolverCapabilities(Capabilities):
    """What an adapter resolver offers.  Resolvers move files, not tensors: any device and dtype."""

    devices: tuple[str, ...] = ("cpu", "cuda", "mps")
    can_list: bool = True
    """:meth:`LoRAResolver.available` lists the names it can resolve (a registry it cannot enumerate says False)."""
    checks_base_model: bool = True
    """Told the run's base model, :meth:`LoRAResolver.resolve` refuses an adapter whose ``adapter_config.json``
    names another one (a store that cannot tell which base model an adapter is for says False)."""


class LoRAResolveError(LookupError):
    """A name the resolver recognises but cannot provide; the message says why (the runner adds the resolver)."""


class LoRAResolver(Plugin):
    """Finds adapters by name: a request's ``lora`` that the settings' ``lora.adapters`` does not list."""

    kind: ClassVar[str] = "lora_resolver"
    capabilities: ClassVar[LoRAResolverCapabilities] = LoRAResolverCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Prepare the resolver from its options; raise ``ValueError`` naming the option when they are unusable."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        """The local directory holding adapter ``name`` in PEFT's format, or ``None`` when it does not know it.

        The directory holds ``adapter_config.json`` and the weights.  A name
        that could reach outside the resolver's own store (``..``, an
        absolute path, a path separator) is never resolved: return ``None``
        or raise :class:`LoRAResolveError`; so is a directory or file that is
        a symbolic link out of the store.  A known name whose files cannot
        be provided raises :class:`LoRAResolveError` saying why.

        ``base_model`` names the model the run serves (``model.path`` as
        written; the bundled model's Hugging Face id; ``None`` when unknown).
        With ``checks_base_model``, an adapter whose config names another
        base model raises :class:`LoRAResolveError` naming both.

        Every call answers from the store as it is now: a name missed before
        may exist now, and an adapter replaced in place is returned with its
        new files (a resolver that caches or copies checks that its copy is
        current).  The runner calls this, and reads the files, each time it
        loads the adapter into its cache of ``lora.max_cpu_loras`` adapters.
        Called off the step's critical path, from one thread at a time.
        """

    def available(self) -> list[str]:
        """The names this resolver can resolve now, sorted; empty when it cannot list them (``can_list`` False)."""
        return []
