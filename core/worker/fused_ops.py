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
extension is built like the decode kernel (:mod:`patchbay.worker.native_build`);
until it is built the modules run their own ``forward``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchbay.worker.fused_projections import Member
from patchbay.worker.native_build import SIMD_HELPERS, BackgroundBuild, NativeExtension, build_unavailable

FUSED_DTYPES = (torch.float32, torch.bfloat16)

SOURCE = SIMD_HELPERS + r"""
#include <torch/extension.h>
#include <omp.h>
#include <cmath>

// Rows below this many elements in all run on the calling thread: waking OpenMP's sleeping threads costs more.
constexpr int64_t kParallelElements = 1 << 16;

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t x_row_stride, const scalar_t* weight, scalar_t* out, int64_t rows,
                   int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* row = x + r * x_row_stride;
    scalar_t* o = out + r * hidden;
    int64_t i = 0;
    float squares = 0.0f;
#ifdef PATCHBAY_SIMD
    vfloat acc = vbroadcast(0.0f);
    for (; i + kLanes <= hidden; i += kLanes) {
      const vfloat value = vload(row + i);
      acc = vfma(value, value, acc);
    }
    squares = vsum(acc);
#endif
    for (; i < hidden; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    i = 0;
#ifdef PATCHBAY_SIMD
    const vfloat scale = vbroadcast(inverse);
    for (; i + kLanes <= hidden; i += kLanes) {
      // Rounded to the input's dtype before the weight multiplies it, as transformers does.
      const vfloat normalized = vround_as(row, vmul(vload(row + i), scale));
      vstore(o + i, vmul(vload(weight + i), normalized));
    }
#endif
    for (; i < hidden; ++i) {
      const scalar_t normalized = static_cast<scalar_t>(static_cast<float>(row[i]) * inverse);
      o[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normalized));
    }
  }
}

// x: [..., hidden] with unit stride along hidden and equal row strides; weight: [hidden]; out: contiguous.
void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous() && out.is_contiguous() && weight.numel() == hidden
              && out.numel() == x.numel(), "rms_norm: unit-stride rows, a contiguous weight of the row's size and "
              "a contiguous output of the input's size expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(),
              "rms_norm: one dtype for input, weight and output");
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  const auto flat = x.reshape({rows, hidden});  // a view for transformers' [1, tokens, hidden] hidden states
  const int64_t row_stride = rows > 1 ? flat.stride(0) : hidden;
  if (x.scalar_type() == torch::kFloat32) {
    rms_norm_rows<float>(flat.data_ptr<float>(), row_stride, weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                         hidden, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm runs on float32 or bfloat16");
    rms_norm_rows<at::BFloat16>(flat.data_ptr<at::BFloat16>(), row_stride, weight.data_ptr<at::BFloat16>(),
                                out.data_ptr<at::BFloat16>(), rows, hidden, static_cast<float>(eps));
  }
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate, const scalar_t* up, int64_t in_row_stride, scalar_t* out, int64_t rows,
                       int64_t width) {
#pragma omp parallel for if (rows * width >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* g = gate + r * in_row_stride;
    const scalar_t* u = up + r * in_row_stride;
    scalar_t* o = out + r * width;
    int64_t i = 0;
#ifdef PATCHBAY_SIMD
    const vfloat one = vbroadcast(1.0f), minus_one = vbroadcast(-1.0f);
    for (; i + kLanes <= width; i += kLanes) {
      const vfloat value = vload(g + i);
      // SiLU rounded to the dtype before the product, as act_fn(gate) * up rounds it.
      const vfloat activated = vround_as(g, vdiv(value, vadd(one, vexp(vmul(value, minus_one)))));
      vstore(o + i, vmul(activated, vload(u + i)));
    }
#endif
    for (; i < width; ++i) {
      const float value = static_cast<float>(g[i]);
      const scalar_t activated = static_cast<scalar_t>(value / (1.0f + std::exp(-value)));
      o[i] = static_cast<scalar_t>(static_cast<float>(activated) * static_cast<float>(u[i]));
    }
  }
}

// gate_up: [rows, 2 * width], gate then up (the fused gate/up product); out: [rows, width], contiguous.
void silu_and_mul(torch::Tensor gate_up, torch::Tensor out) {
  const int64_t width = out.size(-1);
  TORCH_CHECK(gate_up.is_contiguous() && out.is_contiguous() && gate_up.size(-1) == 2 * width
              && gate_up.numel() == 2 * out.numel() && gate_up.scalar_type() == out.scalar_type(),
              "silu_and_mul: a contiguous [rows, 2 * width] input and [rows, width] output of one dtype expected");
  const int64_t rows = width ? out.numel() / width : 0;
  if (out.scalar_type() == torch::kFloat32) {
    const float* base = gate_up.data_ptr<float>();
    silu_and_mul_rows<float>(base, base + width, 2 * width, out.data_ptr<float>(), rows, width);
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16, "silu_and_mul runs on float32 or bfloat16");
    const at::BFloat16* base = gate_up.data_ptr<at::BFloat16>();
    silu_and_mul_rows<at::BFloat16>(base, base + width, 2 * width, out.data_ptr<at::BFloat16>(), rows, width);
  }
}
"""

EXTENSION = NativeExtension("patchbay_fused_ops", SOURCE, ("rms_norm", "silu_and_mul"))
"""The kernels (SIMD registers where the CPU has AVX-512 or AVX2, plain loops elsewhere and for row tails)."""


@functools.cache
def load_fused_ops() -> Any:
    """Build the extension (once per installation and CPU) and import it."""
    return EXTENSION.load()


class FusedOpsBuild(BackgroundBuild):
    """:func:`load_fused_ops` in a background thread, shared by every model of the process."""

    _lock = threading.Lock()
    _shared: FusedOpsBuild | None = None

    def __init__(self) -> None:
        super().__init__(lambda: load_fused_ops(), "the C++ norm and activation kernels")

    @classmethod
    def shared(cls) -> FusedOpsBuild:
        """The one build of this process, started on first call."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared


def _reference_sources() -> tuple[str, str]:
    from transformers.models.llama import modeling_llama

    return inspect.getsource(modeling_llama.LlamaRMSNorm.forward), inspect.getsource(modeling_llama.LlamaMLP.forward)


@functools.cache
def _same_forward(cls: type, reference: int) -> bool:
    try:
        return inspect.getsource(cls.forward) == _reference_sources()[reference]
    except (OSError, TypeError):
        return False


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s class computes transformers' Llama RMS norm (its ``forward`` has the same source)."""
    return _same_forward(type(module), 0) and hasattr(module, "variance_epsilon")


def is_llama_silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (``down(act(gate(x)) * up(x))``) whose activation is SiLU."""
    act = getattr(module, "act_fn", None)
    return (_same_forward(type(module), 1) and isinstance(act, nn.Module)
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


class FusedRMSNorm:
    """The ``forward`` of one Llama-style RMS norm through the C++ kernel (its own ``forward`` until it is built)."""

    def __init__(self, module: nn.Module, build: BackgroundBuild) -> None:
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

    def __init__(self, module: nn.Module, build: BackgroundBuild) -> None:
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


@dataclass(frozen=True)
class FusedModules:
    """How many of a model's modules run through the fused kernels."""

    norms: int = 0
    mlps: int = 0


def use_fused_ops(model: nn.Module, *, device: torch.device, dtype: str,
                  build: BackgroundBuild | None = None) -> FusedModules:
    """Route ``model``'s Llama-style RMS norms and SiLU MLPs through the C++ kernels; say how many.

    Nothing changes off the CPU, for dtypes other than float32 and bfloat16, or where no extension can be
    built (no compiler); the build starts in the background (``build``: the process's shared one).
    """
    if device.type != "cpu" or getattr(torch, dtype) not in FUSED_DTYPES or build_unavailable() is not None:
        return FusedModules()
    build = build or FusedOpsBuild.shared()
    norms = mlps = 0
    for module in model.modules():
        if "forward" in vars(module):  # another path owns this module's forward already
            continue
        if is_llama_rms_norm(module) and module.weight.dtype in FUSED_DTYPES:
            module.forward = FusedRMSNorm(module, build)  # type: ignore[method-assign]
            norms += 1
        elif is_llama_silu_mlp(module) and module.gate_proj.out_features == module.up_proj.out_features:
            module.forward = FusedSiluMLP(module, build)  # type: ignore[method-assign]
            mlps += 1
    return FusedModules(norms, mlps)


def main() -> int:
    """Build the kernels now (the Makefile runs this at install time); exit 0 also where they cannot be built."""
    import logging
    import time

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = build_unavailable()
    if reason is not None:
        logging.info("the norm and activation kernels are not built: %s", reason)
        return 0
    started = time.perf_counter()
    load_fused_ops()
    logging.info("norm and activation kernels ready in %s (%.1f s)", EXTENSION.build_directory(),
                 time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
