"""RMS norms and the MLP's gated activation as single C++ kernels, in place of transformers' chains of small ops.

transformers' ``LlamaRMSNorm`` is seven tensor ops (widen, square, mean, add,
rsqrt, multiply, narrow, times the weight) and its MLP's ``act_fn(gate) * up``
two more plus two copies out of the fused gate/up product; in a decode step of
a small model each op costs a dispatch and, at a few rows, more than its
arithmetic (SmolLM2-135M: 61 norms, about 20 us each in bfloat16 on the
development machine, against a few for one kernel).  These kernels compute the
same formulas in one pass over each row: the norm widens to float32, sums the
squares in float32, rounds the normalized row to the input's dtype and then
multiplies by the weight in that dtype, as transformers does (in float32 the
sum's order differs from torch's, within a unit in the last place); Gemma's
norm multiplies the float32 row by ``1 + weight`` and rounds once, as Gemma's
does; the activation (SiLU, or Gemma's tanh GELU) is rounded to the dtype
before the product, as in transformers.

They replace the ``forward`` of modules whose class's ``forward`` has exactly
the source of transformers' Llama norm or MLP (Llama, Mistral, Qwen2, Qwen3,
Gemma 1-3 and the models that copy them; Phi-3's MLP too), of Gemma's norm,
and of the attention of Llama, Qwen2, Mistral, Gemma 1 and 2, Qwen3 and
Gemma 3 (their per-head q/k norms through the norm kernel) and Phi-3 (its one
q/k/v product), on the CPU, in float32 and bfloat16; the model's code is not
changed otherwise.  The kernels are the public toolkit's
(:mod:`patchbay.toolkit.fused_ops`); until they are built the modules run
their own ``forward``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchbay.toolkit.forward_context import attend
from patchbay.worker.model.hf_model import LlamaStyleModule
from patchbay.worker.cpu.fused_projections import Member
from patchbay.toolkit.fused_ops import FUSED_DTYPES, FusedOpsBuild
from patchbay.toolkit.native_build import BackgroundBuild, build_unavailable


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
def _attention_sources() -> dict[str, str]:
    """Sources of the attention ``forward`` methods whose steps the fused attention knows, to their kind:
    ``llama`` projects, rotates with ``apply_rotary_pos_emb`` and calls the attention interface (Llama's and Gemma's,
    and Qwen2's, Mistral's and Gemma 2's, which also pass a ``sliding_window`` and a ``softcap`` patchbay reads from
    the layer's spec instead); ``qk_norm`` RMS-normalizes each head's query and key before rotating (Qwen3's, Gemma
    3's); ``fused_qkv`` takes the three from one ``qkv_proj`` product (Phi-3's)."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.phi3 import modeling_phi3
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    kinds = {
        "llama": (
            modeling_llama.LlamaAttention,
            modeling_qwen2.Qwen2Attention,
            modeling_mistral.MistralAttention,
            modeling_gemma2.Gemma2Attention,
        ),
        "qk_norm": (modeling_qwen3.Qwen3Attention, modeling_gemma3.Gemma3Attention),
        "fused_qkv": (modeling_phi3.Phi3Attention,),
    }
    return {inspect.getsource(cls.forward): kind for kind, classes in kinds.items() for cls in classes}


@functools.cache
def _phi3_mlp_source() -> str:
    from transformers.models.phi3 import modeling_phi3

    return inspect.getsource(modeling_phi3.Phi3MLP.forward)


@functools.cache
def _same_forward(cls: type[nn.Module], reference: int) -> bool:
    try:
        return inspect.getsource(cls.forward) == _reference_sources()[reference]
    except (OSError, TypeError):
        return False


@functools.cache
def _attention_kind(cls: type[nn.Module]) -> str | None:
    """The kind of ``cls``'s attention (:func:`_attention_sources`), or ``None``.  A ``llama`` or ``qk_norm``
    attention must rotate with Llama's ``apply_rotary_pos_emb``; a ``fused_qkv`` one (Phi-3) with its family's,
    which rotates the first ``cos.shape[-1]`` features of each head (all of them, checked at each call)."""
    try:
        kind = _attention_sources().get(inspect.getsource(cls.forward))
        module = sys.modules[cls.__module__]
        if kind in ("llama", "qk_norm") and _function_source(module.apply_rotary_pos_emb) != _reference_sources()[2]:
            return None
        return kind
    except (OSError, TypeError, AttributeError, KeyError):
        return None


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s class computes transformers' Llama RMS norm (its ``forward`` has the same source)."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    return _same_forward(type(module), 0) and hasattr(module, "variance_epsilon")  # type: ignore[arg-type]


GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}
"""The gated MLP activations the kernels compute, to the kernel computing ``act(gate) * up``."""


def gate_activation(act: Any) -> str | None:
    """Which of :data:`GATED_ACTIVATIONS` the activation module ``act`` computes (SiLU; GELU's tanh
    approximation, Gemma's), or ``None``."""
    name = type(act).__name__ if isinstance(act, nn.Module) else ""
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh") or (name == "GELU" and getattr(act, "approximate", "") == "tanh"):
        return "gelu_tanh"
    return None


def llama_mlp_activation(module: nn.Module) -> str | None:
    """The activation (:func:`gate_activation`) of a Llama-style MLP (``down(act(gate(x)) * up(x))``: Llama's,
    Gemma's...), or ``None`` for another module or activation."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    if not _same_forward(type(module), 1):  # type: ignore[arg-type]
        return None
    return gate_activation(getattr(module, "act_fn", None))


@functools.cache
def _gemma_norm_sources() -> tuple[str, str]:
    from transformers.models.gemma import modeling_gemma

    norm = modeling_gemma.GemmaRMSNorm
    return _code_of(inspect.getsource(norm.forward)), _code_of(inspect.getsource(norm._norm))


def _code_of(source: str) -> str:
    """``source`` without its comment lines (Gemma 3's norm copies Gemma's with another comment)."""
    return "\n".join(line for line in source.splitlines() if not line.strip().startswith("#"))


@functools.cache
def _is_gemma_norm_class(cls: type[nn.Module]) -> bool:
    try:
        own = _code_of(inspect.getsource(cls.forward)), _code_of(inspect.getsource(cls._norm))  # type: ignore[attr-defined]
    except (OSError, TypeError, AttributeError):
        return False
    return own == _gemma_norm_sources()


def is_gemma_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes Gemma's RMS norm (Gemma 1-3's: the float32 normalized row times ``1 + weight``,
    rounded once)."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    return _is_gemma_norm_class(type(module)) and hasattr(module, "eps")  # type: ignore[arg-type]


def is_llama_style_attention(module: nn.Module) -> bool:
    """Whether ``module``'s class is Llama's, Qwen2's or Mistral's attention (the same ``forward`` source, and
    its module's ``apply_rotary_pos_emb`` the same as Llama's)."""
    return attention_kind(module) == "llama"


def attention_kind(module: nn.Module) -> str | None:
    """What the fused attention takes ``module`` as (``llama``, ``qk_norm`` with per-head norms of ``head_dim``
    features, ``fused_qkv``), or ``None``."""
    # mypy wrongly finds a class from type() unhashable for functools.cache
    kind = _attention_kind(type(module))  # type: ignore[arg-type]
    if kind == "qk_norm":
        head_size = int(getattr(module, "head_dim", 0))
        if not all(_head_norm(getattr(module, name, None), head_size) for name in ("q_norm", "k_norm")):
            return None
    return kind


def _head_norm(norm: Any, head_size: int) -> bool:
    """Whether ``norm`` is a norm module of one head's ``head_size`` features (a Llama-style one runs through the
    norm kernel, another, such as Gemma 3's ``1 + weight`` one, through its own ``forward``)."""
    weight: Any = getattr(norm, "weight", None)
    return isinstance(norm, nn.Module) and isinstance(weight, torch.Tensor) and weight.numel() == head_size


def is_phi3_silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is Phi-3's MLP (one ``gate_up_proj`` product, ``up * act(gate)``) with SiLU."""
    act = getattr(module, "activation_fn", None)
    try:
        same = inspect.getsource(type(module).forward) == _phi3_mlp_source()
    except (OSError, TypeError):
        return False
    return same and isinstance(act, nn.Module) and type(act).__name__ in ("SiLU", "SiLUActivation")


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


class GemmaNormWeight:
    """The float32 ``1 + weight`` the norm kernel multiplies a Gemma norm's rows by (Gemma's own arithmetic),
    computed again when the weight changes."""

    def __init__(self, module: LlamaStyleModule) -> None:
        self.module = module
        self.eps = float(module.eps)
        self._key: tuple[int, int] | None = None
        self._weight = torch.empty(0)

    def __call__(self) -> torch.Tensor:
        weight = self.module.weight
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)  # inference tensors keep none
        if key != self._key:
            with torch.no_grad():
                self._weight = 1.0 + weight.detach().float()
            self._key = key
        return self._weight


class FusedGemmaRMSNorm:
    """The ``forward`` of one Gemma RMS norm through the norm kernel, given the float32 ``1 + weight``: the row
    normalized and multiplied in float32, rounded once, as Gemma's norm does (its own ``forward`` until the kernel
    is built)."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild) -> None:
        self.module = module
        self.build = build
        self.weight = GemmaNormWeight(module)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ops = self.build.ready()
        if ops is None or hidden_states.dtype not in FUSED_DTYPES or hidden_states.stride(-1) != 1:
            return type(self.module).forward(self.module, hidden_states)
        out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
        ops.rms_norm(hidden_states, self.weight(), self.weight.eps, out)
        return out


class FusedGatedMLP:
    """The ``forward`` of one Llama-style gated MLP: the fused gate/up product, one activation-and-multiply
    kernel (SiLU, or Gemma's tanh GELU: :data:`GATED_ACTIVATIONS`), the down projection (its own ``forward`` until
    the kernel is built).  Phi-3's MLP, whose ``gate_up_proj`` is one product already (``up * act(gate)``: the
    same product of the same two roundings), runs the same way."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild, activation: str = "silu") -> None:
        self.module = module
        self.build = build
        self.activation = activation
        """A key of :data:`GATED_ACTIVATIONS`."""
        self.kernel = GATED_ACTIVATIONS[activation]
        gate = vars(module.gate_proj).get("forward") if hasattr(module, "gate_proj") else None
        self.group = gate.group if isinstance(gate, Member) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.build.ready()
        module = self.module
        if ops is None:
            return type(module).forward(module, x)
        if self.group is not None:
            gate_up = self.group.product(x, self.group.weight, self.group.bias)
        elif hasattr(module, "gate_up_proj"):
            gate_up = module.gate_up_proj(x)
        else:
            gate_up = torch.cat([module.gate_proj(x), module.up_proj(x)], dim=-1)
        gate_up = gate_up.contiguous()
        activated = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype)
        getattr(ops, self.kernel)(gate_up, activated)
        return module.down_proj(activated)


class FusedRopeAttention:
    """The ``forward`` of one Llama-style attention: the q/k/v products (one, where they are fused), one kernel
    rotating the queries and keys out of them, patchbay's attention, the output projection (its own ``forward``
    until the kernel is built, or for inputs it does not take)."""

    def __init__(self, module: LlamaStyleModule, build: BackgroundBuild, kind: str = "llama") -> None:
        self.module = module
        self.build = build
        self.kind = kind
        """``llama``, ``qk_norm`` (per-head RMS norms before rotating) or ``fused_qkv`` (one ``qkv_proj``)."""
        query = vars(module.q_proj).get("forward") if hasattr(module, "q_proj") else None
        self.group = query.group if isinstance(query, Member) else None
        self.head_size = int(module.head_dim)
        self.gemma_head_norms = (
            {name: GemmaNormWeight(getattr(module, name)) for name in ("q_norm", "k_norm")}
            if kind == "qk_norm" and is_gemma_rms_norm(module.q_norm) and is_gemma_rms_norm(module.k_norm)
            else None
        )
        """Gemma 3's per-head norms' kernel weights (``None``: Llama-style head norms, or none)."""

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
            or cos.shape[-1] != self.head_size  # partial rotary (a Phi-3 with partial_rotary_factor < 1)
        ):
            return type(module).forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if self.group is not None:
            q_size, k_size, _ = self.group.sizes
            qkv = self.group.product(hidden_states, self.group.weight, self.group.bias).reshape(tokens, -1)
            q_rows, k_rows, v_rows = qkv[:, :q_size], qkv[:, q_size : q_size + k_size], qkv[:, q_size + k_size :]
        elif self.kind == "fused_qkv":  # Phi-3: [q | k | v] of this module's (a rank's) heads
            q_size = module.config.num_attention_heads * self.head_size
            k_size = module.num_key_value_heads * self.head_size
            qkv = module.qkv_proj(hidden_states).reshape(tokens, -1)
            q_rows, k_rows, v_rows = qkv[:, :q_size], qkv[:, q_size : q_size + k_size], qkv[:, q_size + k_size :]
        else:
            q_rows, k_rows, v_rows = (
                projection(hidden_states).reshape(tokens, -1)
                for projection in (module.q_proj, module.k_proj, module.v_proj)
            )
        # The kernel reads rows of features; a product may hand them in another layout (row-split's is
        # feature-major).
        q_rows, k_rows = (rows if rows.stride(-1) == 1 else rows.contiguous() for rows in (q_rows, k_rows))
        if self.kind == "qk_norm":  # Qwen3, Gemma 3: each head's query and key normalized, then rotated
            q_rows, k_rows = (
                self._head_norm(ops, name, rows) for name, rows in (("q_norm", q_rows), ("k_norm", k_rows))
            )
        query = torch.empty(tokens, q_rows.shape[1] // self.head_size, self.head_size, dtype=q_rows.dtype)
        key = torch.empty(tokens, k_rows.shape[1] // self.head_size, self.head_size, dtype=k_rows.dtype)
        ops.rotary(q_rows, k_rows, cos, sin, query, key)
        output = attend(module.layer_idx, query, key, v_rows.reshape(tokens, -1, self.head_size))
        return module.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), None

    def _head_norm(self, ops: Any, name: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (``[tokens, heads * head_size]``) with each head's features normalized by the module's norm
        ``name`` (through the norm kernel for a Llama-style or Gemma norm, else by the norm's own ``forward`` over
        every head at once, as the model's attention calls it)."""
        norm = getattr(self.module, name)
        heads = rows.contiguous().view(-1, self.head_size)
        out = torch.empty_like(heads)
        if self.gemma_head_norms is not None:
            weight = self.gemma_head_norms[name]
            ops.rms_norm(heads, weight(), weight.eps, out)
        elif is_llama_rms_norm(norm) and norm.weight.dtype == heads.dtype:
            ops.rms_norm(heads, norm.weight, float(norm.variance_epsilon), out)
        else:
            return norm(heads).view(rows.shape)
        return out.view(rows.shape)


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
        elif is_gemma_rms_norm(module):
            module.forward = FusedGemmaRMSNorm(module, build)
            norms += 1
        elif (activation := llama_mlp_activation(module)) is not None and _gate_and_up_alike(module):
            module.forward = FusedGatedMLP(module, build, activation)
            mlps += 1
        elif is_phi3_silu_mlp(module):
            module.forward = FusedGatedMLP(module, build)
            mlps += 1
        elif (kind := attention_kind(module)) is not None:
            module.forward = FusedRopeAttention(module, build, kind)
            attentions += 1
    return FusedModules(norms, mlps, attentions)
