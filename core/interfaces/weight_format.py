"""Weight formats: how a checkpoint's weights are read, kept packed and multiplied (``weight_format`` plugins).

A checkpoint stores weights in a format: float safetensors, a GGUF file of quantized blocks (Q4_0 ... Q6_K),
GPTQ or AWQ groups of int4 levels, compressed-tensors' packed integers.  A :class:`WeightFormat` says which
checkpoints it reads (:meth:`WeightFormat.reads`) and loads every tensor the model needs
(:meth:`WeightFormat.load`): norms and biases as plain tensors, and the weights of linear layers (and of the
embedding and LM head, where the format quantizes them) as :class:`PackedWeight` objects that keep the file's
bits and multiply by them, never as a float copy.

The runner builds the model's modules empty (on PyTorch's ``meta`` device), asks the run's weight format for the
tensors by name, puts the plain ones in place and makes each packed linear's forward its
:meth:`PackedWeight.product`; an embedding whose weight is packed looks its rows up through
:meth:`PackedWeight.rows`.  With tensor parallelism every rank cuts its part with :meth:`PackedWeight.shard`.

A format may also re-quantize float weights as it loads them (``int4``, ``w8a8``, ``int8``: a float checkpoint
run with integer products); it then reads the dense checkpoints the other formats leave.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

ParameterRole = Literal["linear", "embedding", "other"]
"""What a model parameter is for the formats: a linear layer's weight, a token embedding table, or anything else
(norms, biases, rotary tables)."""


@dataclass(frozen=True)
class Checkpoint:
    """The model files a run names (``model.path`` resolved).

    ``path`` is a model directory (with ``config.json``) or a single file (a ``.gguf``); ``config`` is the
    directory's ``config.json`` (``{}`` for a file).
    """

    path: Path
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_file(self) -> bool:
        """Whether the checkpoint is one file (a GGUF) rather than a directory."""
        return self.path.is_file()

    @property
    def quantization_method(self) -> str | None:
        """``config.json``'s ``quantization_config.quant_method`` (``gptq``, ``awq``, ``compressed-tensors``...),
        or ``None`` for a checkpoint that declares none."""
        quantization = self.config.get("quantization_config")
        return str(quantization.get("quant_method")) if isinstance(quantization, Mapping) else None


@dataclass(frozen=True)
class ParameterSlot:
    """One parameter the model's modules need, as the runner asks a format for it."""

    shape: tuple[int, ...]
    """The parameter's shape as the module declares it (``[out_features, in_features]`` for a linear)."""
    role: ParameterRole
    """What the parameter is (only ``linear`` and ``embedding`` weights may come back packed)."""


@dataclass(frozen=True)
class WeightFormatConfig(ServingConfig):
    """What a run asks of its weight format."""

    tensor_parallel_size: int = 1
    """Ranks the packed weights are cut over (1: none)."""


@dataclass(frozen=True)
class WeightFormatCapabilities(Capabilities):
    """What a weight format reads and how its packed weights run."""

    checkpoint_formats: tuple[str, ...] = ()
    """The checkpoint formats it reads: ``gguf``, ``gptq``, ``awq``, ``compressed-tensors``, or ``safetensors``
    (float checkpoints it re-quantizes while loading)."""
    tensor_types: tuple[str, ...] = ()
    """The tensor types its packed weights hold (``Q4_K``, ``int4-g128-sym``...); :attr:`PackedWeight.tensor_type`
    names one of them."""
    shards: bool = False
    """Whether its packed weights can be cut over tensor-parallel ranks (:meth:`PackedWeight.shard`)."""
    integer_activations: bool = False
    """Whether its products round the activations to int8 themselves (as llama.cpp's do), so the run's dtype
    leaves their speed unchanged and ``model.dtype: auto`` takes bfloat16 where the CPU has it."""
    priority: int = 0
    """Rank for ``model.weight_format: auto`` among the formats that read a checkpoint: the highest wins.  Below
    zero, ``auto`` never picks the format: one that re-quantizes any float checkpoint runs only when named."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if isinstance(config, WeightFormatConfig) and config.tensor_parallel_size > 1 and not self.shards:
            found.append(f"its packed weights cannot be cut over {config.tensor_parallel_size} tensor-parallel ranks")
        return found


class PackedWeight(ABC):
    """One weight matrix ``[out_features, in_features]`` kept in a format's own layout.

    Its product must equal the product by its own dequantized weight (:meth:`dequantize`) up to the rounding of
    the activations the format's kernel makes (the kit checks both against a float64 oracle).
    """

    out_features: int
    in_features: int
    tensor_type: str = ""
    """The format's name for what it holds (one of its capabilities' ``tensor_types``); set it per weight."""

    @abstractmethod
    def product(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``inputs @ W.T + bias`` for ``inputs`` of ``[..., in_features]`` in the run's dtype; the result has the
        inputs' dtype and leading shape.  Called from every thread a product may run on; must not keep state."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` the packed bits stand for (for oracles, LoRA
        checks and the conversion to a float checkpoint, never on a step's path)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``[len(ids), in_features]`` of output features ``ids`` (an embedding lookup:
        a packed token table holds one row per token)."""
        return self.dequantize()[ids]

    def shard(self, dim: int, index: int, count: int) -> PackedWeight:
        """Part ``index`` of ``count`` equal parts along ``dim`` (0: output features, 1: input features), for
        tensor parallelism; raises :class:`ValueError` saying why when the layout cannot be cut there."""
        raise ValueError(f"{type(self).__name__} ({self.tensor_type}) cannot be cut over tensor-parallel ranks")

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds in memory."""
        return 0


class WeightFormat(Plugin):
    """Reads one checkpoint format's tensors, keeping linear weights packed in the format's own layout."""

    kind: ClassVar[str] = "weight_format"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Prepare the format (build native kernels here, not at registration)."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def reads(self, checkpoint: Checkpoint) -> str | None:
        """``None`` when this format reads ``checkpoint``; otherwise why it does not (``not a GGUF file``),
        shown when the operator named the format and it cannot read the checkpoint.  Cheap: looks at names and
        headers, loads no tensor."""

    def model_files(self, checkpoint: Checkpoint, directory: Path) -> None:
        """Write a Hugging Face ``config.json``, ``generation_config.json`` and tokenizer files for
        ``checkpoint`` into ``directory``, for a checkpoint that is one file holding its own (a GGUF).  Formats
        of model directories, which hold these already, keep this default, which is never called for them."""
        raise NotImplementedError(f"{type(self).__name__} reads model directories, which hold their own config")

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        """A checkpoint of this format made from the float model directory ``source``, written under the
        empty folder ``target`` with the format's own default tensor types (a quantizer): how the conformance
        kit gets checkpoints of a format it knows nothing else about, and how ``patchbay bench`` makes them.  A
        format that re-quantizes float checkpoints as it loads returns ``source`` itself."""
        raise NotImplementedError(f"{type(self).__name__} writes no checkpoints; the kit cannot test it without one")

    def worker_scheme(self) -> str | None:
        """The worker's own integer scheme (``int8``) that re-quantizes the float linears this format loads, after
        they load; ``None`` (the default): the weights :meth:`load` yields are final."""
        return None

    @abstractmethod
    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Every tensor of ``parameters`` (the model's parameters by their Hugging Face names), once each:
        a tensor in ``dtype`` of the slot's shape, or a :class:`PackedWeight` of that shape for a slot of role
        ``linear`` or ``embedding``.  A parameter the checkpoint lacks, a shape that differs or a tensor type
        the format does not take is a :class:`ValueError` naming the file, the tensor and its type.  Yielding
        one at a time lets the runner drop what the file maps once it is packed."""
