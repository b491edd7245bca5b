"""RMS norms and the MLP's SiLU-and-multiply as single C++ kernels, in place of transformers' chains of small ops.

transformers' ``LlamaRMSNorm`` is seven tensor ops (widen, square, mean, add,
rsqrt, multiply, narrow, times the weight) and its MLP's ``act_fn(gate) * up``
two more plus two copies out of the fused gate/up product; in a decode step of
a small model each op costs a dispatch and, at a few rows, more than its
arithmetic (SmolLM2-135M: 61 norms, about 20 us each in bfloat16 on the
development machine, against a few for one kernel).  These kernels compute the
same formulas in one pass over each row: the norm widens to float32, sums the
squares in float32, rounds the normalized row to the input's dtype and then
multiplies by the weight in that dtype, as transformers does (in float32 the
sum's order differs from torch's, within a unit in the last place); SiLU is
rounded to the dtype before the product, as in transformers.

They replace the ``forward`` of modules whose class's ``forward`` has exactly
the source of transformers' Llama norm or MLP (Llama, Mistral, Qwen2 and the
models that copy them), on the CPU, in float32 and bfloat16, with the weight
in the input's dtype; the model's code is not changed otherwise.  The
extension is built like the decode kernel (:mod:`patchbay.worker.cpu.native_build`);
until it is built the modules run their own ``forward``.

The same extension gives the samplers a one-pass argmax over a batch's logits
(:func:`argmax_rows`) and their random draw (:func:`inverse_cdf_rows`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchbay.worker.model.forward_context import attend
from patchbay.worker.model.hf_model import LlamaStyleModule
from patchbay.worker.cpu.fused_projections import Member
from patchbay.worker.cpu.native_build import (
    CSRC,
    NATIVE_CFLAGS,
    BackgroundBuild,
    NativeExtension,
    build_at_install,
    build_unavailable,
)

FUSED_DTYPES = (torch.float32, torch.bfloat16)

EXTENSION = NativeExtension("patchbay_fused_ops", (CSRC / "fused_ops.cpp",), (*NATIVE_CFLAGS, "-ffp-contract=off"))
"""The kernels (SIMD registers where the CPU has AVX-512 or AVX2, plain loops elsewhere and for row tails),
built with no multiply-add contraction, so each product and sum rounds where transformers' ops round it."""


@functools.cache
def load_fused_ops() -> Any:
    """Build the extension (once per installation and CPU) and import it."""
    return EXTENSION.load()


class FusedOpsBuild(BackgroundBuild):
    """:func:`load_fused_ops` in a background thread, shared by every model of the process."""

    def __init__(self) -> None:
        super().__init__(lambda: load_fused_ops(), "the C++ norm, activation and rotary kernels")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (a batch's logits): the same indices (the first largest, or the first
    NaN), from patchbay's one-pass kernel where the rows are CPU float32 or bfloat16 and the engine's kernels
    are built (torch's reduction took 2-6 ms on 64 rows of a 49,152-token vocabulary); torch's elsewhere."""
    build = FusedOpsBuild.started()
    ops = build.ready() if build is not None else None
    if ops is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or x.shape[1] == 0:
        return x.argmax(dim=-1)
    return ops.argmax_rows(x.contiguous())


def inverse_cdf_rows(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` (``[rows, n]``, non-negative, rows need not sum to 1), int64 ``[rows]``:
    the row's first token whose cumulative weight exceeds ``uniform[row]`` (float64 in ``[0, 1)``) times the
    row's total.  A token of weight 0 is never drawn; where ``u * total`` rounds up to the total, the last token
    of positive weight is; a row of zeros draws its last token.

    The sums are float64.  On the CPU, with the engine's kernels built, one C++ pass over each row (about
    10 us for a 49,152-token vocabulary); elsewhere torch's cumulative sum and search, which allocate the rows'
    float64 sums (~30 ms for 64 such rows on a 2-core CPU).
    """
    build = FusedOpsBuild.started()
    ops = build.ready() if build is not None else None
    if ops is not None and weights.dim() == 2 and weights.device.type == "cpu" and weights.shape[1] > 0:
        return ops.inverse_cdf_rows(weights.to(torch.float32).contiguous(), uniform.to(torch.float64))
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.minimum(uniform.to(cumulative).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp_max_(weights.shape[1] - 1)


def _function_source(function: Any) -> str:
    """The source of ``function``, or of the function a hub-kernel wrapper calls.

    With the ``kernels`` package installed (transformers 5.25 requires it), ``@use_kernel_forward_from_hub``
    turns a decorated function such as ``apply_rotary_pos_emb`` into an ``nn.Module`` instance whose ``forward``
    calls the function it closes over (``func``), unless a hub kernel was swapped in, which patchbay never does.
    """
    if isinstance(function, nn.Module):
        wrapped = inspect.getclosurevars(type(function).forward).nonlocals.get("func")
        if callable(wrapped):
            function = wrapped
    return inspect.getsource(function)


@functools.cache
def _reference_sources() -> tuple[str, str, str]:
    from transformers.models.llama import modeling_llama

    return (
        inspect.getsource(modeling_llama.LlamaRMSNorm.forward),
        inspect.getsource(modeling_llama.LlamaMLP.forward),
        _function_source(modeling_llama.apply_rotary_pos_emb),
    )


@functools.cache
def _attention_sources() -> frozenset[str]:
    """Sources of the attention ``forward`` methods known to project, rotate with ``apply_rotary_pos_emb`` and
    call the attention interface as Llama's does (Qwen2's and Mistral's also pass a ``sliding_window``, which
    patchbay's interface reads from the layer's spec instead)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    return frozenset(
        inspect.getsource(cls.forward)
        for cls in (modeling_llama.LlamaAttention, modeling_qwen2.Qwen2Attention, modeling_mistral.MistralAttention)
    )


@functools.cache
def _same_forward(cls: type[nn.Module], reference: int) -> bool:
    try:
        return inspect.getsource(cls.forward) == _reference_sources()[reference]
    except (OSError, TypeError):
        return False


@functools.cache
def _llama_style_attention(cls: type[nn.Module]) -> bool:
    try:
        module = sys.modules[cls.__module__]
        return (
            inspect.getsource(cls.forward) in _attention_sources()
            and _function_source(module.apply_rotary_pos_emb) == _reference_sources()[2]
        )
    except (OSError, TypeError, AttributeError, KeyError):
        return False


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s class computes transformers' Llama RMS norm (its ``forward`` has the same source)."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    return _same_forward(type(module), 0) and hasattr(module, "variance_epsilon")  # type: ignore[arg-type]


def is_llama_silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (``down(act(gate(x)) * up(x))``) whose activation is SiLU."""
    act = getattr(module, "act_fn", None)
    # mypy wrongly finds a class from type() unhashable for functools.cache
    return (
        _same_forward(type(module), 1)  # type: ignore[arg-type]
        and isinstance(act, nn.Module)
        and type(act).__name__ in ("SiLU", "SiLUActivation")
    )


def is_llama_style_attention(module: nn.Module) -> bool:
    """Whether ``module``'s class is Llama's, Qwen2's or Mistral's attention (the same ``forward`` source, and
    its module's ``apply_rotary_pos_emb`` the same as Llama's)."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    return _llama_style_attention(type(module))  # type: ignore[arg-type]


def _gate_and_up_alike(mlp: LlamaStyleModule) -> bool:
    return bool(mlp.gate_proj.out_features == mlp.up_proj.out_features)


class FusedRMSNorm:
    """The ``forward`` of one Llama-style RMS norm through the C++ kernel (its own ``forward`` until it is built)."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild) -> None:
        self.module = module
        self.build = build
        self.eps = float(module.variance_epsilon)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ops = self.build.ready()
        weight = self.module.weight
        if ops is None or hidden_states.dtype != weight.dtype or hidden_states.stride(-1) != 1:
            return type(self.module).forward(self.module, hidden_states)
        out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
        ops.rms_norm(hidden_states, weight, self.eps, out)
        return out


class FusedSiluMLP:
    """The ``forward`` of one Llama-style SiLU MLP: the fused gate/up product, one SiLU-and-multiply, the down
    projection (its own ``forward`` until the kernel is built)."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild) -> None:
        self.module = module
        self.build = build
        gate = vars(module.gate_proj).get("forward")
        self.group = gate.group if isinstance(gate, Member) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.build.ready()
        module = self.module
        if ops is None:
            return type(module).forward(module, x)
        if self.group is not None:
            gate_up = self.group.product(x, self.group.weight, self.group.bias)
        else:
            gate_up = torch.cat([module.gate_proj(x), module.up_proj(x)], dim=-1)
        gate_up = gate_up.contiguous()
        activated = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype)
        ops.silu_and_mul(gate_up, activated)
        return module.down_proj(activated)


class FusedRopeAttention:
    """The ``forward`` of one Llama-style attention: the q/k/v products (one, where they are fused), one kernel
    rotating the queries and keys out of them, patchbay's attention, the output projection (its own ``forward``
    until the kernel is built, or for inputs it does not take)."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild) -> None:
        self.module = module
        self.build = build
        query = vars(module.q_proj).get("forward")
        self.group = query.group if isinstance(query, Member) else None
        self.head_size = int(module.head_dim)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        ops = self.build.ready()
        module = self.module
        cos, sin = position_embeddings
        if (
            ops is None
            or kwargs.get("cache") is not None
            or cos.dtype != hidden_states.dtype
            or sin.dtype != hidden_states.dtype
        ):
            return type(module).forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if self.group is not None:
            q_size, k_size, _ = self.group.sizes
            qkv = self.group.product(hidden_states, self.group.weight, self.group.bias).reshape(tokens, -1)
            q_rows, k_rows, v_rows = qkv[:, :q_size], qkv[:, q_size : q_size + k_size], qkv[:, q_size + k_size :]
        else:
            q_rows, k_rows, v_rows = (
                projection(hidden_states).reshape(tokens, -1)
                for projection in (module.q_proj, module.k_proj, module.v_proj)
            )
        # The kernel reads rows of features; a product may hand them in another layout (row-split's is
        # feature-major).
        q_rows, k_rows = (rows if rows.stride(-1) == 1 else rows.contiguous() for rows in (q_rows, k_rows))
        query = torch.empty(tokens, q_rows.shape[1] // self.head_size, self.head_size, dtype=q_rows.dtype)
        key = torch.empty(tokens, k_rows.shape[1] // self.head_size, self.head_size, dtype=k_rows.dtype)
        ops.rotary(q_rows, k_rows, cos, sin, query, key)
        output = attend(module.layer_idx, query, key, v_rows.reshape(tokens, -1, self.head_size))
        return module.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), None


@dataclass(frozen=True)
class FusedModules:
    """How many of a model's modules run through the fused kernels."""

    norms: int = 0
    mlps: int = 0
    attentions: int = 0
    layers: int = 0
    """Decoder layers whose fused modules and tiled products run as two C++ calls
    (:mod:`patchbay.worker.cpu.fused_layer`)."""
    decoder_loops: int = 0
    """Decoders whose every layer is fused, run as one Python loop over their fused layers
    (:class:`patchbay.worker.cpu.fused_layer.FusedDecoderLoop`)."""


def use_fused_ops(
    model: nn.Module, *, device: torch.device, dtype: str, build: BackgroundBuild | None = None
) -> FusedModules:
    """Route ``model``'s Llama-style RMS norms and SiLU MLPs through the C++ kernels; say how many.

    Nothing changes off the CPU, for dtypes other than float32 and bfloat16, or where no extension can be
    built (no compiler); the build starts in the background (``build``: the process's shared one).
    """
    if device.type != "cpu" or getattr(torch, dtype) not in FUSED_DTYPES or build_unavailable() is not None:
        return FusedModules()
    build = build or FusedOpsBuild.shared()
    norms = mlps = attentions = 0
    for module in model.modules():
        if "forward" in vars(module):  # another path owns this module's forward already
            continue
        if is_llama_rms_norm(module) and module.weight.dtype in FUSED_DTYPES:
            module.forward = FusedRMSNorm(module, build)
            norms += 1
        elif is_llama_silu_mlp(module) and _gate_and_up_alike(module):
            module.forward = FusedSiluMLP(module, build)
            mlps += 1
        elif is_llama_style_attention(module):
            module.forward = FusedRopeAttention(module, build)
            attentions += 1
    return FusedModules(norms, mlps, attentions)


def main() -> int:
    """Build the kernels now (the Makefile runs this at install time); exit 0 also where they cannot be built."""
    return build_at_install(load_fused_ops, "the norm, activation and rotary kernels", EXTENSION.build_directory)


if __name__ == "__main__":
    raise SystemExit(main())
