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
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchbay.worker.forward_context import attend
from patchbay.worker.fused_projections import Member
from patchbay.worker.native_build import (
    NATIVE_CFLAGS,
    SIMD_HELPERS,
    BackgroundBuild,
    NativeExtension,
    build_at_install,
    build_unavailable,
)

FUSED_DTYPES = (torch.float32, torch.bfloat16)

SOURCE = SIMD_HELPERS + r"""
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#include <vector>

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

template <typename scalar_t>
void rotate_heads(const scalar_t* in, int64_t in_row_stride, const scalar_t* cos, const scalar_t* sin,
                  int64_t angle_stride, scalar_t* out, int64_t rows, int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2;
#pragma omp parallel for if (rows * heads * head_size >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* c = cos + r * angle_stride;
    const scalar_t* s = sin + r * angle_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* x = in + r * in_row_stride + h * head_size;
      scalar_t* o = out + (r * heads + h) * head_size;
      int64_t i = 0;
#ifdef PATCHBAY_SIMD
      if (half % kLanes == 0) {
        // Both halves at once: o[i] = x[i] cos[i] - x[i + half] sin[i], o[i + half] = x[i + half] cos[i + half]
        // + x[i] sin[i + half]; each product and the sum rounded to the dtype, as transformers' ops round them.
        for (; i < half; i += kLanes) {
          const vfloat low = vload(x + i), high = vload(x + half + i);
          const vfloat out_low = vround_as(x, vadd(vround_as(x, vmul(low, vload(c + i))),
                                                   vround_as(x, vmul(vmul(high, vbroadcast(-1.0f)), vload(s + i)))));
          const vfloat out_high = vround_as(x, vadd(vround_as(x, vmul(high, vload(c + half + i))),
                                                    vround_as(x, vmul(low, vload(s + half + i)))));
          vstore(o + i, out_low);
          vstore(o + half + i, out_high);
        }
      }
#endif
      for (; i < half; ++i) {
        const float low = static_cast<float>(x[i]), high = static_cast<float>(x[half + i]);
        const scalar_t a = static_cast<scalar_t>(low * static_cast<float>(c[i]));
        const scalar_t b = static_cast<scalar_t>(-high * static_cast<float>(s[i]));
        o[i] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
        const scalar_t d = static_cast<scalar_t>(high * static_cast<float>(c[half + i]));
        const scalar_t e = static_cast<scalar_t>(low * static_cast<float>(s[half + i]));
        o[half + i] = static_cast<scalar_t>(static_cast<float>(d) + static_cast<float>(e));
      }
    }
  }
}

template <typename scalar_t>
void rotate(const torch::Tensor& in, const torch::Tensor& cos, const torch::Tensor& sin, int64_t angle_stride,
            torch::Tensor& out) {
  const int64_t rows = out.size(0), heads = out.size(1), head_size = out.size(2);
  rotate_heads<scalar_t>(in.data_ptr<scalar_t>(), rows > 1 ? in.stride(0) : heads * head_size,
                         cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), angle_stride, out.data_ptr<scalar_t>(),
                         rows, heads, head_size);
}

// query, key: [rows, heads x head_size] with unit stride along the features (views of a fused q/k/v product do);
// cos, sin: [rows, head_size] (any leading shape) with unit stride along head_size; q_out: [rows, q_heads,
// head_size], k_out: [rows, kv_heads, head_size], contiguous: the queries and keys rotated as transformers'
// apply_rotary_pos_emb rotates them.
void rotary(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_out,
            torch::Tensor k_out) {
  const int64_t rows = q_out.size(0), head_size = q_out.size(2);
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 && key.stride(1) == 1
              && query.size(0) == rows && key.size(0) == rows && k_out.size(0) == rows
              && query.size(1) == q_out.size(1) * head_size && key.size(1) == k_out.size(1) * head_size
              && k_out.size(2) == head_size && head_size % 2 == 0 && q_out.is_contiguous() && k_out.is_contiguous(),
              "rotary: [rows, heads x head_size] queries and keys with unit feature stride, contiguous outputs");
  TORCH_CHECK(cos.size(-1) == head_size && sin.size(-1) == head_size && cos.stride(-1) == 1 && sin.stride(-1) == 1
              && cos.numel() == rows * head_size && sin.numel() == rows * head_size,
              "rotary: [rows, head_size] angles with unit stride along head_size");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype
              && q_out.scalar_type() == dtype && k_out.scalar_type() == dtype,
              "rotary: one dtype for queries, keys, angles and outputs");
  const auto cos_rows = cos.reshape({rows, head_size}), sin_rows = sin.reshape({rows, head_size});
  const int64_t angle_stride = rows > 1 ? cos_rows.stride(0) : head_size;
  TORCH_CHECK(rows <= 1 || sin_rows.stride(0) == angle_stride, "rotary: cos and sin with the same row stride");
  if (dtype == torch::kFloat32) {
    rotate<float>(query, cos_rows, sin_rows, angle_stride, q_out);
    rotate<float>(key, cos_rows, sin_rows, angle_stride, k_out);
  } else {
    TORCH_CHECK(dtype == torch::kBFloat16, "rotary runs on float32 or bfloat16");
    rotate<at::BFloat16>(query, cos_rows, sin_rows, angle_stride, q_out);
    rotate<at::BFloat16>(key, cos_rows, sin_rows, angle_stride, k_out);
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

// A tiled product, through the address patchbay.worker.streaming_linear.tiled_product_entry() hands out.
using TiledProduct = void (*)(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor* bias,
                              int64_t out_features, int64_t threads, torch::Tensor& out);

static torch::Tensor tiled(int64_t entry, const torch::Tensor& x, const torch::Tensor& tiles,
                           const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t threads) {
  torch::Tensor out;
  reinterpret_cast<TiledProduct>(entry)(x, tiles, bias.has_value() ? &*bias : nullptr, out_features, threads, out);
  return out;
}

// A Llama-style decoder layer over tiled weights, up to its attention: the input norm, the fused q/k/v product and
// the rotation of queries and keys.  hidden: [rows, width], contiguous; returns the rotated queries [rows, q_size /
// head_size, head_size] and keys [rows, k_size / head_size, head_size], and the values (a view of the product).
std::vector<torch::Tensor> decoder_attention_inputs(int64_t product, torch::Tensor hidden, torch::Tensor norm_weight,
                                                    double eps, torch::Tensor qkv_tiles,
                                                    c10::optional<torch::Tensor> qkv_bias, int64_t q_size,
                                                    int64_t k_size, int64_t v_size, torch::Tensor cos,
                                                    torch::Tensor sin, int64_t head_size, int64_t threads) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decoder_attention_inputs takes contiguous rows");
  auto normed = torch::empty_like(hidden);
  rms_norm(hidden, norm_weight, eps, normed);
  const auto qkv = tiled(product, normed, qkv_tiles, qkv_bias, q_size + k_size + v_size, threads);
  const int64_t rows = hidden.size(0);
  auto query = torch::empty({rows, q_size / head_size, head_size}, hidden.options());
  auto key = torch::empty({rows, k_size / head_size, head_size}, hidden.options());
  rotary(qkv.narrow(1, 0, q_size), qkv.narrow(1, q_size, k_size), cos, sin, query, key);
  return {query, key, qkv.narrow(1, q_size + k_size, v_size).view({rows, v_size / head_size, head_size})};
}

// The rest of the layer: the output projection and its residual add, the post-attention norm, the fused gate/up
// product, SiLU-and-multiply, the down projection and its residual add (the adds are torch's, rounding as the
// model's own).  attended: [rows, q_size]; hidden: the layer's input, [rows, width]; returns the layer's output.
torch::Tensor decoder_attention_output_and_mlp(int64_t product, torch::Tensor attended, torch::Tensor hidden,
                                               torch::Tensor o_tiles, c10::optional<torch::Tensor> o_bias,
                                               torch::Tensor norm_weight, double eps, torch::Tensor gate_up_tiles,
                                               c10::optional<torch::Tensor> gate_up_bias, int64_t intermediate,
                                               torch::Tensor down_tiles, c10::optional<torch::Tensor> down_bias,
                                               int64_t threads) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const auto residual = hidden + tiled(product, attended.contiguous(), o_tiles, o_bias, width, threads);
  auto normed = torch::empty_like(residual);
  rms_norm(residual, norm_weight, eps, normed);
  const auto gate_up = tiled(product, normed, gate_up_tiles, gate_up_bias, 2 * intermediate, threads);
  auto activated = torch::empty({rows, intermediate}, hidden.options());
  silu_and_mul(gate_up, activated);
  return residual + tiled(product, activated, down_tiles, down_bias, width, threads);
}
"""

EXTENSION = NativeExtension("patchbay_fused_ops", SOURCE,
                            ("rms_norm", "silu_and_mul", "rotary", "decoder_attention_inputs",
                             "decoder_attention_output_and_mlp"),
                            (*NATIVE_CFLAGS, "-ffp-contract=off"))
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


@functools.cache
def _reference_sources() -> tuple[str, str, str]:
    from transformers.models.llama import modeling_llama

    return (inspect.getsource(modeling_llama.LlamaRMSNorm.forward), inspect.getsource(modeling_llama.LlamaMLP.forward),
            inspect.getsource(modeling_llama.apply_rotary_pos_emb))


@functools.cache
def _attention_sources() -> frozenset[str]:
    """Sources of the attention ``forward`` methods known to project, rotate with ``apply_rotary_pos_emb`` and
    call the attention interface as Llama's does (Qwen2's and Mistral's also pass a ``sliding_window``, which
    patchbay's interface reads from the layer's spec instead)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    return frozenset(inspect.getsource(cls.forward) for cls in (
        modeling_llama.LlamaAttention, modeling_qwen2.Qwen2Attention, modeling_mistral.MistralAttention))


@functools.cache
def _same_forward(cls: type, reference: int) -> bool:
    try:
        return inspect.getsource(cls.forward) == _reference_sources()[reference]
    except (OSError, TypeError):
        return False


@functools.cache
def _llama_style_attention(cls: type) -> bool:
    try:
        module = sys.modules[cls.__module__]
        return (inspect.getsource(cls.forward) in _attention_sources()
                and inspect.getsource(module.apply_rotary_pos_emb) == _reference_sources()[2])
    except (OSError, TypeError, AttributeError, KeyError):
        return False


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s class computes transformers' Llama RMS norm (its ``forward`` has the same source)."""
    return _same_forward(type(module), 0) and hasattr(module, "variance_epsilon")


def is_llama_silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (``down(act(gate(x)) * up(x))``) whose activation is SiLU."""
    act = getattr(module, "act_fn", None)
    return (_same_forward(type(module), 1) and isinstance(act, nn.Module)
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def is_llama_style_attention(module: nn.Module) -> bool:
    """Whether ``module``'s class is Llama's, Qwen2's or Mistral's attention (the same ``forward`` source, and
    its module's ``apply_rotary_pos_emb`` the same as Llama's)."""
    return _llama_style_attention(type(module))


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


class FusedRopeAttention:
    """The ``forward`` of one Llama-style attention: the q/k/v products (one, where they are fused), one kernel
    rotating the queries and keys out of them, patchbay's attention, the output projection (its own ``forward``
    until the kernel is built, or for inputs it does not take)."""

    def __init__(self, module: nn.Module, build: BackgroundBuild) -> None:
        self.module = module
        self.build = build
        query = vars(module.q_proj).get("forward")
        self.group = query.group if isinstance(query, Member) else None
        self.head_size = int(module.head_dim)

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        ops = self.build.ready()
        module = self.module
        cos, sin = position_embeddings
        if (ops is None or kwargs.get("cache") is not None or cos.dtype != hidden_states.dtype
                or sin.dtype != hidden_states.dtype):
            return type(module).forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if self.group is not None:
            q_size, k_size, _ = self.group.sizes
            qkv = self.group.product(hidden_states, self.group.weight, self.group.bias).reshape(tokens, -1)
            q_rows, k_rows, v_rows = qkv[:, :q_size], qkv[:, q_size:q_size + k_size], qkv[:, q_size + k_size:]
        else:
            q_rows, k_rows, v_rows = (projection(hidden_states).reshape(tokens, -1)
                                      for projection in (module.q_proj, module.k_proj, module.v_proj))
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
    (:mod:`patchbay.worker.fused_layer`)."""


def use_fused_ops(model: nn.Module, *, device: torch.device, dtype: str,
                  build: BackgroundBuild | None = None) -> FusedModules:
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
            module.forward = FusedRMSNorm(module, build)  # type: ignore[method-assign]
            norms += 1
        elif is_llama_silu_mlp(module) and module.gate_proj.out_features == module.up_proj.out_features:
            module.forward = FusedSiluMLP(module, build)  # type: ignore[method-assign]
            mlps += 1
        elif is_llama_style_attention(module):
            module.forward = FusedRopeAttention(module, build)  # type: ignore[method-assign]
            attentions += 1
    return FusedModules(norms, mlps, attentions)


def main() -> int:
    """Build the kernels now (the Makefile runs this at install time); exit 0 also where they cannot be built."""
    return build_at_install(load_fused_ops, "the norm, activation and rotary kernels", EXTENSION.build_directory)


if __name__ == "__main__":
    raise SystemExit(main())
