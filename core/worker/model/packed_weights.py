"""A model's weights from its weight format: modules built empty, plain tensors put in place, packed weights
multiplied where they lie.

:func:`build_empty_model` makes a transformers model's modules with their parameters on PyTorch's ``meta``
device (buffers such as rotary tables are real), :func:`parameter_slots` tells the format what each parameter
is, and :func:`fill_weights` takes the format's tensors one at a time: a plain tensor becomes the parameter, a
:class:`~patchbay.interfaces.PackedWeight` becomes the forward of its linear (:class:`PackedLinearForward`) or
embedding (:class:`PackedEmbeddingForward`), the parameter staying on ``meta`` with its shape and dtype so code
that reads shapes keeps working and no float copy is ever made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from patchbay.interfaces import PackedWeight, ParameterSlot
from patchbay.toolkit.model_files import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PackedLinearForward:
    """The forward of an ``nn.Linear`` whose weight is a :class:`PackedWeight`: the weight's own product."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.weight.product(inputs, self.bias)


class PackedEmbeddingForward:
    """The forward of an ``nn.Embedding`` whose table is a :class:`PackedWeight`: each token's row dequantized."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype, scale: float | None = None) -> None:
        self.weight = weight
        self.dtype = dtype
        self.scale = scale
        """A factor some models apply to their embeddings inside the module (Gemma's scaled embedding)."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.rows(ids.reshape(-1)).to(self.dtype)
        if self.scale is not None:
            rows = rows * torch.tensor(self.scale, dtype=self.dtype)
        return rows.view(*ids.shape, self.weight.in_features)


def packed_weight_of(module: nn.Module) -> PackedWeight | None:
    """The packed weight a linear or embedding multiplies by (``None``: its weight is a plain tensor)."""
    forward = vars(module).get("forward")
    return forward.weight if isinstance(forward, (PackedLinearForward, PackedEmbeddingForward)) else None


def build_empty_model(config: Any, *, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The causal LM of ``config`` with every parameter on ``meta`` (buffers real), in ``dtype``."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()  # on meta, from_config leaves a tied LM head its own parameter
    return model.eval()


def parameter_slots(model: nn.Module) -> dict[str, ParameterSlot]:
    """Each parameter of ``model`` once (tied ones under their first name), with its shape and role."""
    roles: dict[int, str] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            if isinstance(module, nn.Embedding):
                roles[id(weight)] = "embedding"  # a tied LM head shares it: the table is both
            elif isinstance(module, nn.Linear):
                roles.setdefault(id(weight), "linear")
    return {
        name: ParameterSlot(tuple(parameter.shape), roles.get(id(parameter), "other"))  # type: ignore[arg-type]
        for name, parameter in model.named_parameters()
    }


def fill_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor | PackedWeight]],
    slots: Mapping[str, ParameterSlot],
    *,
    dtype: torch.dtype,
    source: str,
) -> int:
    """Put each of ``tensors`` (as a weight format loads them, named as :func:`parameter_slots` named them) in
    ``model``; return how many packed weights there were.  A tensor for no slot, one slot filled twice, one left
    empty, or a shape that differs is a :class:`ModelLoadError` naming ``source`` and the tensor."""
    owners = _owners(model)
    filled: set[str] = set()
    packed = 0
    for name, value in tensors:
        slot = slots.get(name)
        if slot is None:
            raise ModelLoadError(f"{source}: the weight format gave {name!r}, which the model has no parameter for")
        if name in filled:
            raise ModelLoadError(f"{source}: the weight format gave {name!r} twice")
        filled.add(name)
        shape = (value.out_features, value.in_features) if isinstance(value, PackedWeight) else tuple(value.shape)
        if shape != slot.shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {list(shape)}; the model's parameter is {list(slot.shape)}"
            )
        if isinstance(value, PackedWeight):
            if slot.role == "other":
                raise ModelLoadError(f"{source}: {name} came packed, but only linear and embedding weights may be")
            for module in owners[name]:
                _install_packed(module, value, dtype)
            packed += 1
        else:
            for module, attribute in _parameter_holders(model, name):
                setattr(module, attribute, nn.Parameter(value.to(dtype), requires_grad=False))
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: no tensor for {shown}")
    _tie_plain_heads(model)
    return packed


def _owners(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Parameter name -> every module holding that parameter as its ``weight`` (a tied table: the embedding and
    the LM head)."""
    by_id: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = vars(module).get("_parameters", {}).get("weight")
        if weight is not None:
            by_id.setdefault(id(weight), []).append(module)
    return {name: by_id.get(id(parameter), []) for name, parameter in model.named_parameters()}


def _parameter_holders(model: nn.Module, name: str) -> list[tuple[nn.Module, str]]:
    """Every ``(module, attribute)`` holding the parameter called ``name`` (more than one when it is tied)."""
    target = model.get_parameter(name)
    return [
        (module, attribute)
        for module in model.modules()
        for attribute, parameter in vars(module).get("_parameters", {}).items()
        if parameter is target
    ]


def _install_packed(module: nn.Module, weight: PackedWeight, dtype: torch.dtype) -> None:
    if isinstance(module, nn.Embedding):
        scale = getattr(module, "embed_scale", None)
        module.forward = PackedEmbeddingForward(  # type: ignore[assignment]
            weight, dtype, float(scale) if scale is not None else None
        )
    elif isinstance(module, nn.Linear):
        bias = module.bias if module.bias is not None and module.bias.device.type != "meta" else None
        module.forward = PackedLinearForward(weight, bias)  # type: ignore[assignment]
    else:
        raise ModelLoadError(
            f"a packed weight for a {type(module).__name__}, which is neither a linear nor an embedding"
        )
    module.weight = nn.Parameter(torch.empty(weight.out_features, weight.in_features, dtype=dtype, device="meta"))


def _tie_plain_heads(model: nn.Module) -> None:
    """Biases are filled after their linears may have been packed: hand each packed linear its real bias."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, PackedLinearForward) and isinstance(module, nn.Linear) and module.bias is not None:
            forward.bias = module.bias if module.bias.device.type != "meta" else None


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights ``model`` holds: each packed weight's own size, and every real (not ``meta``) parameter
    that is not the placeholder of a packed one."""
    total, seen = 0, set()
    for module in model.modules():
        packed = packed_weight_of(module)
        if packed is not None:
            total += packed.nbytes
            seen.add(id(getattr(module, "weight", None)))
    for parameter in model.parameters():
        if id(parameter) not in seen and parameter.device.type != "meta":
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total
