// Linear layer over a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0), y = x W^T + b, on CPUs with AVX2,
// FMA and F16C, with an AVX-512 VNNI path where the CPU has AVX-512 F/BW/VL/VNNI (issue #27). The weight stays
// as the file holds it: row n of W [N, K] is K / 32 blocks of 32 weights, each block a float16 scale d (and for
// Q4_1 a float16 minimum m) and its packed quants (ggml's block_q4_0 / block_q4_1 / block_q8_0 layout,
// 18 / 20 / 34 bytes), so a decode step reads 0.56-1.06 bytes a weight instead of float32's 4.
//
// Registered as `batchinfer_cpu::gguf_linear` and `batchinfer_cpu::gguf_linear_isas` (built and loaded by
// cpu_extension.py). Two ways to multiply, chosen per call (llama.cpp's two designs):
//   - float32 activations: each block is dequantized in registers (nibbles -> int32 -> float, w = d q + m as one
//     FMA) and multiplied with float32 FMAs; only the summation order differs from a dequantize-matmul.
//   - Q8 activations: each activation row is quantized per block of 32 to int8 with a float scale
//     (d_x = max|x| / 127, llama.cpp's block_q8_1, whose s_x = d_x sum q_x carries Q4_1's minimum and Q4_0's
//     offset of 8), and a block's dot is an integer dot scaled once by d_w d_x: a fraction of the
//     instructions, at the cost of the activations' rounding.
// Two instruction-set paths, chosen per call at run time (`isa`: "" takes the first of gguf_linear_isas(), the
// best this CPU runs; a name forces that path, which the tests use to check each one here):
//   - "avx512vnni": a 512-bit register holds two blocks. Float32 activations: 16 weights per widen, convert and
//     FMA. Q8 activations: one vpdpbusd (unsigned weight bytes x signed activation bytes, summed in fours into
//     int32) per two blocks, where AVX2 needs vpmaddubsw + vpmaddwd per block; the pair's scales d_w d_x and
//     minimum terms m_w s_x come from one 4-lane multiply. Q8_0 weights are signed: their sign moves onto the
//     activation (masked negate) and their magnitude is the unsigned operand, as AVX2's vpsignb does.
//   - "avx2": 256-bit registers, one block at a time (vpmaddubsw + vpmaddwd for Q8 activations).
// Output rows are split across torch's threads; every activation row group (up to kMR rows) reuses each
// expanded weight block, and activations are visited in blocks of kRowBlock rows so a prefill chunk stays in
// L2 while a thread's weight rows stream past it.
//
// The build is -march=native: on a CPU without AVX2/FMA/F16C the ops exist but refuse with an error naming the
// instruction sets (gguf_linear_isas() is empty there, which callers check at load); the AVX-512 path is built
// when the compiler targets it and offered only when the CPU reports it (__builtin_cpu_supports).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BATCHINFER_GGUF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define BATCHINFER_GGUF_AVX512 1
#endif
#endif

namespace {

// ggml's type ids (ggml.h, enum ggml_type).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;     // weights per block
constexpr int kMR = 4;             // activation rows sharing one expanded weight block
constexpr int64_t kRowBlock = 64;  // activation rows per pass over a thread's weight rows
constexpr int kWeightRows = 4;     // weight rows interleaved by a batch-1 call (AVX-512, Q4_0 / Q8_0)

enum class Isa { kAvx2, kAvx512Vnni };

constexpr int64_t block_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0;
}

#if defined(BATCHINFER_GGUF_AVX2)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}

inline float half_at(const uint8_t* p) { return _cvtsh_ss(half_bits(p)); }

// Activation rows quantized per block (see quantize_rows_q8): int8 q [M, K]; per block the pair (d, d * sum(q))
// interleaved, ds [M, nb, 2].
struct Q8Rows {
  const int8_t* q;
  const float* ds;
  int64_t K, nb;
};

// Rows of x [M, K] to int8 per block of 32: d = max|x| / 127, q = round-half-even(x / d) (0 for an all-zero
// block), s = d * sum(q) (llama.cpp's quantize_row_q8_1). Shared by both paths (a row is read once a call).
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* ds) {
  const int64_t nb = K / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * ldx + b * kBlock;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
        const float dd = _mm_cvtss_f32(mx) / 127.0f;
        const __m256 inv = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i iv[4];
        for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // MXCSR: half to even
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        // packs work within 128-bit lanes; the permutation puts the 32 bytes back in order.
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * kBlock), packed);
        ds[2 * (m * nb + b)] = dd;
        ds[2 * (m * nb + b) + 1] = dd * static_cast<float>(_mm_cvtsi128_si32(t));
      }
    }
  });
}

namespace avx2 {

// A Q4 block's 16 bytes as 32 unsigned nibbles in weight order: ggml puts weight j in the low nibble of byte j
// and weight j + 16 in its high nibble.
inline __m256i q4_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// One block as four vectors of 8 float32 weights (w = d q + m; Q4_0: m = -8 d, exact as (q - 8) d).
template <int64_t T>
inline void dequantize_block(const uint8_t* block, __m256 w[4]) {
  const float d = half_at(block);
  const __m256 vd = _mm256_set1_ps(d);
  if constexpr (T == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const __m256 vm = _mm256_set1_ps(T == kQ4_1 ? half_at(block + 2) : -8.0f * d);
    const __m256i q = q4_nibbles(block + (T == kQ4_1 ? 4 : 2));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd, vm);
  }
}

// out[r] = sum_k x[r, k] w[k] for MR rows (stride ldx) over one weight row of nb blocks, float32 activations.
// Four independent FMA chains whatever MR (a chain per row and vector quarter), so one row is not latency bound.
template <int64_t T, int MR>
void dot_rows_f32(const float* x, int64_t ldx, const uint8_t* wrow, int64_t nb, float* out) {
  constexpr int kChains = MR >= 4 ? 1 : 4 / MR;
  constexpr int64_t kBytes = block_bytes(T);
  __m256 acc[MR][kChains];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    dequantize_block<T>(wrow + b * kBytes, w);
    for (int r = 0; r < MR; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      for (int i = 0; i < 4; ++i) acc[r][i % kChains] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * i), w[i], acc[r][i % kChains]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    out[r] = hsum(sum);
  }
}

// out[r] = sum over blocks of d_w d_x (q_w . q_x) + m_w s_x for MR quantized rows over one weight row.
template <int64_t T, int MR>
void dot_rows_q8(const Q8Rows& xq, int64_t row, const uint8_t* wrow, float* out) {
  constexpr int64_t kBytes = block_bytes(T);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  float offsets[MR] = {};
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < xq.nb; ++b) {
    const uint8_t* block = wrow + b * kBytes;
    const float dw = half_at(block);
    __m256i qw;
    float mw = 0.0f;
    if constexpr (T == kQ8_0) {
      qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    } else {
      qw = q4_nibbles(block + (T == kQ4_1 ? 4 : 2));
      mw = T == kQ4_1 ? half_at(block + 2) : -8.0f * dw;
    }
    // NOTE: vpmaddubsw takes one unsigned operand: Q8_0 moves the weight's sign onto the activation.
    const __m256i uw = T == kQ8_0 ? _mm256_sign_epi8(qw, qw) : qw;
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (row + r) * xq.nb + b;
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q + (row + r) * xq.K + b * kBlock));
      if constexpr (T == kQ8_0) qx = _mm256_sign_epi8(qx, qw);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(uw, qx), ones));
      acc[r][b & 1] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xq.ds[2 * at]), acc[r][b & 1]);
      if constexpr (T != kQ8_0) offsets[r] += mw * xq.ds[2 * at + 1];
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r];
}

}  // namespace avx2

#if defined(BATCHINFER_GGUF_AVX512)
namespace avx512 {

// Blocks b0 and b1's quants as 64 bytes in activation order (block b0's 32, then b1's): Q4 nibbles unsigned
// 0..15; Q8_0's signed int8 as stored.
template <int64_t T>
inline __m512i quants_pair(const uint8_t* b0, const uint8_t* b1) {
  if constexpr (T == kQ8_0) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
  } else {
    constexpr int64_t kAt = T == kQ4_1 ? 4 : 2;
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kAt))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kAt)), 1);
    // 128-bit lanes [lo0, lo1, hi0, hi1] after the mask; the shuffle orders them [lo0, hi0, lo1, hi1].
    const __m512i both = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                                          _mm512_set1_epi8(0x0F));
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
  }
}

// The pair's weight scales as 4 floats [d0, m0, d1, m1] (Q4_0: m = -8 d; Q8_0: m = 0).
template <int64_t T>
inline __m128 scales_pair(const uint8_t* b0, const uint8_t* b1) {
  uint32_t h0, h1;
  if constexpr (T == kQ4_1) {
    std::memcpy(&h0, b0, 4);
    std::memcpy(&h1, b1, 4);
  } else {
    h0 = half_bits(b0) * (T == kQ4_0 ? 0x10001u : 1u);
    h1 = half_bits(b1) * (T == kQ4_0 ? 0x10001u : 1u);
  }
  const __m128 v = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(h0)), static_cast<int>(h1), 1));
  return T == kQ4_0 ? _mm_mul_ps(v, _mm_setr_ps(1.0f, -8.0f, 1.0f, -8.0f)) : v;
}

// out[r] = sum over blocks of d_w d_x (q_w . q_x) + m_w s_x for MR quantized rows over one weight row; blocks
// in pairs, an odd last block with the upper half masked off.
template <int64_t T, int MR>
void dot_rows_q8(const Q8Rows& xq, int64_t row, const uint8_t* wrow, float* out) {
  constexpr int64_t kBytes = block_bytes(T);
  constexpr int kChains = MR >= 2 ? 1 : 2;
  // Lanes 0-7 take the pair's first scale product, lanes 8-15 its second.
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[MR][kChains];
  __m128 terms[MR];  // lanes 1 and 3 sum m_w s_x
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
    terms[r] = _mm_setzero_ps();
  }
  auto pair = [&](int64_t b, int chain, bool tail) {
    const uint8_t* b0 = wrow + b * kBytes;
    const uint8_t* b1 = tail ? b0 : b0 + kBytes;
    __m512i qw = quants_pair<T>(b0, b1);
    __mmask64 negative = 0;
    if constexpr (T == kQ8_0) {
      negative = _mm512_movepi8_mask(qw);
      qw = _mm512_abs_epi8(qw);
    }
    const __m128 sw = scales_pair<T>(b0, b1);
    const __mmask64 bytes = tail ? 0xFFFFFFFFull : ~0ull;
    const __mmask8 halves = tail ? 0x3 : 0xF;
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (row + r) * xq.nb + b;
      __m512i qx = _mm512_maskz_loadu_epi8(bytes, xq.q + (row + r) * xq.K + b * kBlock);
      if constexpr (T == kQ8_0) qx = _mm512_mask_sub_epi8(qx, negative, _mm512_setzero_si512(), qx);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qx);
      const __m128 prod = _mm_mul_ps(sw, _mm_maskz_loadu_ps(halves, xq.ds + 2 * at));
      const __m512 scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(prod));
      acc[r][chain] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][chain]);
      if constexpr (T != kQ8_0) terms[r] = _mm_add_ps(terms[r], prod);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= xq.nb; b += 2) pair(b, static_cast<int>((b >> 1) % kChains), false);
  if (b < xq.nb) pair(b, 0, true);
  for (int r = 0; r < MR; ++r) {
    __m512 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
    float t[4];
    _mm_storeu_ps(t, terms[r]);
    out[r] = _mm512_reduce_add_ps(sum) + (t[1] + t[3]);
  }
}

// One block as two vectors of 16 float32 weights (w = d q + m).
template <int64_t T>
inline void dequantize_block(const uint8_t* block, __m512 w[2]) {
  const float d = half_at(block);
  const __m512 vd = _mm512_set1_ps(d);
  if constexpr (T == kQ8_0) {
    for (int i = 0; i < 2; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * i));
      w[i] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
  } else {
    const __m512 vm = _mm512_set1_ps(T == kQ4_1 ? half_at(block + 2) : -8.0f * d);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (T == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i parts[2] = {_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask)};
    for (int i = 0; i < 2; ++i) w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[i])), vd, vm);
  }
}

// out[r] = sum_k x[r, k] w[k] for MR rows (stride ldx) over one weight row of nb blocks, float32 activations;
// at least two independent FMA chains per row.
template <int64_t T, int MR>
void dot_rows_f32(const float* x, int64_t ldx, const uint8_t* wrow, int64_t nb, float* out) {
  constexpr int64_t kBytes = block_bytes(T);
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w[2];
    dequantize_block<T>(wrow + b * kBytes, w);
    for (int r = 0; r < MR; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      for (int i = 0; i < 2; ++i) acc[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16 * i), w[i], acc[r][i]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// out[i] = x . w_i for one activation row over NR weight rows (wrow + i * row_bytes), float32 activations, the
// batch-1 case of the Q4_0 / Q8_0 path (SmolLM2's Q8_0 LM head): one row alone is two FMA chains, so a block
// waits on the FMA latency; NR rows give 2 NR independent chains and share each activation load. Per row the
// same operations in the same order as dot_rows_f32<T, 1> (bit-identical, whatever the batch).
template <int64_t T, int NR>
void dot_weight_rows_f32(const float* x, const uint8_t* wrow, int64_t row_bytes, int64_t nb, float* out) {
  constexpr int64_t kBytes = block_bytes(T);
  __m512 acc[NR][2];
  for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
    for (int i = 0; i < NR; ++i) {
      __m512 w[2];
      dequantize_block<T>(wrow + i * row_bytes + b * kBytes, w);
      acc[i][0] = _mm512_fmadd_ps(x0, w[0], acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x1, w[1], acc[i][1]);
    }
  }
  for (int i = 0; i < NR; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
}

// Q4_1 weights against float32 activations, with the block's dequantization factored out of the dot:
// y = sum_b d_b (x_b . q_b) + m_b s_b, where s_b is the sum of block b's 32 activations. Four blocks (80 bytes,
// 64 of them nibbles) are one group: two loads and one two-source dword permute gather the group's 16 nibble
// dwords into one register, lane l holding dword l % 4 of block l / 4 (8 nibbles: weights 4i + j / 2 and their
// +16 partners). Nibble j of every lane is taken by one `and` with 0xF << 4j and one unsigned convert, which
// gives q 2^(4j) exactly (4 significant bits); the activations were permuted once per call to the same lane
// order and scaled by 2^-4j (exact: a power of two), so each product is x q exactly as in a plain dot (see
// permute_rows_q4_1). No widening shuffle per block, and the group's nibbles are expanded once for all MR rows.
// The scales come from the same first load (one dword permute: (d, m) of the four blocks, widened by one
// vcvtph2ps): d_b spread over block b's 4 lanes multiplies the group's partial dot, and (d_b, m_b) times
// (0, s_b) accumulates the minimum term.
// Summation order of one output: per lane, the 8 nibble products in two chains (even j, odd j) added, times d_b,
// added into the lane's accumulator group after group; then the 16 lanes reduced, plus the 8 lanes of the
// minimum terms reduced.
constexpr int64_t kGroup = 4;             // blocks per group
constexpr int64_t kGroupFloats = 128;     // permuted activations per group
constexpr int64_t kGroupTerms = 8;        // (0, s_b) pairs per group

// Rows of x [M, K] permuted to the lane order of dot_rows_q4_1_f32: xp [M, groups * 128], element j * 16 + l of
// group g being x[32 (4g + l / 4) + 4 (l % 4) + j / 2 + 16 (j % 2)] 2^(-4j) (zero past the last block), and
// sxi [M, groups * 8] holding (0, s_b) per block, s_b summed in order.
// 2^(-4j), j = 0..7: exact powers of two (a table rather than a std::ldexp call per element).
constexpr float kNibbleScale[8] = {1.0f,        0x1p-4f,  0x1p-8f,  0x1p-12f,
                                   0x1p-16f,    0x1p-20f, 0x1p-24f, 0x1p-28f};

void permute_rows_q4_1(const float* x, int64_t ldx, int64_t M, int64_t nb, float* xp, float* sxi) {
  const int64_t groups = (nb + kGroup - 1) / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * ldx;
      float* p = xp + m * groups * kGroupFloats;
      float* s = sxi + m * groups * kGroupTerms;
      for (int64_t g = 0; g < groups; ++g) {
        for (int j = 0; j < 8; ++j) {
          const float scale = kNibbleScale[j];
          for (int l = 0; l < 16; ++l) {
            const int64_t b = kGroup * g + l / 4;
            const int64_t k = kBlock * b + 4 * (l % 4) + j / 2 + 16 * (j % 2);
            p[g * kGroupFloats + j * 16 + l] = b < nb ? xr[k] * scale : 0.0f;
          }
        }
        for (int64_t i = 0; i < kGroup; ++i) {
          const int64_t b = kGroup * g + i;
          float sum = 0.0f;
          for (int64_t k = 0; b < nb && k < kBlock; ++k) sum += xr[kBlock * b + k];
          s[g * kGroupTerms + 2 * i] = 0.0f;
          s[g * kGroupTerms + 2 * i + 1] = sum;
        }
      }
    }
  });
}

// One group of Q4_1 blocks at p (kGroup blocks, or the row's last 1-3: `blocks`; past them nothing is read):
// `quants` holds the 16 nibble dwords of the group's blocks side by side, `dm` each block's (d, m) as floats and
// `d` each block's d spread over its four lanes of `quants`.
struct Q41Group {
  __m512i quants;
  __m256 dm;
  __m512 d;
};

inline Q41Group load_q4_1_group(const uint8_t* p, int64_t blocks) {
  const __m512i nibbles_at = _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19);
  const __m512i scales_at = _mm512_setr_epi32(0, 5, 10, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i d_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  __m512i lo, hi;
  if (blocks >= kGroup) {
    lo = _mm512_loadu_si512(p);
    hi = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
  } else {  // 5 dwords a block, the rest masked off
    lo = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (5 * blocks)) - 1u), p);
    hi = _mm512_setzero_si512();
  }
  Q41Group group;
  group.quants = _mm512_permutex2var_epi32(lo, nibbles_at, hi);
  group.dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(scales_at, lo)));
  group.d = _mm512_permutexvar_ps(d_lanes, _mm512_castps256_ps512(group.dm));
  return group;
}

// out[r] = x_r . w for MR permuted activation rows (xp, sxi with strides ld_xp, ld_sxi) over one Q4_1 weight row.
template <int MR>
void dot_rows_q4_1_f32(const float* xp, int64_t ld_xp, const float* sxi, int64_t ld_sxi, const uint8_t* wrow,
                       int64_t nb, float* out) {
  const int64_t groups = (nb + kGroup - 1) / kGroup;
  __m512 acc[MR];
  __m256 terms[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    terms[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const Q41Group group = load_q4_1_group(wrow + g * kGroup * 20, nb - kGroup * g);
    __m512 q[8];
    for (int j = 0; j < 8; ++j) {
      q[j] = _mm512_cvtepu32_ps(
          _mm512_and_si512(group.quants, _mm512_set1_epi32(static_cast<int>(0xFu << (4 * j)))));
    }
    for (int r = 0; r < MR; ++r) {
      const float* xg = xp + r * ld_xp + g * kGroupFloats;
      __m512 even = _mm512_mul_ps(_mm512_loadu_ps(xg), q[0]);
      __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(xg + 16), q[1]);
      for (int j = 2; j < 8; j += 2) {
        even = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16 * j), q[j], even);
        odd = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16 * (j + 1)), q[j + 1], odd);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even, odd), group.d, acc[r]);
      terms[r] = _mm256_fmadd_ps(group.dm, _mm256_loadu_ps(sxi + r * ld_sxi + g * kGroupTerms), terms[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + hsum(terms[r]);
}

// out[i] = x . w_i for one permuted activation row over NR Q4_1 weight rows (wrow + i * row_bytes), the batch-1
// case: each activation vector is loaded once for the NR rows, and the rows' independent chains interleave.
// Per row the same operations in the same order as dot_rows_q4_1_f32<1>.
template <int NR>
void dot_weight_rows_q4_1_f32(const float* xp, const float* sxi, const uint8_t* wrow, int64_t row_bytes, int64_t nb,
                              float* out) {
  const int64_t groups = (nb + kGroup - 1) / kGroup;
  __m512 acc[NR];
  __m256 terms[NR];
  for (int i = 0; i < NR; ++i) {
    acc[i] = _mm512_setzero_ps();
    terms[i] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    Q41Group group[NR];
    const __m256 sx = _mm256_loadu_ps(sxi + g * kGroupTerms);
    for (int i = 0; i < NR; ++i) {
      group[i] = load_q4_1_group(wrow + i * row_bytes + g * kGroup * 20, nb - kGroup * g);
      terms[i] = _mm256_fmadd_ps(group[i].dm, sx, terms[i]);
    }
    const float* xg = xp + g * kGroupFloats;
    __m512 even[NR], odd[NR];
    for (int j = 0; j < 8; j += 2) {
      const __m512 xe = _mm512_loadu_ps(xg + 16 * j), xo = _mm512_loadu_ps(xg + 16 * (j + 1));
      const __m512i me = _mm512_set1_epi32(static_cast<int>(0xFu << (4 * j)));
      const __m512i mo = _mm512_set1_epi32(static_cast<int>(0xFu << (4 * (j + 1))));
      for (int i = 0; i < NR; ++i) {
        const __m512 qe = _mm512_cvtepu32_ps(_mm512_and_si512(group[i].quants, me));
        const __m512 qo = _mm512_cvtepu32_ps(_mm512_and_si512(group[i].quants, mo));
        even[i] = j == 0 ? _mm512_mul_ps(xe, qe) : _mm512_fmadd_ps(xe, qe, even[i]);
        odd[i] = j == 0 ? _mm512_mul_ps(xo, qo) : _mm512_fmadd_ps(xo, qo, odd[i]);
      }
    }
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), group[i].d, acc[i]);
  }
  for (int i = 0; i < NR; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + hsum(terms[i]);
}

}  // namespace avx512
#endif  // BATCHINFER_GGUF_AVX512

// Software prefetch of the `bytes` that follow [p, p + bytes) by kPrefetchDistance, not past `end`: a batch-1
// call streams its weight rows once, and the hardware prefetcher alone leaves the row's dot waiting on memory
// (measured by bench/q4_step_cpu.py: the linears took the sum of their in-cache time and the memory's).
constexpr int64_t kPrefetchDistance = 4096;

inline void prefetch_ahead(const uint8_t* p, int64_t bytes, const uint8_t* end) {
  for (const uint8_t* q = p + kPrefetchDistance; q < p + kPrefetchDistance + bytes && q < end; q += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
  }
}

// Rows [m, m + rows) (rows <= kMR) against weight row n, written to y[:, n] (+ bias).
template <Isa I, int64_t T, bool kQ8, int R>
inline void dot_rows(const float* x, int64_t ldx, const Q8Rows& xq, int64_t m, const uint8_t* wrow, int64_t nb,
                     float* out) {
#if defined(BATCHINFER_GGUF_AVX512)
  if constexpr (I == Isa::kAvx512Vnni) {
    if constexpr (kQ8) {
      avx512::dot_rows_q8<T, R>(xq, m, wrow, out);
    } else {
      avx512::dot_rows_f32<T, R>(x + m * ldx, ldx, wrow, nb, out);
    }
    return;
  }
#endif
  if constexpr (kQ8) {
    avx2::dot_rows_q8<T, R>(xq, m, wrow, out);
  } else {
    avx2::dot_rows_f32<T, R>(x + m * ldx, ldx, wrow, nb, out);
  }
}

template <Isa I, int64_t T, bool kQ8>
void group(int rows, const float* x, int64_t ldx, const Q8Rows& xq, int64_t m, const uint8_t* wrow, int64_t nb,
           float* y, int64_t N, int64_t n, float bias) {
  float out[kMR];
  switch (rows) {
    case 1:
      dot_rows<I, T, kQ8, 1>(x, ldx, xq, m, wrow, nb, out);
      break;
    case 2:
      dot_rows<I, T, kQ8, 2>(x, ldx, xq, m, wrow, nb, out);
      break;
    case 3:
      dot_rows<I, T, kQ8, 3>(x, ldx, xq, m, wrow, nb, out);
      break;
    default:
      dot_rows<I, T, kQ8, 4>(x, ldx, xq, m, wrow, nb, out);
      break;
  }
  for (int r = 0; r < rows; ++r) y[(m + r) * N + n] = out[r] + bias;
}

template <Isa I, int64_t T, bool kQ8>
void run(const float* x, int64_t ldx, const Q8Rows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t N,
         const float* bias, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(T);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      int64_t n = n0;
#if defined(BATCHINFER_GGUF_AVX512)
      if constexpr (I == Isa::kAvx512Vnni && !kQ8) {
        if (m1 - m0 == 1) {  // one activation row (batch-1 decode): weight rows in fours share its loads
          float out[kWeightRows];
          for (; n + kWeightRows <= n1; n += kWeightRows) {
            prefetch_ahead(w + n * row_bytes, kWeightRows * row_bytes, w + n1 * row_bytes);
            avx512::dot_weight_rows_f32<T, kWeightRows>(x + m0 * ldx, w + n * row_bytes, row_bytes, nb, out);
            for (int i = 0; i < kWeightRows; ++i) y[m0 * N + n + i] = out[i] + (bias == nullptr ? 0.0f : bias[n + i]);
          }
        }
      }
#endif
      for (; n < n1; ++n) {
        const float b = bias == nullptr ? 0.0f : bias[n];
        if (M <= kMR) prefetch_ahead(w + n * row_bytes, row_bytes, w + n1 * row_bytes);
        for (int64_t m = m0; m < m1; m += kMR) {
          group<I, T, kQ8>(static_cast<int>(std::min<int64_t>(kMR, m1 - m)), x, ldx, xq, m, w + n * row_bytes, nb,
                           y, N, n, b);
        }
      }
    }
  });
}

#if defined(BATCHINFER_GGUF_AVX512)
// Q4_1 x float32 activations on AVX-512: the rows are permuted once (avx512::permute_rows_q4_1), then split
// like run().
void run_q4_1_f32_avx512(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         const float* bias, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(kQ4_1);
  const int64_t groups = (nb + avx512::kGroup - 1) / avx512::kGroup;
  const int64_t ld_xp = groups * avx512::kGroupFloats, ld_sxi = groups * avx512::kGroupTerms;
  std::vector<float> xp(M * ld_xp), sxi(M * ld_sxi);
  avx512::permute_rows_q4_1(x, ldx, M, nb, xp.data(), sxi.data());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[kMR];
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      int64_t n = n0;
      if (m1 - m0 == 1) {  // one activation row (batch-1 decode): weight rows in pairs share its loads
        for (; n + 2 <= n1; n += 2) {
          prefetch_ahead(w + n * row_bytes, 2 * row_bytes, w + n1 * row_bytes);
          avx512::dot_weight_rows_q4_1_f32<2>(xp.data() + m0 * ld_xp, sxi.data() + m0 * ld_sxi, w + n * row_bytes,
                                              row_bytes, nb, out);
          for (int i = 0; i < 2; ++i) y[m0 * N + n + i] = out[i] + (bias == nullptr ? 0.0f : bias[n + i]);
        }
      }
      for (; n < n1; ++n) {
        const float b = bias == nullptr ? 0.0f : bias[n];
        const uint8_t* wrow = w + n * row_bytes;
        if (M <= kMR) prefetch_ahead(wrow, row_bytes, w + n1 * row_bytes);
        for (int64_t m = m0; m < m1; m += kMR) {
          const int rows = static_cast<int>(std::min<int64_t>(kMR, m1 - m));
          const float* xr = xp.data() + m * ld_xp;
          const float* sr = sxi.data() + m * ld_sxi;
          switch (rows) {
            case 1:
              avx512::dot_rows_q4_1_f32<1>(xr, ld_xp, sr, ld_sxi, wrow, nb, out);
              break;
            case 2:
              avx512::dot_rows_q4_1_f32<2>(xr, ld_xp, sr, ld_sxi, wrow, nb, out);
              break;
            case 3:
              avx512::dot_rows_q4_1_f32<3>(xr, ld_xp, sr, ld_sxi, wrow, nb, out);
              break;
            default:
              avx512::dot_rows_q4_1_f32<4>(xr, ld_xp, sr, ld_sxi, wrow, nb, out);
              break;
          }
          for (int r = 0; r < rows; ++r) y[(m + r) * N + n] = out[r] + b;
        }
      }
    }
  });
}
#endif

template <Isa I>
void run_type(int64_t type, bool q8, const float* x, int64_t ldx, const Q8Rows& xq, int64_t M, int64_t K,
              const uint8_t* w, int64_t N, const float* bias, float* y) {
#define BATCHINFER_GGUF_RUN(T)                        \
  if (q8) {                                           \
    run<I, T, true>(x, ldx, xq, M, K, w, N, bias, y);  \
  } else {                                            \
    run<I, T, false>(x, ldx, xq, M, K, w, N, bias, y); \
  }
#if defined(BATCHINFER_GGUF_AVX512)
  if (I == Isa::kAvx512Vnni && type == kQ4_1 && !q8) {
    run_q4_1_f32_avx512(x, ldx, M, K, w, N, bias, y);
    return;
  }
#endif
  if (type == kQ4_0) {
    BATCHINFER_GGUF_RUN(kQ4_0)
  } else if (type == kQ4_1) {
    BATCHINFER_GGUF_RUN(kQ4_1)
  } else {
    BATCHINFER_GGUF_RUN(kQ8_0)
  }
#undef BATCHINFER_GGUF_RUN
}

#endif  // BATCHINFER_GGUF_AVX2

// The paths this build offers on this CPU, best first ("avx512vnni", "avx2"); empty without AVX2/FMA/F16C.
// Computed once: every call asks for it.
const std::vector<std::string>& available_isas() {
  static const std::vector<std::string> isas = [] {
    std::vector<std::string> found;
#if defined(BATCHINFER_GGUF_AVX512)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
      found.emplace_back("avx512vnni");
    }
#endif
#if defined(BATCHINFER_GGUF_AVX2)
    found.emplace_back("avx2");
#endif
    return found;
  }();
  return isas;
}

std::vector<std::string> gguf_linear_isas() { return available_isas(); }

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t out_features,
                       const std::optional<at::Tensor>& bias, bool quantize_activations, c10::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU tensor [num_rows, in_features]");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must have unit stride in its last dimension");
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(bytes > 0, "GGUF block type ", type, " is not served (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 are)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of the block size 32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) == N && blocks.size(1) == K / kBlock * bytes,
              "blocks must be contiguous uint8 [out_features, in_features / 32 * ", bytes, "]");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N, "bias must be float32 [out_features]");
    b = bias_c.data_ptr<float>();
  }
  const std::vector<std::string>& isas = available_isas();
  TORCH_CHECK(!isas.empty(), "the GGUF block kernels need AVX2, FMA and F16C, which this CPU (or build) lacks");
  const std::string chosen = isa.empty() ? isas.front() : std::string(isa);
  TORCH_CHECK(std::find(isas.begin(), isas.end(), chosen) != isas.end(), "instruction set '", chosen,
              "' is not available for the GGUF block kernels on this CPU (or build); available: ", isas.front(),
              isas.size() > 1 ? ", " + isas.back() : std::string());
#if defined(BATCHINFER_GGUF_AVX2)
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / kBlock;
  std::vector<int8_t> q;
  std::vector<float> ds;
  Q8Rows xq{nullptr, nullptr, K, nb};
  if (quantize_activations) {
    q.resize(M * K);
    ds.resize(2 * M * nb);
    quantize_rows_q8(xp, x.stride(0), M, K, q.data(), ds.data());
    xq = Q8Rows{q.data(), ds.data(), K, nb};
  }
#if defined(BATCHINFER_GGUF_AVX512)
  if (chosen == "avx512vnni") {
    run_type<Isa::kAvx512Vnni>(type, quantize_activations, xp, x.stride(0), xq, M, K, w, N, b, yp);
    return y;
  }
#endif
  run_type<Isa::kAvx2>(type, quantize_activations, xp, x.stride(0), xq, M, K, w, N, b, yp);
  return y;
#else
  (void)quantize_activations;
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "gguf_linear(Tensor x, Tensor blocks, int type, int out_features, Tensor? bias, bool quantize_activations, "
      "str isa=\"\") -> Tensor");
  m.def("gguf_linear_isas() -> str[]", gguf_linear_isas);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { m.impl("gguf_linear", gguf_linear); }
