// Fused elementwise layers of a decoder for x86/ARM CPUs, float32: one pass over each row where PyTorch's
// eager ops make several (a norm is a square, a mean, an rsqrt and two products; SwiGLU is a sigmoid, two
// products and a copy; rotary embeddings are two gathers, a concatenation, two products and a sum).
//
// Registered as the Torch ops `batchinfer_cpu::rms_norm`, `batchinfer_cpu::add_rms_norm`,
// `batchinfer_cpu::silu_and_mul` and `batchinfer_cpu::rotary_embedding_` (built and loaded by
// cpu_extension.py). Rows are split across torch's threads with at::parallel_for.
//
// Batch invariant: every output row is a fixed sequence of float operations on its own input row (the
// sum of squares has a fixed lane structure, element i in lane i % 16), whatever the other rows of the
// call or the thread that runs it (docs/engine.md, "Batch-invariant numerics").
//
// bfloat16 (the decoder ops): each row is widened to float32 exactly into a per-thread row buffer, computed by the
// very float32 row code above, and each result rounded to bfloat16 once (nearest even, as torch's float-to-bfloat16
// conversion), so the results are bit for bit those of widening the whole tensor, the float32 op and `.to(bf16)`,
// without the two whole-tensor copies and their allocations (a 2048-row prefill chunk's gate_up is 12 MiB).
//
// Methods: RMSNorm, Zhang & Sennrich 2019 (Hugging Face's order: x * rsqrt(mean(x^2) + eps), then the
// weight); SwiGLU, Shazeer 2020 (silu(gate) * up); rotary embeddings, Su et al. 2021, "rotate half" layout.

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_exp.h"
#include "cpu_lanes.h"
#include "cpu_q4_bf16.h"

namespace {

using batchinfer_kernels::exp_clamped;
using batchinfer_kernels::lane_sum;
using batchinfer_kernels::load8;
using batchinfer_kernels::round_bf16;
using batchinfer_kernels::store8;
using batchinfer_kernels::vec16;
using batchinfer_kernels::vec8;
using batchinfer_kernels::widen_bf16;

constexpr int64_t kLanes = 16;

inline void widen_row(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen_bf16(src[i]);
}

inline void round_row(const float* __restrict src, int64_t n, uint16_t* __restrict dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
}

inline bool is_bf16(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16; }

inline uint16_t* bf16_ptr(const at::Tensor& x) { return reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()); }

// sum of x[i]^2 with kLanes partial sums (element i in lane i % kLanes), added lane by lane.
inline float sum_of_squares(const float* __restrict x, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += x[i + l] * x[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) partial[l] += x[i + l] * x[i + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

// out = x * rsqrt(mean(x^2) + eps) * w, with w = weight (Llama) or 1 + weight (Gemma's unit offset).
inline void rms_norm_row(const float* __restrict x, const float* __restrict weight, int64_t n, float eps,
                         bool unit_offset, float* __restrict out) {
  const float inv_rms = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv_rms) * (1.0f + weight[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1, name,
              " must be a float32 CPU tensor [num_rows, width] with unit stride in its last dimension");
}

// check_rows for the decoder ops, which also take bfloat16.
void check_rows_any(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || is_bf16(x)) && x.device().is_cpu() && x.stride(1) == 1,
              name, " must be a float32 or bfloat16 CPU tensor [num_rows, width] with unit stride in its last dimension");
}

void check_weight(const at::Tensor& weight, int64_t n) {
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == n && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.device().is_cpu(),
              "weight must be a contiguous float32 CPU tensor [", n, "]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_rows_any(x, "x");
  const int64_t M = x.size(0), n = x.size(1);
  check_weight(weight, n);
  at::Tensor out = at::empty({M, n}, x.options());
  if (is_bf16(x)) {
    const uint16_t* xp = bf16_ptr(x);
    const float* wp = weight.data_ptr<float>();
    uint16_t* op = bf16_ptr(out);
    const int64_t ldx = x.stride(0);
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(2 * n);
      for (int64_t r = r0; r < r1; ++r) {
        widen_row(xp + r * ldx, n, buf.data());
        rms_norm_row(buf.data(), wp, n, static_cast<float>(eps), unit_offset, buf.data() + n);
        round_row(buf.data() + n, n, op + r * n);
      }
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * ldx, wp, n, static_cast<float>(eps), unit_offset, op + r * n);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps, bool unit_offset) {
  check_rows_any(x, "x");
  check_rows_any(delta, "delta");
  const int64_t M = x.size(0), n = x.size(1);
  TORCH_CHECK(delta.size(0) == M && delta.size(1) == n, "delta must have x's shape");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type(), "delta must have x's dtype");
  check_weight(weight, n);
  at::Tensor sum = at::empty({M, n}, x.options());
  at::Tensor out = at::empty({M, n}, x.options());
  if (is_bf16(x)) {
    // NOTE: the norm reads the float32 sum, not the rounded one (as the float32 op on widened inputs does).
    const uint16_t* xp = bf16_ptr(x);
    const uint16_t* dp = bf16_ptr(delta);
    const float* wp = weight.data_ptr<float>();
    uint16_t* sp = bf16_ptr(sum);
    uint16_t* op = bf16_ptr(out);
    const int64_t ldx = x.stride(0), ldd = delta.stride(0);
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(4 * n);
      float* __restrict a = buf.data();
      float* __restrict b = a + n;
      float* __restrict s = b + n;
      float* __restrict o = s + n;
      for (int64_t r = r0; r < r1; ++r) {
        widen_row(xp + r * ldx, n, a);
        widen_row(dp + r * ldd, n, b);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) s[i] = a[i] + b[i];
        rms_norm_row(s, wp, n, static_cast<float>(eps), unit_offset, o);
        round_row(s, n, sp + r * n);
        round_row(o, n, op + r * n);
      }
    });
    return {sum, out};
  }
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldd = delta.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict a = xp + r * ldx;
      const float* __restrict b = dp + r * ldd;
      float* __restrict s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = a[i] + b[i];
      rms_norm_row(s, wp, n, static_cast<float>(eps), unit_offset, op + r * n);
    }
  });
  return {sum, out};
}

// o = silu(gate) * up over one row of `width` elements.
inline void silu_and_mul_row(const float* __restrict gate, const float* __restrict up, int64_t width,
                             float* __restrict o) {
  // vec8, not `omp simd`: cpu_exp.h says why.
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const vec8 g = load8(gate + i);
    store8(o + i, g / (1.0f + exp_clamped(-g)) * load8(up + i));
  }
  for (; i < width; ++i) o[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows_any(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width, "gate_up must have an even width (gate, then up)");
  at::Tensor out = at::empty({M, width}, gate_up.options());
  const int64_t ld = gate_up.stride(0);
  if (is_bf16(gate_up)) {
    const uint16_t* gp = bf16_ptr(gate_up);
    uint16_t* op = bf16_ptr(out);
    at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(3 * width);
      for (int64_t r = r0; r < r1; ++r) {
        widen_row(gp + r * ld, 2 * width, buf.data());
        silu_and_mul_row(buf.data(), buf.data() + width, width, buf.data() + 2 * width);
        round_row(buf.data() + 2 * width, width, op + r * width);
      }
    });
    return out;
  }
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_and_mul_row(gp + r * ld, gp + r * ld + width, width, op + r * width);
  });
  return out;
}

// LayerNorm (Ba et al. 2016) of s = x + delta (+ bias) for one row, as torch's layer_norm: mean, then the
// biased variance of (s - mean), out = (s - mean) * rsqrt(var + eps) * weight + beta. Both sums have the
// fixed lane structure of lane_sum (cpu_lanes.h) and sum_of_squares. s is written to `out` first, then normalised in place.
inline void add_layer_norm_row(const float* __restrict x, const float* __restrict delta, const float* __restrict bias,
                               const float* __restrict weight, const float* __restrict beta, int64_t n, float eps,
                               float* __restrict out) {
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + delta[i] + bias[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + delta[i];
  }
  const float mean = lane_sum(out, n) / static_cast<float>(n);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] -= mean;
  const float inv_std = 1.0f / std::sqrt(sum_of_squares(out, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = out[j] * inv_std * weight[j] + beta[j];
}

at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& delta, const std::optional<at::Tensor>& bias,
                          const at::Tensor& weight, const at::Tensor& beta, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  const int64_t M = x.size(0), n = x.size(1);
  TORCH_CHECK(delta.size(0) == M && delta.size(1) == n, "delta must have x's shape");
  check_weight(weight, n);
  check_weight(beta, n);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_weight(*bias, n);
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* betap = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldd = delta.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      add_layer_norm_row(xp + r * ldx, dp + r * ldd, bp, wp, betap, n, static_cast<float>(eps), op + r * n);
    }
  });
  return out;
}

// erf by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7), the approximation of torch's vectorised
// erf: erf(|x|) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2), t = 1 / (1 + p |x|), odd in x.
// V is vec8 or vec16 (a whole AVX-512 register); the operations per lane are the same.
// 1 / d for d >= 1: the hardware estimate refined by one Newton step (relative error about 1e-7 with
// AVX-512's 14-bit estimate, 5e-7 with AVX's 12-bit one), a few cycles where a division takes ten or more.
inline vec16 reciprocal(vec16 d) {
#if defined(__AVX512F__)
  const vec16 r = reinterpret_cast<vec16>(_mm512_rcp14_ps(reinterpret_cast<__m512>(d)));
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

inline vec8 reciprocal(vec8 d) {
#if defined(__AVX2__)
  const vec8 r = reinterpret_cast<vec8>(_mm256_rcp_ps(reinterpret_cast<__m256>(d)));
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

template <typename V>
inline V erf_as(V x) {
  const V ax = x < 0.0f ? -x : x;
  const V t = reciprocal(0.3275911f * ax + 1.0f);
  V r = 1.061405429f * t + -1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t + -0.284496736f;
  r = r * t + 0.254829592f;
  const V y = 1.0f - r * t * exp_clamped(-(x * x));
  return x < 0.0f ? -y : y;
}

template <typename V>
inline void bias_gelu_row(float* __restrict row, const float* __restrict bias, int64_t n) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  for (int64_t i = 0; i < n; i += kWidth) {
    V v, b;
    std::memcpy(&v, row + i, sizeof(V));
    std::memcpy(&b, bias + i, sizeof(V));
    v += b;
    v = 0.5f * v * (1.0f + erf_as(v * 0.70710678118654752f));
    std::memcpy(row + i, &v, sizeof(V));
  }
}

// x = gelu(x + bias) in place, the exact (erf) GELU of BERT (Hendrycks & Gimpel 2016): 0.5 v (1 + erf(v / sqrt 2)).
void bias_gelu_(const at::Tensor& x, const at::Tensor& bias) {
  check_rows(x, "x");
  const int64_t M = x.size(0), n = x.size(1);
  check_weight(bias, n);
  TORCH_CHECK(n % 8 == 0, "bias_gelu_ needs a width that is a multiple of 8, got ", n);
  float* xp = x.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if defined(__AVX512F__)
      if (n % 16 == 0) {
        bias_gelu_row<vec16>(xp + r * ldx, bp, n);
        continue;
      }
#endif
      bias_gelu_row<vec8>(xp + r * ldx, bp, n);
    }
  });
}

// x[t, h, :] rotated in place by its token's row of the cos/sin tables ("rotate half": the first half of
// the head pairs with the second): x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin.
inline void rotate_head(float* __restrict v, const float* __restrict c, const float* __restrict s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c[i] + (-x2) * s[i];
    v[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

void rotary_embedding_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  const bool bf16 = is_bf16(x);
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || bf16) && x.device().is_cpu() && x.stride(2) == 1,
              "x must be a float32 or bfloat16 CPU tensor [num_tokens, num_heads, head_size] with unit stride in its "
              "last dimension");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_size must be even");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
              "positions must be int64 [num_tokens]");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->dim() == 2 && table->size(1) == D && table->scalar_type() == x.scalar_type() &&
                    table->is_contiguous() && table->device().is_cpu(),
                "cos and sin must be contiguous CPU tables [max_positions, head_size] in x's dtype");
  }
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t num_rows = cos.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < num_rows, "position ", pp[t], " out of range");
  const int64_t ldt = x.stride(0), ldh = x.stride(1);
  if (bf16) {
    // Widened table rows and head, the float32 rotation, each element rounded once.
    uint16_t* xp = bf16_ptr(x);
    const uint16_t* cp = bf16_ptr(cos);
    const uint16_t* sp = bf16_ptr(sin);
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(3 * D);
      float* c = buf.data();
      float* s = c + D;
      float* v = s + D;
      for (int64_t t = t0; t < t1; ++t) {
        widen_row(cp + pp[t] * D, D, c);
        widen_row(sp + pp[t] * D, D, s);
        for (int64_t h = 0; h < H; ++h) {
          uint16_t* head = xp + t * ldt + h * ldh;
          widen_row(head, D, v);
          rotate_head(v, c, s, half);
          round_row(v, D, head);
        }
      }
    });
    return;
  }
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict c = cp + pp[t] * D;
      const float* __restrict s = sp + pp[t] * D;
      for (int64_t h = 0; h < H; ++h) rotate_head(xp + t * ldt + h * ldh, c, s, half);
    }
  });
}


// `kind` of a packed bfloat16 weight (pack_linear_weight_bf16) in fused_linear; no ggml block type id is negative.
constexpr int64_t kPackedBf16Kind = -1;
// `kind` of Q4_0 / Q4_1 panels packed by gguf_pack_bf16 (bfloat16 activations): the negated ggml type id, -2 or -3.
constexpr int64_t kGgufBf16Q4_0Kind = -2, kGgufBf16Q4_1Kind = -3;

// A linear layer inside the fused decoder-layer halves below (the kernels live in cpu_gemm.cpp, cpu_gemm_bf16.cpp,
// cpu_q4.cpp and cpu_q4_bf16.cpp): `kind` 0 is a packed float32 weight (`linear_packed`), kPackedBf16Kind a packed
// bfloat16 weight on bfloat16 activations (`linear_packed_bf16`), kGgufBf16Q4_0Kind / kGgufBf16Q4_1Kind Q4 panels on
// bfloat16 activations (`gguf_linear_bf16`, called directly through cpu_q4_bf16.h), otherwise the ggml block type id
// of GGUF blocks run on float32 activations (`gguf_linear`, weight-only); `x` is 2-D. The others go through the
// dispatcher. `batch_invariant` goes to the Q4 panels' kernel (its exact chain at every height); the other kinds are
// batch invariant whatever it says.
at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, int64_t kind, int64_t out_features,
                        const std::optional<at::Tensor>& bias, bool batch_invariant) {
  if (kind == kGgufBf16Q4_0Kind || kind == kGgufBf16Q4_1Kind) {
    return batchinfer_kernels::gguf_linear_bf16(x, weight, -kind, out_features, bias, batch_invariant);
  }
  if (kind == kPackedBf16Kind) {
    static const auto packed_bf16 =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("batchinfer_cpu::linear_packed_bf16", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
    return packed_bf16.call(x, weight, out_features, bias);
  }
  if (kind == 0) {
    static const auto packed =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("batchinfer_cpu::linear_packed", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
    return packed.call(x, weight, out_features, bias);
  }
  static const auto gguf = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("batchinfer_cpu::gguf_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                                 const std::optional<at::Tensor>&, bool, c10::string_view)>();
  return gguf.call(x, weight, kind, out_features, bias, false, "");
}

// The first half of a Llama decoder layer before attention, as one call (issue #27: at batch 1 the Python and
// op-dispatch cost between a layer's small ops is a sixth of a q4 step): qkv = linear(rms_norm(x)) viewed
// [num_tokens, -1, head_size], its first `rotated_heads` heads (q and k) rotated in place; returns qkv
// [num_tokens, qkv_features]. The same kernels on the same inputs in the same order as the module path, so the
// same bits. float32 activations, or bfloat16 ones with packed bfloat16 weights (kPackedBf16Kind) or Q4 panels
// (kGgufBf16Q4_0Kind, kGgufBf16Q4_1Kind), in any mix, and bfloat16 cos/sin tables (the kernels widen them row by
// row, as they do called one by one). batch_invariant: as fused_linear's.
at::Tensor decoder_attention_input(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                   const at::Tensor& qkv_weight, int64_t qkv_kind, int64_t qkv_features,
                                   const std::optional<at::Tensor>& qkv_bias, const at::Tensor& positions,
                                   const at::Tensor& cos, const at::Tensor& sin, int64_t rotated_heads,
                                   int64_t head_size, bool batch_invariant) {
  const at::Tensor normed = rms_norm(x, norm_weight, eps, false);
  at::Tensor qkv = fused_linear(normed, qkv_weight, qkv_kind, qkv_features, qkv_bias, batch_invariant);
  rotary_embedding_(qkv.view({qkv.size(0), -1, head_size}).narrow(1, 0, rotated_heads), positions, cos, sin);
  return qkv;
}

// The rest of a Llama decoder layer after attention, as one call: h = residual + o_proj(attn), then
// h + down(silu_and_mul(gate_up(rms_norm(h)))). Same kernels, inputs and order as the module path; batch_invariant:
// as fused_linear's.
at::Tensor decoder_attention_output_mlp(const at::Tensor& attn, const at::Tensor& residual, const at::Tensor& o_weight,
                                        int64_t o_kind, const std::optional<at::Tensor>& o_bias,
                                        const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_weight,
                                        int64_t gate_up_kind, int64_t gate_up_features,
                                        const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
                                        int64_t down_kind, const std::optional<at::Tensor>& down_bias,
                                        bool batch_invariant) {
  const int64_t hidden = residual.size(1);
  const at::Tensor projected = fused_linear(attn, o_weight, o_kind, hidden, o_bias, batch_invariant);
  auto [total, normed] = add_rms_norm(residual, projected, norm_weight, eps, false);
  const at::Tensor gate_up =
      fused_linear(normed, gate_up_weight, gate_up_kind, gate_up_features, gate_up_bias, batch_invariant);
  const at::Tensor down =
      fused_linear(silu_and_mul(gate_up), down_weight, down_kind, hidden, down_bias, batch_invariant);
  return total.add_(down);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("add_layer_norm(Tensor x, Tensor delta, Tensor? bias, Tensor weight, Tensor beta, float eps) -> Tensor");
  m.def("bias_gelu_(Tensor(a!) x, Tensor bias) -> ()");
  m.def(
      "decoder_attention_input(Tensor x, Tensor norm_weight, float eps, Tensor qkv_weight, int qkv_kind, "
      "int qkv_features, Tensor? qkv_bias, Tensor positions, Tensor cos, Tensor sin, int rotated_heads, "
      "int head_size, bool batch_invariant=False) -> Tensor");
  m.def(
      "decoder_attention_output_mlp(Tensor attn, Tensor residual, Tensor o_weight, int o_kind, Tensor? o_bias, "
      "Tensor norm_weight, float eps, Tensor gate_up_weight, int gate_up_kind, int gate_up_features, "
      "Tensor? gate_up_bias, Tensor down_weight, int down_kind, Tensor? down_bias, "
      "bool batch_invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_embedding_", rotary_embedding_);
  m.impl("add_layer_norm", add_layer_norm);
  m.impl("bias_gelu_", bias_gelu_);
  m.impl("decoder_attention_input", decoder_attention_input);
  m.impl("decoder_attention_output_mlp", decoder_attention_output_mlp);
}
