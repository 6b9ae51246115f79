// Dense bfloat16 linear layer (y = x W^T + b) for CPUs with AVX512_BF16 (vdpbf16ps): bfloat16 weight,
// activations and output, float32 accumulation.
//
// Registered as the Torch ops `batchinfer_cpu::pack_linear_weight_bf16`, `batchinfer_cpu::linear_packed_bf16`
// and `batchinfer_cpu::linear_bf16_supported` (built and loaded by cpu_extension.py). The layout and loop
// order are cpu_gemm.cpp's (Goto & van de Geijn 2008): the weight [N, K] is packed once into panels of
// kNR = 32 output columns, each panel ceil(K / 2) x 32 pairs of bfloat16 (the k-th and k+1-th weight of one
// column side by side, the operand layout of vdpbf16ps), so one pass streams the weight exactly once; a
// micro-kernel holds up to kMR = 12 activation rows x 32 columns in 24 float32 vector accumulators and
// adds, per pair of k, x[r, k] w[k, c] + x[r, k + 1] w[k + 1, c] with one vdpbf16ps per 16 columns. Each
// output element is one such chain over k in order, whatever the number of rows (batch invariant); the
// float32 sum is rounded to bfloat16 once (round to nearest even), as torch's bfloat16 linear rounds its
// float32 accumulator.
//
// Built without AVX512_BF16 (-march=native on a CPU without it), the ops exist but
// `linear_bf16_supported()` is false and the other two raise; callers keep torch's bfloat16 linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_gemm_rows.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNR = 32;  // output columns per panel: two vectors of 16 float32 accumulators
constexpr int kMR = 12;      // rows per micro-kernel call: 24 accumulators + 2 weight vectors of 32 registers
constexpr int64_t kRowBlockBytes = 1 << 19;  // packed activation rows per pass over the panels (in L2)

#if defined(__AVX512BF16__)

// A pair of bfloat16 (k, k + 1) as one 32-bit word; k + 1 = K pads with zero.
inline uint32_t pair_at(const uint16_t* row, int64_t k, int64_t K) {
  const uint32_t lo = row[k], hi = k + 1 < K ? row[k + 1] : 0;
  return lo | (hi << 16);
}

// y[r, 0:ncols] = round_bf16(bias + sum_k x[r, k] * panel[k, 0:ncols]) for r < MR; x packed [K2][MR] pairs.
template <int MR>
inline void micro_kernel(const uint32_t* __restrict x, const uint16_t* __restrict panel, int64_t K2,
                         const float* __restrict bias_panel, uint16_t* __restrict y, int64_t ldy, int64_t ncols,
                         const uint16_t* prefetch, int64_t prefetch_rows) {
  __m512 acc0[MR], acc1[MR];
  const __m512 bias0 = _mm512_loadu_ps(bias_panel), bias1 = _mm512_loadu_ps(bias_panel + 16);
  for (int r = 0; r < MR; ++r) {
    acc0[r] = bias0;
    acc1[r] = bias1;
  }
  int64_t prefetched = 0;
  for (int64_t k = 0; k < K2; ++k) {
    for (; prefetched * K2 < (k + 1) * prefetch_rows; ++prefetched) {
      __builtin_prefetch(prefetch + prefetched * 2 * kNR, 0, 2);  // 64 bf16 = two cache lines a pair row
      __builtin_prefetch(prefetch + prefetched * 2 * kNR + 32, 0, 2);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kNR);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kNR + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[k * MR + r]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, xs);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, xs);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(acc0[r]), hi = (__m256i)_mm512_cvtneps_pbh(acc1[r]);
    if (ncols == kNR) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16), hi);
    } else {
      uint16_t tail[kNR];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tail), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tail + 16), hi);
      std::memcpy(y + r * ldy, tail, ncols * sizeof(uint16_t));
    }
  }
}

using RowGroups = batchinfer_kernels::RowGroups<kMR>;

// Rows [0, M) of x as pairs, the group of `rows` rows that starts at row m at xpack + m * K2, laid out [K2][rows].
void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xpack) {
  const int64_t K2 = (K + 1) / 2;
  const RowGroups groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t rows = groups.size(g);
    uint32_t* dst = xpack + m * K2;
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* src = x + (m + r) * ldx;
      for (int64_t k = 0; k < K2; ++k) dst[k * rows + r] = pair_at(src, 2 * k, K);
    }
  }
}

void panel_rows(const uint32_t* xpack, int64_t M, const uint16_t* panel, int64_t K2, const float* bias_panel,
                uint16_t* y, int64_t ldy, int64_t ncols, const uint16_t* next_panel) {
  const RowGroups groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t first = g * K2 / groups.count, last = next_panel == nullptr ? first : (g + 1) * K2 / groups.count;
    const uint16_t* prefetch = next_panel == nullptr ? nullptr : next_panel + first * 2 * kNR;
    batchinfer_kernels::with_rows<kMR>(groups.size(g), [&](auto rows) {
      micro_kernel<decltype(rows)::value>(xpack + m * K2, panel, K2, bias_panel, y + m * ldy, ldy, ncols, prefetch, last - first);
    });
  }
}

#endif  // __AVX512BF16__

void require_bf16() {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "the bfloat16 linear kernel needs a CPU with AVX512_BF16 (this build has none)");
#endif
}

// Weight [N, K] bfloat16 into [ceil(N / 32), ceil(K / 2), 32, 2] pairs, zero padded.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  require_bf16();
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be bfloat16");
  TORCH_CHECK(weight.device().is_cpu(), "weight must be on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1), K2 = (K + 1) / 2;
  const int64_t num_panels = (N + kNR - 1) / kNR;
  at::Tensor packed = at::zeros({num_panels, K2, kNR, 2}, weight.options());
  const at::Tensor src = weight.contiguous();
  const auto* w = static_cast<const uint16_t*>(src.const_data_ptr());
  auto* dst = static_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNR, N - p * kNR);
      for (int64_t c = 0; c < ncols; ++c) {
        const uint16_t* row = w + (p * kNR + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * kNR + c) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

// y = x W^T (+ bias) over packed panels, the panels split across torch's threads.
at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                              const std::optional<at::Tensor>& bias) {
  require_bf16();
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kNR && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed weight must come from pack_linear_weight_bf16");
  batchinfer_kernels::check_bf16_rows(x);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, K2 = (K + 1) / 2;
  TORCH_CHECK(packed.size(1) == K2, "x has ", K, " features but the weight expects ", 2 * packed.size(1), " or one fewer");
  TORCH_CHECK(N > (packed.size(0) - 1) * kNR && N <= packed.size(0) * kNR, "out_features ", N,
              " does not match the packed weight");
  const auto [bias_f, y] = batchinfer_kernels::bf16_linear_output(x, N, bias);
  if (M == 0 || N == 0) return y;
#if defined(__AVX512BF16__)
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const int64_t ldx = x.stride(0);
  const auto* pp = static_cast<const uint16_t*>(packed.const_data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  const int64_t panel_size = K2 * 2 * kNR;
  const int64_t row_block = std::max<int64_t>(kMR, kRowBlockBytes / (K2 * 4) / kMR * kMR);
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint32_t> xpack(std::min(row_block, M) * K2);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t rows = std::min(row_block, M - m0);
      pack_rows(xp + m0 * ldx, ldx, rows, K, xpack.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ncols = std::min(kNR, N - p * kNR);
        float bias_panel[kNR] = {};
        if (b != nullptr) std::memcpy(bias_panel, b + p * kNR, ncols * sizeof(float));
        const uint16_t* next_panel = p + 1 < p1 ? pp + (p + 1) * panel_size : nullptr;
        panel_rows(xpack.data(), rows, pp + p * panel_size, K2, bias_panel, yp + m0 * N + p * kNR, N, ncols, next_panel);
      }
    }
  });
#endif
  return y;
}

bool linear_bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("linear_packed_bf16(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_bf16_supported() -> bool", linear_bf16_supported);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("pack_linear_weight_bf16", pack_linear_weight_bf16);
  m.impl("linear_packed_bf16", linear_packed_bf16);
}
