// Linear layer over a GGUF file's Q4_0 / Q4_1 blocks with bfloat16 activations and output, y = x W^T + b, for
// CPUs with AVX512_BF16 (vdpbf16ps), issue #27: the q4 weights of a bfloat16 engine at the speed of its packed
// bfloat16 GEMM (cpu_gemm_bf16.cpp) while streaming 4.5-5 bits a weight instead of 16.
//
// Registered as `batchinfer_cpu::gguf_pack_bf16`, `batchinfer_cpu::gguf_linear_bf16` and
// `batchinfer_cpu::gguf_linear_bf16_supported` (built and loaded by cpu_extension.py).
//
// Method. A Q4 weight is w = d q + m per block of 32 along K (Q4_0: q - 8 and m = 0; Q4_1: q in 0..15 and its
// minimum m); every value of q (or q - 8) is a small integer, exact in bfloat16. Two numerics, chosen by the
// call's height unless it asks for batch invariance:
//
// - Exact weights: calls of up to kDirectRows = 24 rows (decode at small batches), and calls of any height with
//   batch_invariant set. Each output is
//     y[r, n] = bias[n] + sum_b m[b, n] s[r, b] + sum_b d[b, n] (x[r, block b] . q[n, block b]),
//   s[r, b] the float32 sum of row r's 32 activations of block b (Q4_1 only). The integer dot of a block is 16
//   vdpbf16ps into a fresh float32 accumulator (pairs of k, the operand layout of cpu_gemm_bf16.h), then scaled by
//   d into the output's accumulator with one FMA: the weights enter the products exactly (no bfloat16 rounding of
//   d q + m), and only the activations are bfloat16. kMR = 6 rows at a time (6 rows x 32 columns x (output +
//   block accumulator) = 24 of AVX-512's 32 vector registers). Up to kDirectRows rows the quants are expanded in
//   registers (one vpermw lookup per 32 weights); above, a thread expands each of its panels once into an L2
//   buffer with the same values (bfloat16 integer pairs, d and m widened to float32) and runs the rows over it in
//   blocks of kRowBlockBytes. The same chain in the same order for every height: bias, the m s terms block by
//   block, then block by block d times the block's 16-pair chain, so a row's bits are those of the row alone.
// - More rows without batch_invariant (prefill, large decode batches), bfloat16 weights: each panel is
//   dequantized to the values round_bf16(d (q - 8)) / round_bf16(d q + m) (float32, rounded once to nearest even)
//   in the packed bfloat16 GEMM's layout, and that GEMM's micro-kernel (cpu_gemm_bf16.h, 12 rows x 32 columns)
//   runs every row over them: one chain per output, no per-block scale FMA, the same bits as linear_packed_bf16
//   over those weights. The first row group of each panel dequantizes as its chain asks for the pair rows (the
//   conversions issue beside its vdpbf16ps) and stores them into an L2 buffer that the other groups read.
//
// The bfloat16-weight numerics is faster but a row's bits there differ from the exact chain's (the weights'
// bfloat16 rounding), so a row's output depends on its call's height unless batch_invariant is set: docs/engine.md,
// "Batch-invariant numerics". Either way rounded to bfloat16 once.
//
// Layout (gguf_pack_bf16, once at load). The blocks are regrouped into panels of kNR = 32 output columns; per
// panel and block of 32 k, 16 rows of 32 bytes (one per pair of k: byte j holds in its low nibble column j / 2's
// weight at k = 2p + j % 2 and in its high nibble column 16 + j / 2's), then the 32 columns' float16 d, then (Q4_1)
// their float16 m: 512 + 64 (+ 64) bytes per 32 x 32 weights, 4.5 (Q4_0) or 5 (Q4_1) bits a weight as in the file.
// Columns past out_features are zero (d = m = 0).
//
// Built without AVX512_BF16 (-march=native on a CPU without it), the ops exist but
// `gguf_linear_bf16_supported()` is false and the others raise, naming the instruction set.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_gemm_bf16.h"
#include "cpu_gemm_rows.h"
#include "cpu_q4_bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3;  // ggml type ids
constexpr int64_t kBlock = 32;           // weights per block along K
constexpr int64_t kNR = 32;              // output columns per panel
constexpr int kMR = 6;                   // activation rows per micro-kernel call (exact weights)
constexpr int64_t kQuantBytes = 512;     // a panel's nibbles for one block: 16 pairs x 32 columns x 2 k / 2
constexpr int64_t kDirectRows = 4 * kMR;  // calls of up to this many rows: exact weights, expanded in registers
constexpr int64_t kRowBlockBytes = 1 << 19;  // exact weights above kDirectRows: packed rows per pass (in L2)

int64_t raw_block_bytes(int64_t type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 0; }

// Bytes of one packed (panel, block): nibbles, d, and m for Q4_1.
int64_t packed_block_bytes(int64_t type) { return kQuantBytes + 2 * kNR * (type == kQ4_1 ? 2 : 1); }

void check_type(int64_t type) {
  TORCH_CHECK(raw_block_bytes(type) > 0, "GGUF block type ", type,
              " has no bfloat16 kernel (Q4_0 = 2 and Q4_1 = 3 do)");
}

#if defined(__AVX512BF16__)

// Rows of x [M, K] (bfloat16, K a multiple of 32) as pairs per group of up to kMR rows ([K / 2][rows] uint32 at
// xpack + m * K / 2) and, with_sums, their per-block float32 sums ([nb][rows] at sums + m * nb; a fixed order per
// row).
void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xpack, float* sums, bool with_sums) {
  const int64_t K2 = K / 2, nb = K / kBlock;
  const batchinfer_kernels::RowGroups<kMR> groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t rows = groups.size(g);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* src = x + (m + r) * ldx;
      for (int64_t k = 0; k < K2; ++k) {
        uint32_t pair;
        std::memcpy(&pair, src + 2 * k, sizeof(pair));
        xpack[m * K2 + k * rows + r] = pair;
      }
      for (int64_t b = 0; with_sums && b < nb; ++b) {  // even k in the low half of each dword, odd k in the high half
        const __m512i block = _mm512_loadu_si512(src + b * kBlock);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(block, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(block, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        sums[m * nb + b * rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      }
    }
  }
}

// bfloat16 bits of 0..15 (Q4_1) or of -8..7 (Q4_0), indexed by the nibble (vpermw reads an index's low 5 bits).
template <int64_t T>
inline __m512i nibble_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(T == kQ4_0 ? (i & 15) - 8 : (i & 15));
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(table);
}

// Pair row p of a packed block (32 bytes) as the two operands of vdpbf16ps: columns 0-15 and 16-31.
inline void nibble_pairs(const uint8_t* row, __m512i lut, __m512bh& w0, __m512bh& w1) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)), lut);
  w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
}

inline __m512 half_floats(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A panel's exact weights expanded once (a taller call with batch_invariant): per block, 16 pairs x 64 bfloat16
// integer weights (the operand layout of vdpbf16ps: column c's k and k + 1 side by side), then d and m as float32.
struct Panel {
  std::vector<uint16_t> quants;  // [nb][16][64]
  std::vector<float> d, m;       // [nb][32]
};

template <int64_t T>
void expand_panel(const uint8_t* packed, int64_t nb, Panel& panel) {
  const __m512i lut = nibble_table<T>();
  const int64_t block_bytes = packed_block_bytes(T);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = packed + b * block_bytes;
    uint16_t* dst = panel.quants.data() + b * 16 * 64;
    for (int p = 0; p < 16; ++p) {
      __m512bh w0, w1;
      nibble_pairs(src + 32 * p, lut, w0, w1);
      _mm512_storeu_si512(dst + 64 * p, (__m512i)w0);
      _mm512_storeu_si512(dst + 64 * p + 32, (__m512i)w1);
    }
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_ps(panel.d.data() + b * kNR + 16 * h, half_floats(src + kQuantBytes + 32 * h));
      if constexpr (T == kQ4_1) {
        _mm512_storeu_ps(panel.m.data() + b * kNR + 16 * h, half_floats(src + kQuantBytes + 64 + 32 * h));
      }
    }
  }
}

// A panel's exact weights as the micro-kernel reads them: from the expanded buffer (a taller call) ...
struct ExpandedWeights {
  const Panel& panel;
  void pairs(int64_t b, int p, __m512bh& w0, __m512bh& w1) const {
    const uint16_t* at = panel.quants.data() + (b * 16 + p) * 64;
    w0 = (__m512bh)_mm512_loadu_si512(at);
    w1 = (__m512bh)_mm512_loadu_si512(at + 32);
  }
  __m512 d(int64_t b, int h) const { return _mm512_loadu_ps(panel.d.data() + b * kNR + 16 * h); }
  __m512 m(int64_t b, int h) const { return _mm512_loadu_ps(panel.m.data() + b * kNR + 16 * h); }
};

// A panel's blocks dequantized into the packed bfloat16 GEMM's pair rows (cpu_gemm_bf16.h: [K / 2][32][2]) as the
// micro-kernel asks for them, each also stored into `panel` (a buffer the panel's later row groups read back):
// each weight round_bf16(d (q - 8)) (Q4_0) or round_bf16(d q + m) (Q4_1), the value computed in float32 (d q is
// exact there; the one float32 rounding is of the sum d q + m) and rounded to bfloat16 once, to nearest even.
// Computing them inside the first row group's chain lets the conversions issue beside its vdpbf16ps.
template <int64_t T>
struct DequantizingWeights {
  const uint8_t* packed;  // the panel's packed blocks
  const float* scales;    // per block: d then (Q4_1) m, per quarter of a pair row ([nb][2][4][16]; set_scales)
  uint16_t* panel;
  __m512 table;  // q - 8 or q by the nibble (vpermps reads an index's low 4 bits)

  DequantizingWeights(const uint8_t* packed_panel, const float* block_scales, uint16_t* panel_buffer)
      : packed(packed_panel), scales(block_scales), panel(panel_buffer) {
    alignas(64) float values[16];
    for (int i = 0; i < 16; ++i) values[i] = static_cast<float>(T == kQ4_0 ? i - 8 : i);
    table = _mm512_load_ps(values);
  }

  // The quarters of a pair row are columns 0-7 and 8-15 (low nibbles of bytes 0-15 and 16-31), then 16-23 and
  // 24-31 (their high nibbles); lane j of a quarter is column j / 2, so d and m are repeated per pair.
  static void set_scales(const uint8_t* packed_panel, int64_t nb, float* block_scales) {
    const __m512i first8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i last8 = _mm512_add_epi32(first8, _mm512_set1_epi32(8));
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = packed_panel + b * packed_block_bytes(T) + kQuantBytes;
      for (int s = 0; s < (T == kQ4_1 ? 2 : 1); ++s) {  // d, m
        for (int h = 0; h < 2; ++h) {
          const __m512 half = half_floats(src + 64 * s + 32 * h);
          float* dst = block_scales + ((b * 2 + s) * 4 + 2 * h) * 16;
          _mm512_storeu_ps(dst, _mm512_permutexvar_ps(first8, half));
          _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(last8, half));
        }
      }
    }
  }

  void operator()(int64_t k, __m512bh& w0, __m512bh& w1) const {
    const int64_t b = k / 16;
    const uint8_t* row = packed + b * packed_block_bytes(T) + 32 * (k % 16);
    const float* d = scales + b * 2 * 64;
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
    __m512 v[4] = {_mm512_permutexvar_ps(lo, table), _mm512_permutexvar_ps(hi, table),
                   _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), table),
                   _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 4), table)};
    for (int i = 0; i < 4; ++i) {
      if constexpr (T == kQ4_1) {
        v[i] = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(d + 16 * i), _mm512_loadu_ps(d + 64 + 16 * i));
      } else {
        v[i] = _mm512_mul_ps(v[i], _mm512_loadu_ps(d + 16 * i));
      }
    }
    w0 = _mm512_cvtne2ps_pbh(v[1], v[0]);
    w1 = _mm512_cvtne2ps_pbh(v[3], v[2]);
    _mm512_storeu_si512(panel + k * 2 * kNR, (__m512i)w0);
    _mm512_storeu_si512(panel + k * 2 * kNR + 32, (__m512i)w1);
  }
};

// ... or expanded in registers from the packed bytes (a call of up to kDirectRows rows: the buffer's stores and
// loads would cost more than they save). The same values either way, so the same chain.
template <int64_t T>
struct DirectWeights {
  const uint8_t* packed;
  __m512i lut;
  void pairs(int64_t b, int p, __m512bh& w0, __m512bh& w1) const {
    nibble_pairs(packed + b * packed_block_bytes(T) + 32 * p, lut, w0, w1);
  }
  __m512 d(int64_t b, int h) const { return half_floats(packed + b * packed_block_bytes(T) + kQuantBytes + 32 * h); }
  __m512 m(int64_t b, int h) const {
    return half_floats(packed + b * packed_block_bytes(T) + kQuantBytes + 64 + 32 * h);
  }
};

// y[r, 0:ncols] for MR rows (x pairs [K2][MR], sums [nb][MR]) over one panel's exact weights.
template <int64_t T, int MR, typename Weights>
inline void micro_kernel(const uint32_t* __restrict x, const float* __restrict sums, const Weights& weights, int64_t nb,
                         const float* __restrict bias_panel, uint16_t* __restrict y, int64_t ldy, int64_t ncols) {
  __m512 acc0[MR], acc1[MR];
  const __m512 bias0 = _mm512_loadu_ps(bias_panel), bias1 = _mm512_loadu_ps(bias_panel + 16);
  for (int r = 0; r < MR; ++r) {
    acc0[r] = bias0;
    acc1[r] = bias1;
  }
  if constexpr (T == kQ4_1) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 m0 = weights.m(b, 0), m1 = weights.m(b, 1);
      for (int r = 0; r < MR; ++r) {
        const __m512 s = _mm512_set1_ps(sums[b * MR + r]);
        acc0[r] = _mm512_fmadd_ps(m0, s, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(m1, s, acc1[r]);
      }
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512 g0[MR], g1[MR];
    for (int r = 0; r < MR; ++r) g0[r] = g1[r] = _mm512_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      const int64_t k = b * 16 + p;
      __m512bh w0, w1;
      weights.pairs(b, p, w0, w1);
      for (int r = 0; r < MR; ++r) {
        const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[k * MR + r]));
        g0[r] = _mm512_dpbf16_ps(g0[r], w0, xs);
        g1[r] = _mm512_dpbf16_ps(g1[r], w1, xs);
      }
    }
    const __m512 d0 = weights.d(b, 0), d1 = weights.d(b, 1);
    for (int r = 0; r < MR; ++r) {
      acc0[r] = _mm512_fmadd_ps(g0[r], d0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(g1[r], d1, acc1[r]);
    }
  }
  batchinfer_kernels::packed_bf16::store_rows<MR>(acc0, acc1, y, ldy, ncols);
}

template <int64_t T, typename Weights>
void panel_rows(const uint32_t* xpack, const float* sums, int64_t rows, int64_t K2, int64_t nb, const Weights& weights,
                const float* bias_panel, uint16_t* y, int64_t ldy, int64_t ncols) {
  const batchinfer_kernels::RowGroups<kMR> groups(rows);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    batchinfer_kernels::with_rows<kMR>(groups.size(g), [&](auto r) {
      micro_kernel<T, decltype(r)::value>(xpack + m * K2, sums + m * nb, weights, nb, bias_panel, y + m * ldy, ldy,
                                          ncols);
    });
  }
}

// The exact weights at any height (micro_kernel above): up to kDirectRows rows expanded in registers, taller calls
// from each panel's expansion, rows in blocks of kRowBlockBytes.
template <int64_t T>
void run_exact(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
               const float* bias, uint16_t* y) {
  const int64_t K2 = K / 2, nb = K / kBlock, num_panels = (N + kNR - 1) / kNR;
  const int64_t panel_bytes = nb * packed_block_bytes(T);
  const int64_t row_block = std::max<int64_t>(kMR, kRowBlockBytes / (K2 * 4) / kMR * kMR);
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t max_rows = std::min(row_block, M);
    std::vector<uint32_t> xpack(max_rows * K2);
    std::vector<float> sums(max_rows * nb);
    const bool direct = M <= kDirectRows;
    const __m512i lut = nibble_table<T>();
    Panel panel;
    if (!direct) {
      panel = Panel{std::vector<uint16_t>(nb * 16 * 64), std::vector<float>(nb * kNR), std::vector<float>(nb * kNR)};
    }
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t rows = std::min(row_block, M - m0);
      pack_rows(x + m0 * ldx, ldx, rows, K, xpack.data(), sums.data(), T == kQ4_1);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ncols = std::min(kNR, N - p * kNR);
        float bias_panel[kNR] = {};
        if (bias != nullptr) std::memcpy(bias_panel, bias + p * kNR, ncols * sizeof(float));
        uint16_t* out = y + m0 * N + p * kNR;
        if (direct) {
          const DirectWeights<T> weights{packed + p * panel_bytes, lut};
          panel_rows<T>(xpack.data(), sums.data(), rows, K2, nb, weights, bias_panel, out, N, ncols);
        } else {
          expand_panel<T>(packed + p * panel_bytes, nb, panel);
          panel_rows<T>(xpack.data(), sums.data(), rows, K2, nb, ExpandedWeights{panel}, bias_panel, out, N, ncols);
        }
      }
    }
  });
}

// A call of many rows without batch invariance: each panel dequantized to bfloat16 values by its first row group
// (DequantizingWeights), the others reading them back from an L2 buffer, all through the packed bfloat16 GEMM's
// micro-kernel (cpu_gemm_bf16.h), 12 rows at a time.
template <int64_t T>
void run_dequantized(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                     const float* bias, uint16_t* y) {
  namespace gemm = batchinfer_kernels::packed_bf16;
  const int64_t K2 = K / 2, nb = K / kBlock, num_panels = (N + kNR - 1) / kNR;
  const int64_t panel_bytes = nb * packed_block_bytes(T);
  const int64_t row_block = gemm::row_block(K2);
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint32_t> xpack(std::min(row_block, M) * K2);
    std::vector<uint16_t> panel(K2 * 2 * kNR);
    std::vector<float> scales(nb * 2 * 64);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t rows = std::min(row_block, M - m0);
      gemm::pack_rows(x + m0 * ldx, ldx, rows, K, xpack.data());
      const gemm::RowGroups groups(rows);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ncols = std::min(kNR, N - p * kNR);
        float bias_panel[kNR] = {};
        if (bias != nullptr) std::memcpy(bias_panel, bias + p * kNR, ncols * sizeof(float));
        DequantizingWeights<T>::set_scales(packed + p * panel_bytes, nb, scales.data());
        const DequantizingWeights<T> dequantizing(packed + p * panel_bytes, scales.data(), panel.data());
        uint16_t* out = y + m0 * N + p * kNR;
        for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
          batchinfer_kernels::with_rows<gemm::kMR>(groups.size(g), [&](auto r) {
            constexpr int MR = decltype(r)::value;
            if (g == 0) {  // also fetches the next panel's blocks, 128 bytes (a bfloat16 pair row) at a time
              const auto* next = reinterpret_cast<const uint16_t*>(packed + (p + 1) * panel_bytes);
              gemm::micro_kernel<MR>(xpack.data(), dequantizing, K2, bias_panel, out, N, ncols,
                                     p + 1 < p1 ? next : nullptr, p + 1 < p1 ? (panel_bytes + 127) / 128 : 0);
            } else {
              gemm::micro_kernel<MR>(xpack.data() + m * K2, gemm::PanelWeights{panel.data()}, K2, bias_panel,
                                     out + m * N, N, ncols, nullptr, 0);
            }
          });
        }
      }
    }
  });
}

template <int64_t T>
void run(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias,
         bool batch_invariant, uint16_t* y) {
  if (M <= kDirectRows || batch_invariant) {
    run_exact<T>(x, ldx, M, K, packed, N, bias, y);
  } else {
    run_dequantized<T>(x, ldx, M, K, packed, N, bias, y);
  }
}

#endif  // __AVX512BF16__

void require_bf16() {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "the bfloat16 GGUF kernel needs a CPU with AVX512_BF16 (this build has none)");
#endif
}

// GGUF blocks uint8 [N, K / 32 * raw bytes] into [ceil(N / 32), K / 32, packed bytes] (layout above).
at::Tensor gguf_pack_bf16(const at::Tensor& blocks, int64_t type, int64_t in_features) {
  require_bf16();
  check_type(type);
  const int64_t K = in_features, raw = raw_block_bytes(type);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features ", K, " is not a positive multiple of the block size 32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu() &&
                  blocks.size(1) == K / kBlock * raw,
              "blocks must be uint8 CPU [out_features, in_features / 32 * ", raw, "]");
  const int64_t N = blocks.size(0), nb = K / kBlock, num_panels = (N + kNR - 1) / kNR;
  const int64_t out_bytes = packed_block_bytes(type);
  at::Tensor packed = at::zeros({num_panels, nb, out_bytes}, blocks.options());
  const at::Tensor src = blocks.contiguous();
  const auto* w = src.const_data_ptr<uint8_t>();
  auto* dst = packed.data_ptr<uint8_t>();
  const int64_t quants_at = type == kQ4_1 ? 4 : 2;
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNR, N - p * kNR);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + (p * nb + b) * out_bytes;
        for (int64_t c = 0; c < ncols; ++c) {
          const uint8_t* block = w + (p * kNR + c) * nb * raw + b * raw;
          std::memcpy(out + kQuantBytes + 2 * c, block, 2);                             // d
          if (type == kQ4_1) std::memcpy(out + kQuantBytes + 2 * kNR + 2 * c, block + 2, 2);  // m
          for (int k = 0; k < kBlock; ++k) {
            const uint8_t q = (block[quants_at + k % 16] >> (k < 16 ? 0 : 4)) & 0x0F;
            const int64_t byte = (k / 2) * 32 + (c % 16) * 2 + k % 2;
            out[byte] |= static_cast<uint8_t>(c < 16 ? q : q << 4);
          }
        }
      }
    }
  });
  return packed;
}

bool gguf_linear_bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

// Outside the anonymous namespace: cpu_elementwise.cpp's fused decoder-layer calls run it (cpu_q4_bf16.h).
namespace batchinfer_kernels {

at::Tensor gguf_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                            const std::optional<at::Tensor>& bias, bool batch_invariant) {
  require_bf16();
  check_type(type);
  check_bf16_rows(x);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features ", K, " is not a positive multiple of the block size 32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == K / kBlock && packed.size(2) == packed_block_bytes(type),
              "packed weight must come from gguf_pack_bf16 with this type and ", K, " in_features");
  TORCH_CHECK(N > (packed.size(0) - 1) * kNR && N <= packed.size(0) * kNR, "out_features ", N,
              " does not match the packed weight");
  const auto [bias_f, y] = bf16_linear_output(x, N, bias);
  if (M == 0 || N == 0) return y;
#if defined(__AVX512BF16__)
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const auto* pp = packed.const_data_ptr<uint8_t>();
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  if (type == kQ4_1) {
    run<kQ4_1>(xp, x.stride(0), M, K, pp, N, b, batch_invariant, yp);
  } else {
    run<kQ4_0>(xp, x.stride(0), M, K, pp, N, b, batch_invariant, yp);
  }
#endif
  return y;
}

}  // namespace batchinfer_kernels

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("gguf_pack_bf16(Tensor blocks, int type, int in_features) -> Tensor");
  m.def(
      "gguf_linear_bf16(Tensor x, Tensor packed, int type, int out_features, Tensor? bias, "
      "bool batch_invariant=False) -> Tensor");
  m.def("gguf_linear_bf16_supported() -> bool", gguf_linear_bf16_supported);  // no tensor argument: catch-all
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("gguf_pack_bf16", gguf_pack_bf16);
  m.impl("gguf_linear_bf16", batchinfer_kernels::gguf_linear_bf16);
}
