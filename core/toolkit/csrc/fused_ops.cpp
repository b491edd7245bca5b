// RMS norms, SiLU- and GELU-and-multiply, rotary embeddings and whole decoder layers as single kernels
// (patchbay.worker.cpu.fused_ops, patchbay.worker.cpu.fused_layer).
#include <torch/extension.h>
#include "simd.h"
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

// Rows below this many elements in all run on the calling thread: waking OpenMP's sleeping threads costs more.
constexpr int64_t kParallelElements = 1 << 16;
// Within a fused decoder layer, ops of at least this many elements share the products' helpers, which are awake.
constexpr int64_t kPoolElements = 1 << 15;

// The products' helper pool (patchbay.toolkit.tiles.chunk_runner): runs work(context, i) for every
// i in [0, chunks) on up to `threads` threads and returns when all are done.
using RunChunks = void (*)(int threads, int64_t chunks, void (*work)(const void*, int64_t), const void* context);

// Where the row loops of an op run: over OpenMP's threads (no pool, the standalone ops; only for many elements,
// since waking OpenMP's sleeping threads costs tens of microseconds), or on the products' helpers.
struct RowRunner {
  RunChunks pool = nullptr;
  int threads = 1;

  // f(begin, end) over [0, rows) in contiguous ranges; `row_elements` sizes the work to decide whether to split.
  template <typename F>
  void run(int64_t rows, int64_t row_elements, const F& f) const {
    const int64_t elements = rows * row_elements;
    if (pool == nullptr) {
      if (elements < kParallelElements) return f(int64_t{0}, rows);
#pragma omp parallel for
      for (int64_t r = 0; r < rows; ++r) f(r, r + 1);
      return;
    }
    if (threads <= 1 || elements < kPoolElements || rows < 2) return f(int64_t{0}, rows);
    const int64_t chunks = std::min<int64_t>(rows, 4 * threads);
    const auto chunk = [&](int64_t i) { f(rows * i / chunks, rows * (i + 1) / chunks); };
    pool(threads, chunks, [](const void* context, int64_t i) { (*static_cast<const decltype(chunk)*>(context))(i); },
         &chunk);
  }
};

static RowRunner pool_runner(int64_t chunk_runner, int64_t threads) {
  return RowRunner{reinterpret_cast<RunChunks>(chunk_runner), static_cast<int>(std::max<int64_t>(threads, 1))};
}

// A weight of the rows' dtype multiplies the normalized row rounded to that dtype (Llama's norm); a float32 weight
// of bfloat16 rows multiplies the float32 normalized row, rounded once after (Gemma's, given 1 + its weight).
template <typename scalar_t, typename weight_t>
void rms_norm_rows(const scalar_t* x, int64_t x_row_stride, const weight_t* weight, scalar_t* out, int64_t rows,
                   int64_t hidden, float eps, const RowRunner& runner) {
  constexpr bool round_first = std::is_same_v<scalar_t, weight_t>;
  runner.run(rows, hidden, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
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
        // Rounded to the input's dtype before a weight of that dtype multiplies it, as transformers does.
        vfloat normalized = vmul(vload(row + i), scale);
        if constexpr (round_first) normalized = vround_as(row, normalized);
        vstore(o + i, vmul(vload(weight + i), normalized));
      }
#endif
      for (; i < hidden; ++i) {
        float normalized = static_cast<float>(row[i]) * inverse;
        if constexpr (round_first) normalized = static_cast<float>(static_cast<scalar_t>(normalized));
        o[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * normalized);
      }
    }
  });
}

// x: [..., hidden] with unit stride along hidden and equal row strides; weight: [hidden], of x's dtype or (for
// bfloat16 rows) float32; out: contiguous.
static void rms_norm_on(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& out,
                        const RowRunner& runner) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous() && out.is_contiguous() && weight.numel() == hidden
              && out.numel() == x.numel(), "rms_norm: unit-stride rows, a contiguous weight of the row's size and "
              "a contiguous output of the input's size expected");
  TORCH_CHECK((x.scalar_type() == weight.scalar_type() || weight.scalar_type() == torch::kFloat32)
              && x.scalar_type() == out.scalar_type(),
              "rms_norm: one dtype for input and output, and a weight of that dtype or float32");
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  const auto flat = x.reshape({rows, hidden});  // a view for transformers' [1, tokens, hidden] hidden states
  const int64_t row_stride = rows > 1 ? flat.stride(0) : hidden;
  if (x.scalar_type() == torch::kFloat32) {
    rms_norm_rows<float, float>(flat.data_ptr<float>(), row_stride, weight.data_ptr<float>(), out.data_ptr<float>(),
                                rows, hidden, static_cast<float>(eps), runner);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm runs on float32 or bfloat16");
    if (weight.scalar_type() == torch::kFloat32) {
      rms_norm_rows<at::BFloat16, float>(flat.data_ptr<at::BFloat16>(), row_stride, weight.data_ptr<float>(),
                                         out.data_ptr<at::BFloat16>(), rows, hidden, static_cast<float>(eps), runner);
    } else {
      rms_norm_rows<at::BFloat16, at::BFloat16>(flat.data_ptr<at::BFloat16>(), row_stride,
                                                weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows,
                                                hidden, static_cast<float>(eps), runner);
    }
  }
}

void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  rms_norm_on(x, weight, eps, out, RowRunner{});
}

// The activations of gated MLPs (act(gate) * up), on float32 registers and scalars.
struct SiluGate {
#ifdef PATCHBAY_SIMD
  static vfloat apply(vfloat x) { return vdiv(x, vadd(vbroadcast(1.0f), vexp(vmul(x, vbroadcast(-1.0f))))); }
#endif
  static float apply(float x) { return x / (1.0f + std::exp(-x)); }
};

// GELU's tanh approximation (Gemma's gelu_pytorch_tanh): x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).  The
// vector tanh(y) is sign(y) (1 - 2 / (e^(2|y|) + 1)): near -1 it rounds as a float tanh does, so 1 + tanh loses the
// same digits as torch's (e^(2|y|) is clamped: +-1 at the ends).
struct GeluTanhGate {
  static constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
#ifdef PATCHBAY_SIMD
  static vfloat apply(vfloat x) {
    const vfloat one = vbroadcast(1.0f);
    const vfloat inner = vmul(vbroadcast(kBeta), vfma(vmul(vbroadcast(kKappa), vmul(x, x)), x, x));
    const vfloat magnitude = vmax(inner, vmul(inner, vbroadcast(-1.0f)));
    const vfloat sign = vdiv(inner, vmax(magnitude, vbroadcast(1e-30f)));  // +-1 (0 where tanh is 0 anyway)
    const vfloat e = vexp(vadd(magnitude, magnitude));
    const vfloat tanh = vmul(sign, vadd(one, vdiv(vbroadcast(-2.0f), vadd(e, one))));
    return vmul(vmul(vbroadcast(0.5f), x), vadd(one, tanh));
  }
#endif
  static float apply(float x) { return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))); }
};

template <typename Gate, typename scalar_t>
void gated_and_mul_rows(const scalar_t* gate, const scalar_t* up, int64_t in_row_stride, scalar_t* out, int64_t rows,
                        int64_t width, const RowRunner& runner) {
  runner.run(rows, width, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate + r * in_row_stride;
      const scalar_t* u = up + r * in_row_stride;
      scalar_t* o = out + r * width;
      int64_t i = 0;
#ifdef PATCHBAY_SIMD
      for (; i + kLanes <= width; i += kLanes) {
        // The activation rounded to the dtype before the product, as act_fn(gate) * up rounds it.
        const vfloat activated = vround_as(g, Gate::apply(vload(g + i)));
        vstore(o + i, vmul(activated, vload(u + i)));
      }
#endif
      for (; i < width; ++i) {
        const scalar_t activated = static_cast<scalar_t>(Gate::apply(static_cast<float>(g[i])));
        o[i] = static_cast<scalar_t>(static_cast<float>(activated) * static_cast<float>(u[i]));
      }
    }
  });
}

template <typename scalar_t>
void rotate_heads(const scalar_t* in, int64_t in_row_stride, const scalar_t* cos, const scalar_t* sin,
                  int64_t angle_stride, scalar_t* out, int64_t rows, int64_t heads, int64_t head_size,
                  const RowRunner& runner) {
  const int64_t half = head_size / 2;
  runner.run(rows, heads * head_size, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
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
  });
}

template <typename scalar_t>
void rotate(const torch::Tensor& in, const torch::Tensor& cos, const torch::Tensor& sin, int64_t angle_stride,
            const torch::Tensor& out, const RowRunner& runner) {
  const int64_t rows = out.size(0), heads = out.size(1), head_size = out.size(2);
  rotate_heads<scalar_t>(in.data_ptr<scalar_t>(), rows > 1 ? in.stride(0) : heads * head_size,
                         cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), angle_stride, out.data_ptr<scalar_t>(),
                         rows, heads, head_size, runner);
}

// query, key: [rows, heads x head_size] with unit stride along the features (views of a fused q/k/v product do);
// cos, sin: [rows, head_size] (any leading shape) with unit stride along head_size; q_out: [rows, q_heads,
// head_size], k_out: [rows, kv_heads, head_size], contiguous: the queries and keys rotated as transformers'
// apply_rotary_pos_emb rotates them.
static void rotary_on(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& cos,
                      const torch::Tensor& sin, const torch::Tensor& q_out, const torch::Tensor& k_out,
                      const RowRunner& runner) {
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
    rotate<float>(query, cos_rows, sin_rows, angle_stride, q_out, runner);
    rotate<float>(key, cos_rows, sin_rows, angle_stride, k_out, runner);
  } else {
    TORCH_CHECK(dtype == torch::kBFloat16, "rotary runs on float32 or bfloat16");
    rotate<at::BFloat16>(query, cos_rows, sin_rows, angle_stride, q_out, runner);
    rotate<at::BFloat16>(key, cos_rows, sin_rows, angle_stride, k_out, runner);
  }
}

void rotary(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_out,
            torch::Tensor k_out) {
  rotary_on(query, key, cos, sin, q_out, k_out, RowRunner{});
}

// gate_up: [rows, 2 * width], gate then up (the fused gate/up product); out: [rows, width], contiguous.
template <typename Gate>
static void gated_and_mul_on(const torch::Tensor& gate_up, const torch::Tensor& out, const RowRunner& runner) {
  const int64_t width = out.size(-1);
  TORCH_CHECK(gate_up.is_contiguous() && out.is_contiguous() && gate_up.size(-1) == 2 * width
              && gate_up.numel() == 2 * out.numel() && gate_up.scalar_type() == out.scalar_type(),
              "gated MLP activation: a contiguous [rows, 2 * width] input and [rows, width] output of one dtype "
              "expected");
  const int64_t rows = width ? out.numel() / width : 0;
  if (out.scalar_type() == torch::kFloat32) {
    const float* base = gate_up.data_ptr<float>();
    gated_and_mul_rows<Gate, float>(base, base + width, 2 * width, out.data_ptr<float>(), rows, width, runner);
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16, "gated MLP activations run on float32 or bfloat16");
    const at::BFloat16* base = gate_up.data_ptr<at::BFloat16>();
    gated_and_mul_rows<Gate, at::BFloat16>(base, base + width, 2 * width, out.data_ptr<at::BFloat16>(), rows, width,
                                           runner);
  }
}

void silu_and_mul(torch::Tensor gate_up, torch::Tensor out) { gated_and_mul_on<SiluGate>(gate_up, out, RowRunner{}); }

void gelu_tanh_and_mul(torch::Tensor gate_up, torch::Tensor out) {
  gated_and_mul_on<GeluTanhGate>(gate_up, out, RowRunner{});
}

// a + b for contiguous [rows, width] tensors of one dtype, rounded once to it as torch's add rounds.
template <typename scalar_t>
static void add_rows(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t rows, int64_t width,
                     const RowRunner& runner) {
  runner.run(rows, width, [&](int64_t begin, int64_t end) {
    int64_t i = begin * width;
    const int64_t stop = end * width;
#ifdef PATCHBAY_SIMD
    for (; i + kLanes <= stop; i += kLanes) vstore(out + i, vadd(vload(a + i), vload(b + i)));
#endif
    for (; i < stop; ++i) out[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  });
}

static torch::Tensor add_on(const torch::Tensor& a, const torch::Tensor& b, const RowRunner& runner) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && a.sizes() == b.sizes()
              && a.scalar_type() == b.scalar_type(), "add: two contiguous [rows, width] tensors of one dtype");
  auto out = torch::empty_like(a);
  if (a.scalar_type() == torch::kFloat32) {
    add_rows<float>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.size(0), a.size(1), runner);
  } else {
    TORCH_CHECK(a.scalar_type() == torch::kBFloat16, "add runs on float32 or bfloat16");
    add_rows<at::BFloat16>(a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                           a.size(0), a.size(1), runner);
  }
  return out;
}

// Per row of x ([rows, n], contiguous) the index of its largest element (the first where several tie), or of
// its first NaN where it has one: torch.argmax's answer, without its reduction machinery (~10x slower on a
// batch's logits).  One vector pass finds the row's largest value and whether it holds a NaN, a second the
// first element equal to the one wanted.
#ifdef PATCHBAY_SIMD
#if defined(__AVX512F__)
static inline uint32_t lanes_unordered(vfloat v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
static inline uint32_t lanes_equal(vfloat v, vfloat w) { return _mm512_cmp_ps_mask(v, w, _CMP_EQ_OQ); }
#else
static inline uint32_t lanes_unordered(vfloat v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
static inline uint32_t lanes_equal(vfloat v, vfloat w) { return _mm256_movemask_ps(_mm256_cmp_ps(v, w, _CMP_EQ_OQ)); }
#endif
#endif

template <typename scalar_t>
static int64_t first_index(const scalar_t* x, int64_t n, float wanted, bool nan) {
  int64_t i = 0;
#ifdef PATCHBAY_SIMD
  const vfloat target = vbroadcast(wanted);
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = vload(x + i);
    const uint32_t hits = nan ? lanes_unordered(v) : lanes_equal(v, target);
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (nan ? std::isnan(v) : v == wanted) return i;
  }
  return 0;  // n == 0: torch refuses; the caller checks
}

template <typename scalar_t>
static int64_t row_argmax(const scalar_t* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#ifdef PATCHBAY_SIMD
  vfloat top = vbroadcast(-INFINITY);
  uint32_t unordered = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = vload(x + i);
    unordered |= lanes_unordered(v);
    top = vmax(v, top);  // a NaN in v keeps top's lane
  }
  alignas(64) float lanes[kLanes];
  vstore(lanes, top);
  for (int j = 0; j < kLanes; ++j) best = std::max(best, lanes[j]);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    nan = nan || std::isnan(v);
    best = std::max(best, v);
  }
  return first_index(x, n, best, nan);
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: contiguous [rows, n > 0] input");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == torch::kFloat32) {
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(x.data_ptr<float>() + r * n, n);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "argmax_rows runs on float32 or bfloat16");
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(x.data_ptr<at::BFloat16>() + r * n, n);
  }
  return out;
}

// One token per row of non-negative weights, by inverse transform sampling: the row's first token whose
// cumulative weight exceeds u times the row's total, for the row's uniform u in [0, 1).  A token of weight 0
// is never chosen.  The weights are summed in float64, in blocks of kCdfBlock: the total is the blocks' sums
// added in order, and the search adds the same sums in the same order, so it finds the block where the
// cumulative weight passes the target and walks only that block token by token.  Where rounding walks past a
// block's end (or u * total rounds up to the total), the last token of positive weight is the one drawn; a
// row of zeros draws its last token.
constexpr int64_t kCdfBlock = 64;

static double weight_sum(const float* w, int64_t n) {
  constexpr int kPartials = 16;  // two vectors of doubles: the adds do not wait on each other
  double partial[kPartials] = {};
  int64_t i = 0;
  for (; i + kPartials <= n; i += kPartials)
    for (int lane = 0; lane < kPartials; ++lane) partial[lane] += w[i + lane];
  double sum = 0.0;
  for (int lane = 0; lane < kPartials; ++lane) sum += partial[lane];
  for (; i < n; ++i) sum += w[i];
  return sum;
}

static int64_t last_positive(const float* w, int64_t begin, int64_t end, int64_t otherwise) {
  for (int64_t i = end - 1; i >= begin; --i)
    if (w[i] > 0.0f) return i;
  return otherwise;
}

static int64_t row_inverse_cdf(const float* w, int64_t n, double u, std::vector<double>& block_sums) {
  const int64_t blocks = (n + kCdfBlock - 1) / kCdfBlock;
  block_sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    block_sums[b] = weight_sum(w + b * kCdfBlock, std::min(kCdfBlock, n - b * kCdfBlock));
    total += block_sums[b];
  }
  const double target = u * total;
  double before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + block_sums[b] <= target) {
      before += block_sums[b];
      continue;
    }
    const int64_t begin = b * kCdfBlock, end = std::min(n, begin + kCdfBlock);
    double running = before;
    for (int64_t i = begin; i < end; ++i) {
      if (w[i] <= 0.0f) continue;
      running += w[i];
      if (running > target) return i;
    }
    return last_positive(w, begin, end, n - 1);
  }
  return last_positive(w, 0, n, n - 1);
}

torch::Tensor inverse_cdf_rows(torch::Tensor weights, torch::Tensor uniform) {
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && weights.size(1) > 0 &&
                  weights.scalar_type() == torch::kFloat32,
              "inverse_cdf_rows: contiguous float32 [rows, n > 0] weights");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == weights.size(0) && uniform.scalar_type() == torch::kFloat64,
              "inverse_cdf_rows: one float64 uniform per row");
  const int64_t rows = weights.size(0), n = weights.size(1);
  auto out = torch::empty({rows}, weights.options().dtype(torch::kInt64));
  const auto u = uniform.contiguous();
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<double> block_sums;
  for (int64_t r = 0; r < rows; ++r)
    o[r] = row_inverse_cdf(weights.data_ptr<float>() + r * n, n, u.data_ptr<double>()[r], block_sums);
  return out;
}

// A tiled product, through the address patchbay.toolkit.tiles.tiled_product_entry() hands out.
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
// Both layer calls run the ops between their products on the products' helpers (chunk_runner: the helpers' entry
// point, patchbay.toolkit.tiles.chunk_runner(); 0: on this thread): OpenMP's threads would have to be woken for each.
std::vector<torch::Tensor> decoder_attention_inputs(int64_t product, int64_t chunk_runner, torch::Tensor hidden,
                                                    torch::Tensor norm_weight, double eps, torch::Tensor qkv_tiles,
                                                    c10::optional<torch::Tensor> qkv_bias, int64_t q_size,
                                                    int64_t k_size, int64_t v_size, torch::Tensor cos,
                                                    torch::Tensor sin, int64_t head_size, int64_t threads) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decoder_attention_inputs takes contiguous rows");
  const RowRunner runner = pool_runner(chunk_runner, threads);
  auto normed = torch::empty_like(hidden);
  rms_norm_on(hidden, norm_weight, eps, normed, runner);
  const auto qkv = tiled(product, normed, qkv_tiles, qkv_bias, q_size + k_size + v_size, threads);
  const int64_t rows = hidden.size(0);
  auto query = torch::empty({rows, q_size / head_size, head_size}, hidden.options());
  auto key = torch::empty({rows, k_size / head_size, head_size}, hidden.options());
  rotary_on(qkv.narrow(1, 0, q_size), qkv.narrow(1, q_size, k_size), cos, sin, query, key, runner);
  return {query, key, qkv.narrow(1, q_size + k_size, v_size).view({rows, v_size / head_size, head_size})};
}

// The rest of the layer: the output projection and its residual add, the post-attention norm, the fused gate/up
// product, SiLU-and-multiply, the down projection and its residual add (each add rounds once to the dtype, as
// the model's own torch adds do).  attended: [rows, q_size]; hidden: the layer's input, [rows, width]; returns
// the layer's output.
torch::Tensor decoder_attention_output_and_mlp(int64_t product, int64_t chunk_runner, torch::Tensor attended,
                                               torch::Tensor hidden, torch::Tensor o_tiles,
                                               c10::optional<torch::Tensor> o_bias, torch::Tensor norm_weight,
                                               double eps, torch::Tensor gate_up_tiles,
                                               c10::optional<torch::Tensor> gate_up_bias, int64_t intermediate,
                                               torch::Tensor down_tiles, c10::optional<torch::Tensor> down_bias,
                                               int64_t threads) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const RowRunner runner = pool_runner(chunk_runner, threads);
  const auto residual = add_on(hidden, tiled(product, attended.contiguous(), o_tiles, o_bias, width, threads), runner);
  auto normed = torch::empty_like(residual);
  rms_norm_on(residual, norm_weight, eps, normed, runner);
  const auto gate_up = tiled(product, normed, gate_up_tiles, gate_up_bias, 2 * intermediate, threads);
  auto activated = torch::empty({rows, intermediate}, hidden.options());
  gated_and_mul_on<SiluGate>(gate_up, activated, runner);
  return add_on(residual, tiled(product, activated, down_tiles, down_bias, width, threads), runner);
}

// The kernels run without the GIL: a server's asyncio thread streams while the engine thread is in them
// (docs/design/cpu-fast-paths.md#kernels-and-the-gil).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function_no_gil(rms_norm), "rms_norm");
  m.def("silu_and_mul", torch::wrap_pybind_function_no_gil(silu_and_mul), "silu_and_mul");
  m.def("gelu_tanh_and_mul", torch::wrap_pybind_function_no_gil(gelu_tanh_and_mul), "gelu_tanh_and_mul");
  m.def("rotary", torch::wrap_pybind_function_no_gil(rotary), "rotary");
  m.def("argmax_rows", torch::wrap_pybind_function_no_gil(argmax_rows), "argmax_rows");
  m.def("inverse_cdf_rows", torch::wrap_pybind_function_no_gil(inverse_cdf_rows), "inverse_cdf_rows");
  m.def("decoder_attention_inputs", torch::wrap_pybind_function_no_gil(decoder_attention_inputs),
        "decoder_attention_inputs");
  m.def("decoder_attention_output_and_mlp", torch::wrap_pybind_function_no_gil(decoder_attention_output_and_mlp),
        "decoder_attention_output_and_mlp");
}
