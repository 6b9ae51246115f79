// Linear layer over a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0), y = x W^T + b, for CPUs with AVX2,
// FMA and F16C (issue #27). The weight stays as the file holds it: row n of W [N, K] is K / 32 blocks of 32
// weights, each block a float16 scale d (and for Q4_1 a float16 minimum m) and its packed quants
// (ggml's block_q4_0 / block_q4_1 / block_q8_0 layout, 18 / 20 / 34 bytes), so a decode step reads 0.56-1.06
// bytes a weight instead of float32's 4.
//
// Registered as `batchinfer_cpu::gguf_linear` and `batchinfer_cpu::gguf_linear_isa` (built and loaded by
// cpu_extension.py). Two ways to multiply, chosen per call (llama.cpp's two designs for AVX2):
//   - float32 activations: each block is dequantized in registers (nibbles -> int32 -> float, w = d q + m as one
//     FMA) and multiplied with float32 FMAs; only the summation order differs from a dequantize-matmul.
//   - Q8 activations: each activation row is quantized per block of 32 to int8 with a float scale
//     (d_x = max|x| / 127, llama.cpp's block_q8_1, whose s_x = d_x sum q_x carries Q4_1's minimum and Q4_0's
//     offset of 8), and a block's dot is an integer dot (vpmaddubsw unsigned nibbles x signed int8, vpmaddwd)
//     scaled once by d_w d_x: a quarter of the instructions, at the cost of the activations' rounding.
// Output rows are split across torch's threads; every activation row group (up to kMR rows) reuses each
// expanded weight block, and activations are visited in blocks of kRowBlock rows so a prefill chunk stays in
// L2 while a thread's weight rows stream past it.
//
// The build is -march=native: on a CPU without AVX2/FMA/F16C the ops exist but refuse with an error naming the
// instruction sets (gguf_linear_isa() returns "" there, which callers check at load).

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
#endif

namespace {

// ggml's type ids (ggml.h, enum ggml_type).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;     // weights per block
constexpr int kMR = 4;             // activation rows sharing one expanded weight block
constexpr int64_t kRowBlock = 64;  // activation rows per pass over a thread's weight rows

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0:
      return 18;
    case kQ4_1:
      return 20;
    case kQ8_0:
      return 34;
    default:
      return 0;
  }
}

#if defined(BATCHINFER_GGUF_AVX2)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

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
  constexpr int64_t kBytes = T == kQ8_0 ? 34 : (T == kQ4_1 ? 20 : 18);
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

// Activation rows quantized per block (see quantize_rows_q8): int8 q [M, K], scale d and d * sum(q) s [M, nb].
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, nb;
};

// out[r] = sum over blocks of d_w d_x (q_w . q_x) + m_w s_x for MR quantized rows over one weight row.
template <int64_t T, int MR>
void dot_rows_q8(const Q8Rows& xq, int64_t row, const uint8_t* wrow, float* out) {
  constexpr int64_t kBytes = T == kQ8_0 ? 34 : (T == kQ4_1 ? 20 : 18);
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
      acc[r][b & 1] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xq.d[at]), acc[r][b & 1]);
      if constexpr (T != kQ8_0) offsets[r] += mw * xq.s[at];
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r];
}

// Rows of x [M, K] to int8 per block of 32: d = max|x| / 127, q = round-half-even(x / d) (0 for an all-zero
// block), s = d * sum(q) (llama.cpp's quantize_row_q8_1).
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
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
        d[m * nb + b] = dd;
        s[m * nb + b] = dd * static_cast<float>(_mm_cvtsi128_si32(t));
      }
    }
  });
}

// Rows [m, m + rows) (rows <= kMR) against weight row n, written to y[:, n] (+ bias).
template <int64_t T, bool kQ8>
void group(int rows, const float* x, int64_t ldx, const Q8Rows& xq, int64_t m, const uint8_t* wrow, int64_t nb,
           float* y, int64_t N, int64_t n, float bias) {
  float out[kMR];
  switch (rows) {
#define BATCHINFER_GGUF_ROWS(R)                                   \
  case R:                                                         \
    if constexpr (kQ8) {                                          \
      dot_rows_q8<T, R>(xq, m, wrow, out);                        \
    } else {                                                      \
      dot_rows_f32<T, R>(x + m * ldx, ldx, wrow, nb, out);        \
    }                                                             \
    break;
    BATCHINFER_GGUF_ROWS(1)
    BATCHINFER_GGUF_ROWS(2)
    BATCHINFER_GGUF_ROWS(3)
    BATCHINFER_GGUF_ROWS(4)
#undef BATCHINFER_GGUF_ROWS
  }
  for (int r = 0; r < rows; ++r) y[(m + r) * N + n] = out[r] + bias;
}

template <int64_t T, bool kQ8>
void run(const float* x, int64_t ldx, const Q8Rows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t N,
         const float* bias, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(T);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t n = n0; n < n1; ++n) {
        const float b = bias == nullptr ? 0.0f : bias[n];
        for (int64_t m = m0; m < m1; m += kMR) {
          group<T, kQ8>(static_cast<int>(std::min<int64_t>(kMR, m1 - m)), x, ldx, xq, m, w + n * row_bytes, nb, y, N,
                        n, b);
        }
      }
    }
  });
}

#endif  // BATCHINFER_GGUF_AVX2

std::string gguf_linear_isa() {
#if defined(BATCHINFER_GGUF_AVX2)
  return "avx2";
#else
  return "";
#endif
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t out_features,
                       const std::optional<at::Tensor>& bias, bool quantize_activations) {
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
#if defined(BATCHINFER_GGUF_AVX2)
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / kBlock;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Q8Rows xq{nullptr, nullptr, nullptr, K, nb};
  if (quantize_activations) {
    q.resize(M * K);
    d.resize(M * nb);
    s.resize(M * nb);
    quantize_rows_q8(xp, x.stride(0), M, K, q.data(), d.data(), s.data());
    xq = Q8Rows{q.data(), d.data(), s.data(), K, nb};
  }
#define BATCHINFER_GGUF_RUN(T)                                     \
  if (quantize_activations) {                                      \
    run<T, true>(xp, x.stride(0), xq, M, K, w, N, b, yp);          \
  } else {                                                         \
    run<T, false>(xp, x.stride(0), xq, M, K, w, N, b, yp);         \
  }
  if (type == kQ4_0) {
    BATCHINFER_GGUF_RUN(kQ4_0)
  } else if (type == kQ4_1) {
    BATCHINFER_GGUF_RUN(kQ4_1)
  } else {
    BATCHINFER_GGUF_RUN(kQ8_0)
  }
#undef BATCHINFER_GGUF_RUN
  return y;
#else
  (void)quantize_activations;
  TORCH_CHECK(false, "the GGUF block kernels need AVX2, FMA and F16C, which this CPU (or build) lacks");
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, int out_features, Tensor? bias, bool quantize_activations) -> Tensor");
  m.def("gguf_linear_isa() -> str", gguf_linear_isa);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { m.impl("gguf_linear", gguf_linear); }
