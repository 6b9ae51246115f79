// The packed bfloat16 GEMM's panel layout and micro-kernel (cpu_gemm_bf16.cpp), shared with the Q4 kernel of a
// bfloat16 engine (cpu_q4_bf16.cpp), which dequantizes its blocks into panels of this layout for calls of many rows.
//
// A panel is kNR = 32 output columns x ceil(K / 2) pairs of bfloat16: pair row k holds, for each column c, its
// weights at 2k and 2k + 1 side by side (the operand layout of vdpbf16ps), 64 bfloat16 a pair row. Activation rows
// are packed the same way, as pairs per group of up to kMR rows ([ceil(K / 2)][rows] 32-bit words). The
// micro-kernel holds up to kMR = 12 rows x 32 columns in 24 float32 vector accumulators, starts them at the bias and
// adds one vdpbf16ps per pair of k and 16 columns, k in order: each output element is that one chain whatever the
// number of rows (batch invariant), rounded to bfloat16 once (round to nearest even).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_gemm_rows.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace batchinfer_kernels::packed_bf16 {

constexpr int64_t kNR = 32;  // output columns per panel: two vectors of 16 float32 accumulators
constexpr int kMR = 12;      // rows per micro-kernel call: 24 accumulators + 2 weight vectors of 32 registers
constexpr int64_t kRowBlockBytes = 1 << 19;  // packed activation rows per pass over the panels (in L2)

using RowGroups = batchinfer_kernels::RowGroups<kMR>;

// Rows per pass over the panels for K2 pairs a row: a multiple of kMR whose packed rows fit kRowBlockBytes.
inline int64_t row_block(int64_t K2) { return std::max<int64_t>(kMR, kRowBlockBytes / (K2 * 4) / kMR * kMR); }

#if defined(__AVX512BF16__)

// A pair of bfloat16 (k, k + 1) as one 32-bit word; k + 1 = K pads with zero.
inline uint32_t pair_at(const uint16_t* row, int64_t k, int64_t K) {
  const uint32_t lo = row[k], hi = k + 1 < K ? row[k + 1] : 0;
  return lo | (hi << 16);
}

// A panel's pair rows read from memory (the packed weight, or a panel dequantized into a buffer).
struct PanelWeights {
  const uint16_t* panel;
  // Pair row k: columns 0-15 in w0, 16-31 in w1.
  void operator()(int64_t k, __m512bh& w0, __m512bh& w1) const {
    w0 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kNR);
    w1 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kNR + 32);
  }
};

// MR rows of float32 accumulators (columns 0-15 in acc0, 16-31 in acc1) rounded once to bfloat16 (nearest even)
// into y[r * ldy + 0 : ncols]; shared with the Q4 kernel's exact chain (cpu_q4_bf16.cpp).
template <int MR>
inline void store_rows(const __m512 (&acc0)[MR], const __m512 (&acc1)[MR], uint16_t* y, int64_t ldy, int64_t ncols) {
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

// y[r, 0:ncols] = round_bf16(bias + sum_k x[r, k] * w[k, 0:ncols]) for r < MR; x packed [K2][MR] pairs, the panel's
// pair rows from `weights` (PanelWeights, or a functor with its call that computes them). Prefetches prefetch_rows
// pair rows of `prefetch` (the next panel) spread over the chain.
template <int MR, typename Weights>
inline void micro_kernel(const uint32_t* __restrict x, const Weights& weights, int64_t K2,
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
    __m512bh w0, w1;
    weights(k, w0, w1);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[k * MR + r]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, xs);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, xs);
    }
  }
  store_rows<MR>(acc0, acc1, y, ldy, ncols);
}

// Rows [0, M) of x as pairs, the group of `rows` rows that starts at row m at xpack + m * K2, laid out [K2][rows].
inline void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xpack) {
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

// y[0:M, 0:ncols] over one panel for M rows packed by pack_rows; next_panel (or nullptr) is prefetched, spread
// over the row groups.
inline void panel_rows(const uint32_t* xpack, int64_t M, const uint16_t* panel, int64_t K2, const float* bias_panel,
                       uint16_t* y, int64_t ldy, int64_t ncols, const uint16_t* next_panel) {
  const RowGroups groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t first = g * K2 / groups.count, last = next_panel == nullptr ? first : (g + 1) * K2 / groups.count;
    const uint16_t* prefetch = next_panel == nullptr ? nullptr : next_panel + first * 2 * kNR;
    batchinfer_kernels::with_rows<kMR>(groups.size(g), [&](auto rows) {
      micro_kernel<decltype(rows)::value>(xpack + m * K2, PanelWeights{panel}, K2, bias_panel, y + m * ldy, ldy, ncols,
                                          prefetch, last - first);
    });
  }
}

#endif  // __AVX512BF16__

}  // namespace batchinfer_kernels::packed_bf16
