// Bidirectional (non-causal) attention over packed variable-length sequences for x86/ARM CPUs: the encoder
// attention of BERT-family embedders (worker/engine/executor/models/bert.py). Its causal twin for a decoder's
// fresh prompts, with grouped-query attention and bfloat16 inputs, is the second half of this file.
//
// Registered as the Torch op `batchinfer_cpu::varlen_attention_` (built and loaded by cpu_extension.py).
// Sequence s owns rows cu_seqlens[s] .. cu_seqlens[s + 1] of q, k and v and attends to exactly those rows:
// no padding, no mask and no FLOP across sequences (FlashAttention's `cu_seqlens` convention, Dao et al.
// 2022). One work item is one (sequence, head); items are split into one contiguous run per thread of about
// equal cost (L^2 + a fixed overhead per item) with at::parallel_for, so torch.set_num_threads governs it.
//
// Per item, K is packed transposed ([head_size][L], zero padded to whole vectors of keys; 8 x 8 blocks
// transposed in registers) and V contiguous ([L][head_size]) in a per-thread buffer, so both products are
// small register-blocked GEMMs: scores = Q K^T, unscaled, for kScoreRows query rows x two vectors of keys at a
// time (AVX2: 6 x 16, 12 of the 16 registers as accumulators; AVX-512: 12 x 32, 24 of 32), each row's max over
// its real keys taken from the accumulators as the tile is stored; then an exact softmax per row in float32
// (one pass of exp(scale * (s - max)) and the sum: the max needs no pass of its own); then P V for kOutRows
// rows x 32 output features (AVX2: 3 x 4 vectors; AVX-512: 12 x 2), the division by the row sum applied once
// at the end. Scores for a row block live in a small buffer (L1). Against the first version (separate max
// pass, scale in the score epilogue, Cephes' exp with both clamps, K transposed element by element) this ran
// 1.3x faster on BERT's shapes (docs/engine.md, Embeddings).
//
// A row's output is a fixed sequence of float operations on its query and its sequence's K/V (the same
// tiles and the same order whatever the other sequences of the call or the thread), so it is batch
// invariant. Every score and output is one chain in order, the max is exact and the softmax sums keep eight
// lanes in every build, so the AVX2 and AVX-512 builds give the same bits (compared on one AVX-512 machine
// against a build with -mno-avx512f; not yet across machines).
// It differs from torch's scaled_dot_product_attention by float32 rounding only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_exp.h"

namespace {

using batchinfer_kernels::ivec16;
using batchinfer_kernels::ivec8;
using batchinfer_kernels::load8;
using batchinfer_kernels::store8;
using batchinfer_kernels::vec16;
using batchinfer_kernels::vec8;
using batchinfer_kernels::round_bf16;
using batchinfer_kernels::widen_bf16;

// GCC/Clang vector extension of one AVX-512 register (16 floats) or one AVX register (8), as in cpu_gemm.cpp.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kScoreRows = 12;  // query rows scored together: 2 x 12 of the 32 registers hold accumulators
constexpr int kOutRows = 12;    // rows of P V together: 12 x 2 accumulators
#else
constexpr int64_t kLanes = 8;
constexpr int kScoreRows = 6;  // 2 x 6 of the 16 registers
constexpr int kOutRows = 3;    // 3 x 4
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr int64_t kKeyTile = 2 * kLanes;     // keys scored together: two vectors (K^T rows padded to one)
constexpr int64_t kOutChunk = 32;            // output features per P V pass (4 AVX or 2 AVX-512 vectors)
constexpr int64_t kItemOverhead = 64;        // fixed cost of an item (packing, calls), in L^2 units

template <typename V>
inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// scores[r][j0 .. j0 + NK vectors) = q_r . k_j (unscaled) for R query rows (q rows `q_stride` apart); each
// score is one multiply-add chain over d in order. row_max[r] takes the lane-wise max of the tile's scores of
// keys below `valid` (keys counted from j0; the zero-padded ones past L are left out).
template <int R, int NK>
inline void score_tile(const float* __restrict q, int64_t q_stride, const float* __restrict kt, int64_t head_size,
                       int64_t padded_len, int64_t valid, float* __restrict scores, vec* __restrict row_max) {
  vec acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NK; ++n) acc[r][n] = vec{};
  for (int64_t d = 0; d < head_size; ++d) {
    vec w[NK];
    for (int n = 0; n < NK; ++n) w[n] = loadv<vec>(kt + d * padded_len + n * kLanes);
    for (int r = 0; r < R; ++r) {
      const float qs = q[r * q_stride + d];
      for (int n = 0; n < NK; ++n) acc[r][n] += qs * w[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NK; ++n) storev(scores + r * padded_len + n * kLanes, acc[r][n]);
  if (valid >= NK * kLanes) {
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NK; ++n) row_max[r] = acc[r][n] > row_max[r] ? acc[r][n] : row_max[r];
  } else {
    ivec lane;
    for (int l = 0; l < kLanes; ++l) lane[l] = l;
    for (int n = 0; n < NK; ++n) {
      const ivec live = lane + static_cast<int32_t>(n * kLanes) < static_cast<int32_t>(valid);
      for (int r = 0; r < R; ++r) row_max[r] = (live & (acc[r][n] > row_max[r])) ? acc[r][n] : row_max[r];
    }
  }
}

// All key tiles of R query rows: two vectors of keys at a time, the last vector alone when it is odd.
template <int R>
inline void score_rows(const float* q, int64_t q_stride, const float* kt, int64_t head_size, int64_t padded_len,
                       int64_t L, float* scores, vec* row_max) {
  for (int r = 0; r < R; ++r) row_max[r] = vec{} - __builtin_inff();
  int64_t j0 = 0;
  for (; j0 + kKeyTile <= padded_len; j0 += kKeyTile) {
    score_tile<R, 2>(q, q_stride, kt + j0, head_size, padded_len, L - j0, scores + j0, row_max);
  }
  if (j0 < padded_len) score_tile<R, 1>(q, q_stride, kt + j0, head_size, padded_len, L - j0, scores + j0, row_max);
}

// exp(x) for x <= 0 (a softmax's shifted, scaled scores): Cody-Waite reduction to r in [-ln2/2, ln2/2] as in
// Cephes' expf, a degree-5 polynomial for exp(r) (coefficients fitted here for least relative error: below
// 2e-7 over the interval in float32, as Cephes' degree 7), and 2^n written straight from the rounding
// constant's low bits. x is clamped below at -87, so 2^n stays a normal float. Generic vector code: the AVX2
// and AVX-512 builds run the same operations lane by lane.
template <typename T, typename IT>
inline T exp_nonpositive(T x) {
  constexpr float kRound = 12582912.0f + 127.0f;  // 1.5 * 2^23 + the exponent bias
  x = x < -87.0f ? T{} - 87.0f : x;
  const T t = x * 1.44269504088896341f + kRound;  // low mantissa bits of t: n + 127, n = round(x / ln 2)
  const T n = t - kRound;
  T r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  T p = T{} + 8.317515254e-3f;
  p = p * r + 4.190258682e-2f;
  p = p * r + 1.666720361e-1f;
  p = p * r + 4.999911487e-1f;
  p = p * r + 9.999998808e-1f;
  p = p * r + 1.0f;
  IT bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = bits << 23;
  T pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return p * pow2;
}

// Row of L unscaled scores -> exp(scale * (s - max)) in place (max: the lanes of row_max); returns 1 / sum.
// The exponentials run a register wide, the last partial vector of eight in full (the row is padded to whole
// vectors; its lanes past L are left out of the sum and never read). The sum keeps eight lanes in every build
// (a wide vector is added as its halves in order), so the bits match.
inline float softmax_row(float* __restrict s, int64_t L, float scale, vec row_max) {
  float max_score = row_max[0];
  for (int l = 1; l < kLanes; ++l) max_score = std::max(max_score, row_max[l]);
  const float shift = -max_score * scale;
  vec8 sum8{};
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= L; j += 16) {
    const vec16 p = exp_nonpositive<vec16, ivec16>(loadv<vec16>(s + j) * scale + shift);
    storev(s + j, p);
    sum8 += __builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7);
    sum8 += __builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
  }
#endif
  for (; j + 8 <= L; j += 8) {
    const vec8 p = exp_nonpositive<vec8, ivec8>(load8(s + j) * scale + shift);
    store8(s + j, p);
    sum8 += p;
  }
  if (j < L) {
    const vec8 p = exp_nonpositive<vec8, ivec8>(load8(s + j) * scale + shift);
    store8(s + j, p);
    const ivec8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    sum8 += lane < static_cast<int32_t>(L - j) ? p : vec8{};
  }
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += sum8[l];
  return 1.0f / sum;
}

// out[r][0 .. NV vectors of V) = inv_sum[r] * sum_j p[r][j] v[j][...] for R rows (p rows `padded_len` apart,
// v rows `head_size` apart, out rows `out_stride` apart); each output one chain over j in order.
template <int R, int NV, typename V>
inline void weigh_values(const float* __restrict p, int64_t padded_len, const float* __restrict v, int64_t head_size,
                         int64_t L, const float* inv_sum, float* __restrict out, int64_t out_stride) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = V{};
  for (int64_t j = 0; j < L; ++j) {
    V w[NV];
    for (int n = 0; n < NV; ++n) w[n] = loadv<V>(v + j * head_size + kWidth * n);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * padded_len + j];
      for (int n = 0; n < NV; ++n) acc[r][n] += pr * w[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) storev(out + r * out_stride + kWidth * n, acc[r][n] * inv_sum[r]);
}

// R rows of P V over all output features: chunks of kOutChunk, then whole vectors, then (AVX-512, a head
// size not a multiple of 16) one chunk of eight.
template <int R>
void weigh_values_rows(const float* p, int64_t padded_len, const float* v, int64_t head_size, int64_t L,
                       const float* inv_sum, float* out, int64_t out_stride) {
  constexpr int kChunkVecs = static_cast<int>(kOutChunk / kLanes);
  int64_t d0 = 0;
  for (; d0 + kOutChunk <= head_size; d0 += kOutChunk) {
    weigh_values<R, kChunkVecs, vec>(p, padded_len, v + d0, head_size, L, inv_sum, out + d0, out_stride);
  }
  for (; d0 + kLanes <= head_size; d0 += kLanes) {
    weigh_values<R, 1, vec>(p, padded_len, v + d0, head_size, L, inv_sum, out + d0, out_stride);
  }
  for (; d0 < head_size; d0 += 8) {
    weigh_values<R, 1, vec8>(p, padded_len, v + d0, head_size, L, inv_sum, out + d0, out_stride);
  }
}

template <int R>
inline void weigh_block(int rows, const float* p, int64_t padded_len, const float* v, int64_t head_size, int64_t L,
                        const float* inv_sum, float* out, int64_t out_stride) {
  if constexpr (R > 0) {
    if (rows == R) {
      weigh_values_rows<R>(p, padded_len, v, head_size, L, inv_sum, out, out_stride);
    } else {
      weigh_block<R - 1>(rows, p, padded_len, v, head_size, L, inv_sum, out, out_stride);
    }
  }
}

// Rows [0, rows) of a score block (rows <= kScoreRows) through softmax and P V.
void finish_rows(int rows, float* scores, const vec* row_max, float scale, int64_t padded_len, const float* v,
                 int64_t head_size, int64_t L, float* out, int64_t out_stride) {
  float inv_sum[kScoreRows];
  for (int r = 0; r < rows; ++r) inv_sum[r] = softmax_row(scores + r * padded_len, L, scale, row_max[r]);
  for (int r0 = 0; r0 < rows; r0 += kOutRows) {
    weigh_block<kOutRows>(std::min(kOutRows, rows - r0), scores + r0 * padded_len, padded_len, v, head_size, L,
                          inv_sum + r0, out + r0 * out_stride, out_stride);
  }
}

template <int R>
inline void score_block(int rows, const float* q, int64_t q_stride, const float* kt, int64_t head_size,
                        int64_t padded_len, int64_t L, float* scores, vec* row_max) {
  if constexpr (R > 0) {
    if (rows == R) {
      score_rows<R>(q, q_stride, kt, head_size, padded_len, L, scores, row_max);
    } else {
      score_block<R - 1>(rows, q, q_stride, kt, head_size, padded_len, L, scores, row_max);
    }
  }
}

// kt[d][j] = k[j][d] for d < head_size (a multiple of 8), j < L, rows of kt `padded_len` apart and zero past L:
// 8 x 8 blocks transposed in registers (three rounds of shuffles), a last partial block of keys read through a
// zero-filled copy.
void pack_keys_transposed(const float* k, int64_t k_stride, int64_t L, int64_t head_size, int64_t padded_len,
                          float* kt) {
  float tail[8][8];
  for (int64_t j0 = 0; j0 < L; j0 += 8) {
    const int64_t rows = std::min<int64_t>(8, L - j0);
    for (int64_t d0 = 0; d0 < head_size; d0 += 8) {
      vec8 a[8];
      if (rows == 8) {
        for (int i = 0; i < 8; ++i) a[i] = load8(k + (j0 + i) * k_stride + d0);
      } else {
        std::memset(tail, 0, sizeof(tail));
        for (int64_t i = 0; i < rows; ++i) std::memcpy(tail[i], k + (j0 + i) * k_stride + d0, sizeof(tail[i]));
        for (int i = 0; i < 8; ++i) a[i] = load8(tail[i]);
      }
      vec8 t[8], u[8];
      for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(a[i], a[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(a[i], a[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
      }
      for (int i = 0; i < 4; ++i) {
        store8(kt + (d0 + i) * padded_len + j0, __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
        store8(kt + (d0 + i + 4) * padded_len + j0,
               __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15));
      }
    }
  }
  const int64_t filled = (L + 7) / 8 * 8;
  for (int64_t d = 0; d < head_size; ++d) std::fill(kt + d * padded_len + filled, kt + (d + 1) * padded_len, 0.0f);
}

// One (sequence, head): L tokens whose head-h rows start at q, k, v; out rows are num_heads * head_size apart.
void attend_item(const float* q, const float* k, const float* v, int64_t L, int64_t q_stride, int64_t k_stride,
                 int64_t v_stride, int64_t head_size, float scale, float* out, int64_t out_stride, float* kt,
                 float* vpack, float* scores) {
  const int64_t padded_len = (L + kLanes - 1) / kLanes * kLanes;
  pack_keys_transposed(k, k_stride, L, head_size, padded_len, kt);
  for (int64_t j = 0; j < L; ++j) std::memcpy(vpack + j * head_size, v + j * v_stride, head_size * sizeof(float));
  vec row_max[kScoreRows];
  for (int64_t i0 = 0; i0 < L; i0 += kScoreRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kScoreRows, L - i0));
    score_block<kScoreRows>(rows, q + i0 * q_stride, q_stride, kt, head_size, padded_len, L, scores, row_max);
    finish_rows(rows, scores, row_max, scale, padded_len, vpack, head_size, L, out + i0 * out_stride, out_stride);
  }
}

void check_qkv(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(2) == 1, name,
              " must be a float32 CPU tensor [num_tokens, num_heads, head_size] with unit stride in its last "
              "dimension");
}

// cu_seqlens checked against num_tokens: int32 [num_seqs + 1], from 0 to num_tokens, strictly increasing (no
// empty sequence); `cp` points into `cu` (kept alive here), `max_len` is the longest sequence.
struct SeqLens {
  at::Tensor cu;
  const int32_t* cp;
  int64_t num_seqs;
  int64_t max_len;
};

SeqLens checked_seqlens(const at::Tensor& cu_seqlens, int64_t T) {
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 && cu_seqlens.scalar_type() == at::kInt,
              "cu_seqlens must be int32 [num_seqs + 1]");
  SeqLens lens{cu_seqlens.contiguous(), nullptr, 0, 0};
  lens.cp = lens.cu.data_ptr<int32_t>();
  lens.num_seqs = lens.cu.size(0) - 1;
  const int32_t* cp = lens.cp;
  TORCH_CHECK(cp[0] == 0 && cp[lens.num_seqs] == T, "cu_seqlens must run from 0 to num_tokens (", T, ")");
  for (int64_t s = 0; s < lens.num_seqs; ++s) {
    TORCH_CHECK(cp[s + 1] > cp[s], "cu_seqlens must be strictly increasing (sequence ", s, " is empty)");
    lens.max_len = std::max<int64_t>(lens.max_len, cp[s + 1] - cp[s]);
  }
  return lens;
}

void varlen_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cu_seqlens, double scale) {
  check_qkv(query, "query");
  check_qkv(key, "key");
  check_qkv(value, "value");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  TORCH_CHECK(key.sizes() == query.sizes() && value.sizes() == query.sizes(), "key and value must have query's shape");
  TORCH_CHECK(D % 8 == 0 && D > 0, "head_size must be a positive multiple of 8, got ", D);
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous float32 with query's shape");
  const SeqLens lens = checked_seqlens(cu_seqlens, T);
  const int32_t* cp = lens.cp;
  const int64_t num_seqs = lens.num_seqs, max_len = lens.max_len;
  if (T == 0) return;

  // Items (s, h) in order s * H + h; one contiguous run per thread of about equal cost.
  const int64_t num_items = num_seqs * H;
  std::vector<int64_t> cu_cost(num_items + 1, 0);
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t L = cp[i / H + 1] - cp[i / H];
    cu_cost[i + 1] = cu_cost[i] + L * L + kItemOverhead;
  }
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> part_start(num_parts + 1, num_items);
  for (int64_t p = 0; p < num_parts; ++p) {
    part_start[p] = std::lower_bound(cu_cost.begin(), cu_cost.end(), cu_cost[num_items] * p / num_parts) - cu_cost.begin();
  }

  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), v_stride = value.stride(0);
  const int64_t qh = query.stride(1), kh = key.stride(1), vh = value.stride(1);
  const int64_t padded_max = (max_len + kLanes - 1) / kLanes * kLanes;
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> kt(D * padded_max), vpack(max_len * D), scores(kScoreRows * padded_max);
    for (int64_t i = part_start[part_begin]; i < part_start[part_end]; ++i) {
      const int64_t s = i / H, h = i % H, start = cp[s], L = cp[s + 1] - start;
      attend_item(qp + start * q_stride + h * qh, kp + start * k_stride + h * kh, vp + start * v_stride + h * vh, L,
                  q_stride, k_stride, v_stride, D, scale_f, op + (start * H + h) * D, H * D, kt.data(), vpack.data(),
                  scores.data());
    }
  });
}

// ---- Causal attention of fresh prompts (a decoder's prefill over its own K/V) ----
//
// Registered as the Torch op `batchinfer_cpu::causal_attention_`. One work item is one (sequence, KV head). Its K
// is packed transposed (float32: widened to float32 first; bfloat16 on AVX512_BF16: as pairs of channels for
// vdpbf16ps, see causal_score_tile_bf16) and its V widened to float32, once for the num_heads / num_kv_heads query
// heads that read them (grouped-query attention). The
// item's query rows are (token, query head) pairs, token-major, so the heads of one token sit in one row block
// and see the same keys. A block of kScoreRows rows scores only the keys up to its last token (the causal
// bound, rounded up to whole vectors): S = Q K^T over that prefix as register tiles, then per row an exact
// softmax in float32 over its own visible keys (each row's max taken over those keys as the scores leave the
// registers), zero weights for the keys after it, and P V over the prefix, the
// division by the row sum applied once at the end; a bfloat16 output is rounded once from float32. Items are
// split into one contiguous run per thread of about equal cost (L^2 * query heads / 2 + a fixed overhead). A
// row's output is a fixed sequence of float operations on its query and its sequence's K/V, whatever the other
// sequences of the call or the thread. The fresh-prompt path of a decoder (docs/engine.md, "Attention metadata
// and plan"): on SmolLM2's shapes (16 prompts of 80-140 tokens, 9 query heads over 3 KV heads, head size 64,
// one Zen 4 thread) it takes about half the CPU time of the paged kernel (cpu_attention.cpp), which scores each
// row alone.

inline void widen_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen_row(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen_bf16(src[i]);
}
inline void narrow_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void narrow_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
}

// scores[r][0 .. NK vectors) = q_r . k_j for R packed query rows (q rows head_size apart, kt rows kt_stride
// apart, score rows s_stride apart); each score one multiply-add chain over d in order. row_max[r] takes the
// lane-wise max of the tile's scores of the keys row r sees (keys counted from the tile's first: visible[r]).
template <int R, int NK>
inline void causal_score_tile(const float* __restrict q, const float* __restrict kt, int64_t kt_stride,
                              int64_t head_size, float* __restrict scores, int64_t s_stride,
                              const int64_t* visible, vec* __restrict row_max) {
  vec acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NK; ++n) acc[r][n] = vec{};
  for (int64_t d = 0; d < head_size; ++d) {
    vec w[NK];
    for (int n = 0; n < NK; ++n) w[n] = loadv<vec>(kt + d * kt_stride + n * kLanes);
    for (int r = 0; r < R; ++r) {
      const float qs = q[r * head_size + d];
      for (int n = 0; n < NK; ++n) acc[r][n] += qs * w[n];
    }
  }
  ivec lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NK; ++n) {
      storev(scores + r * s_stride + n * kLanes, acc[r][n]);
      const ivec live = lane + static_cast<int32_t>(n * kLanes) < static_cast<int32_t>(visible[r]);
      row_max[r] = (live & (acc[r][n] > row_max[r])) ? acc[r][n] : row_max[r];
    }
  }
}

// The score tile in float32 (q and kt rows of float channels; `depth` = head_size).
struct FloatScoreTile {
  using Elem = float;
  template <int R, int NK>
  static void run(const float* q, const float* kt, int64_t kt_stride, int64_t depth, float* scores, int64_t s_stride,
                  const int64_t* visible, vec* row_max) {
    causal_score_tile<R, NK>(q, kt, kt_stride, depth, scores, s_stride, visible, row_max);
  }
};

// Keys [0, cols) (a multiple of kLanes) of R rows by `Tile` (FloatScoreTile, Bf16ScoreTile): two vectors at a
// time, the last one alone when odd; `depth` is what each score sums over (channels, or bfloat16 channel pairs).
template <class Tile, int R>
inline void causal_score_rows(const typename Tile::Elem* q, const typename Tile::Elem* kt, int64_t kt_stride,
                              int64_t depth, int64_t cols, float* scores, int64_t s_stride, const int64_t* visible,
                              vec* row_max) {
  for (int r = 0; r < R; ++r) row_max[r] = vec{} - __builtin_inff();
  int64_t left[R];
  int64_t j0 = 0;
  for (; j0 + kKeyTile <= cols; j0 += kKeyTile) {
    for (int r = 0; r < R; ++r) left[r] = visible[r] - j0;
    Tile::template run<R, 2>(q, kt + j0, kt_stride, depth, scores + j0, s_stride, left, row_max);
  }
  if (j0 < cols) {
    for (int r = 0; r < R; ++r) left[r] = visible[r] - j0;
    Tile::template run<R, 1>(q, kt + j0, kt_stride, depth, scores + j0, s_stride, left, row_max);
  }
}

// causal_score_rows for `rows` (1..R) rows, R a compile-time bound.
template <class Tile, int R>
inline void causal_score_block(int rows, const typename Tile::Elem* q, const typename Tile::Elem* kt,
                               int64_t kt_stride, int64_t depth, int64_t cols, float* scores, int64_t s_stride,
                               const int64_t* visible, vec* row_max) {
  if constexpr (R > 0) {
    if (rows == R) {
      causal_score_rows<Tile, R>(q, kt, kt_stride, depth, cols, scores, s_stride, visible, row_max);
    } else {
      causal_score_block<Tile, R - 1>(rows, q, kt, kt_stride, depth, cols, scores, s_stride, visible, row_max);
    }
  }
}

#if defined(__AVX512BF16__)
// The bfloat16 form of causal_score_tile on AVX512_BF16: q rows and kt rows hold pairs of bfloat16 channels
// (2d, 2d + 1) as one 32-bit word (kt: [head_size / 2][keys]), and each vdpbf16ps adds a pair's two exact
// products to the float32 accumulator; each score one chain over the pairs in order.
template <int R, int NK>
inline void causal_score_tile_bf16(const uint32_t* __restrict q, const uint32_t* __restrict kt, int64_t kt_stride,
                                   int64_t num_pairs, float* __restrict scores, int64_t s_stride,
                                   const int64_t* visible, vec* __restrict row_max) {
  __m512 acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NK; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t d = 0; d < num_pairs; ++d) {
    __m512bh w[NK];
    for (int n = 0; n < NK; ++n) w[n] = (__m512bh)_mm512_loadu_si512(kt + d * kt_stride + n * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh qs = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * num_pairs + d]));
      for (int n = 0; n < NK; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qs, w[n]);
    }
  }
  ivec lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NK; ++n) {
      const vec a = (vec)acc[r][n];
      storev(scores + r * s_stride + n * kLanes, a);
      const ivec live = lane + static_cast<int32_t>(n * kLanes) < static_cast<int32_t>(visible[r]);
      row_max[r] = (live & (a > row_max[r])) ? a : row_max[r];
    }
  }
}

// The score tile in bfloat16 pairs (`depth` = head_size / 2).
struct Bf16ScoreTile {
  using Elem = uint32_t;
  template <int R, int NK>
  static void run(const uint32_t* q, const uint32_t* kt, int64_t kt_stride, int64_t depth, float* scores,
                  int64_t s_stride, const int64_t* visible, vec* row_max) {
    causal_score_tile_bf16<R, NK>(q, kt, kt_stride, depth, scores, s_stride, visible, row_max);
  }
};
#endif

// Row of unscaled scores whose first `visible` keys are seen (their max: the lanes of row_max):
// exp(scale * s - scale * max) over those (with a soft cap > 0, exp(cap * tanh(scale * s / cap) -
// cap * tanh(scale * max / cap))), 0 for keys [visible, cols); returns 1 / sum. The exponentials run a register
// wide; the sum keeps eight lanes in every build (a wide vector is added as its halves in order).
inline float causal_softmax_row(float* __restrict s, int64_t visible, int64_t cols, float scale, float soft_cap,
                                vec row_max) {
  float max_score = row_max[0];
  for (int l = 1; l < kLanes; ++l) max_score = std::max(max_score, row_max[l]);
  if (soft_cap > 0.0f) {
    // tanh is increasing, so the capped maximum is the cap of the maximum.
    const float inv_cap = 1.0f / soft_cap;
    const float m = soft_cap * std::tanh(max_score * scale * inv_cap);
    float sum = 0.0f;
    for (int64_t j = 0; j < visible; ++j) {
      s[j] = exp_nonpositive<float, int32_t>(soft_cap * std::tanh(s[j] * scale * inv_cap) - m);
      sum += s[j];
    }
    std::fill(s + visible, s + cols, 0.0f);
    return 1.0f / sum;
  }
  const float shift = -max_score * scale;
  ivec lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  vec8 sum8{};
  for (int64_t j = 0; j < cols; j += kLanes) {
    const vec p = exp_nonpositive<vec, ivec>(loadv<vec>(s + j) * scale + shift);
    const vec kept = lane < static_cast<int32_t>(visible - j) ? p : vec{};
    storev(s + j, kept);
#if defined(__AVX512F__)
    sum8 += __builtin_shufflevector(kept, kept, 0, 1, 2, 3, 4, 5, 6, 7);
    sum8 += __builtin_shufflevector(kept, kept, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    sum8 += kept;
#endif
  }
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += sum8[l];
  return 1.0f / sum;
}

// One (sequence, KV head): L tokens; q/k/v point at the item's first token, its first query head / its KV head;
// out (contiguous [num_tokens, num_heads, head_size]) at the first token's first query head of the group.
template <typename T>
void causal_attend_item(const T* q, const T* k, const T* v, int64_t L, int64_t group, int64_t q_stride,
                        int64_t q_head_stride, int64_t k_stride, int64_t v_stride, int64_t head_size, float scale,
                        float soft_cap, T* out, int64_t out_stride, float* kwide, float* kt, float* vpack,
                        float* scores, float* qbuf, float* obuf) {
  const int64_t padded_len = (L + kLanes - 1) / kLanes * kLanes;
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;  // bfloat16 scores by vdpbf16ps over channel pairs
#else
  constexpr bool kPairs = false;
#endif
  [[maybe_unused]] const int64_t num_pairs = head_size / 2;
  [[maybe_unused]] uint32_t* kt_pairs = reinterpret_cast<uint32_t*>(kt);
  [[maybe_unused]] uint32_t* q_pairs = reinterpret_cast<uint32_t*>(qbuf);
  if constexpr (kPairs) {
    // kt_pairs[d][j] = channels (2d, 2d + 1) of key j, zero past L.
    for (int64_t j = 0; j < L; ++j) {
      const T* row = k + j * k_stride;
      for (int64_t d = 0; d < num_pairs; ++d) {
        uint32_t word;
        std::memcpy(&word, row + 2 * d, sizeof(word));
        kt_pairs[d * padded_len + j] = word;
      }
    }
    for (int64_t d = 0; d < num_pairs; ++d) std::fill(kt_pairs + d * padded_len + L, kt_pairs + (d + 1) * padded_len, 0u);
  } else {
    for (int64_t j = 0; j < L; ++j) widen_row(k + j * k_stride, kwide + j * head_size, head_size);
    pack_keys_transposed(kwide, head_size, L, head_size, padded_len, kt);
  }
  for (int64_t j = 0; j < L; ++j) widen_row(v + j * v_stride, vpack + j * head_size, head_size);
  const int64_t num_rows = L * group;
  float inv_sum[kScoreRows];
  int64_t visible[kScoreRows];
  vec row_max[kScoreRows];
  for (int64_t r0 = 0; r0 < num_rows; r0 += kScoreRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kScoreRows, num_rows - r0));
    const int64_t keys = (r0 + rows - 1) / group + 1;  // the block's last token sees keys [0, keys)
    const int64_t cols = (keys + kLanes - 1) / kLanes * kLanes;
    for (int r = 0; r < rows; ++r) visible[r] = (r0 + r) / group + 1;
    for (int r = 0; r < rows; ++r) {
      const int64_t t = (r0 + r) / group, g = (r0 + r) % group;
      if constexpr (kPairs) {
        std::memcpy(q_pairs + r * num_pairs, q + t * q_stride + g * q_head_stride, head_size * sizeof(T));
      } else {
        widen_row(q + t * q_stride + g * q_head_stride, qbuf + r * head_size, head_size);
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      causal_score_block<Bf16ScoreTile, kScoreRows>(rows, q_pairs, kt_pairs, padded_len, num_pairs, cols, scores,
                                                    padded_len, visible, row_max);
    } else {
      causal_score_block<FloatScoreTile, kScoreRows>(rows, qbuf, kt, padded_len, head_size, cols, scores, padded_len,
                                                     visible, row_max);
    }
#else
    causal_score_block<FloatScoreTile, kScoreRows>(rows, qbuf, kt, padded_len, head_size, cols, scores, padded_len,
                                                   visible, row_max);
#endif
    for (int r = 0; r < rows; ++r) {
      inv_sum[r] = causal_softmax_row(scores + r * padded_len, visible[r], cols, scale, soft_cap, row_max[r]);
    }
    for (int b0 = 0; b0 < rows; b0 += kOutRows) {
      weigh_block<kOutRows>(std::min(kOutRows, rows - b0), scores + b0 * padded_len, padded_len, vpack, head_size,
                            keys, inv_sum + b0, obuf + b0 * head_size, head_size);
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t t = (r0 + r) / group, g = (r0 + r) % group;
      narrow_row(obuf + r * head_size, out + t * out_stride + g * head_size, head_size);
    }
  }
}

template <typename T>
void causal_attention_typed(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const int32_t* cp, int64_t num_seqs, int64_t max_len,
                            float scale, float soft_cap) {
  const int64_t H = query.size(1), Hkv = key.size(1), D = query.size(2), group = H / Hkv;
  // Items (s, kv head) in order s * Hkv + h; one contiguous run per thread of about equal cost.
  const int64_t num_items = num_seqs * Hkv;
  std::vector<int64_t> cu_cost(num_items + 1, 0);
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t L = cp[i / Hkv + 1] - cp[i / Hkv];
    cu_cost[i + 1] = cu_cost[i] + L * L * group / 2 + kItemOverhead;
  }
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> part_start(num_parts + 1, num_items);
  for (int64_t p = 0; p < num_parts; ++p) {
    part_start[p] = std::lower_bound(cu_cost.begin(), cu_cost.end(), cu_cost[num_items] * p / num_parts) - cu_cost.begin();
  }
  const T* qp = static_cast<const T*>(query.data_ptr());
  const T* kp = static_cast<const T*>(key.data_ptr());
  const T* vp = static_cast<const T*>(value.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), v_stride = value.stride(0);
  const int64_t qh = query.stride(1), kh = key.stride(1), vh = value.stride(1);
  const int64_t padded_max = (max_len + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> kwide(max_len * D), kt(D * padded_max), vpack(max_len * D), scores(kScoreRows * padded_max),
        qbuf(kScoreRows * D), obuf(kScoreRows * D);
    for (int64_t i = part_start[part_begin]; i < part_start[part_end]; ++i) {
      const int64_t s = i / Hkv, h = i % Hkv, start = cp[s], L = cp[s + 1] - start;
      causal_attend_item<T>(qp + start * q_stride + h * group * qh, kp + start * k_stride + h * kh,
                            vp + start * v_stride + h * vh, L, group, q_stride, qh, k_stride, v_stride, D, scale,
                            soft_cap, op + (start * H + h * group) * D, H * D, kwide.data(), kt.data(), vpack.data(),
                            scores.data(), qbuf.data(), obuf.data());
    }
  });
}

void causal_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cu_seqlens, double scale, std::optional<double> logits_soft_cap) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be float32 or bfloat16");
  for (const at::Tensor* x : {&query, &key, &value}) {
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == dtype && x->device().is_cpu() && x->stride(2) == 1,
                "query, key and value must be CPU tensors [num_tokens, heads, head_size] of one dtype with unit "
                "stride in their last dimension");
  }
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), Hkv = key.size(1);
  TORCH_CHECK(key.size(0) == T && value.size(0) == T && value.size(1) == Hkv && key.size(2) == D && value.size(2) == D,
              "key and value must be [num_tokens, num_kv_heads, head_size] with query's tokens and head size");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", Hkv, ")");
  TORCH_CHECK(D % 8 == 0 && D > 0, "head_size must be a positive multiple of 8, got ", D);
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(!logits_soft_cap.has_value() || *logits_soft_cap > 0.0, "logits_soft_cap must be > 0");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == dtype && out.device().is_cpu(),
              "out must be contiguous with query's shape and dtype");
  const SeqLens lens = checked_seqlens(cu_seqlens, T);
  const int32_t* cp = lens.cp;
  const int64_t num_seqs = lens.num_seqs, max_len = lens.max_len;
  if (T == 0) return;
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(logits_soft_cap.value_or(0.0));
  if (dtype == at::kFloat) {
    causal_attention_typed<float>(out, query, key, value, cp, num_seqs, max_len, scale_f, cap);
  } else {
    causal_attention_typed<uint16_t>(out, query, key, value, cp, num_seqs, max_len, scale_f, cap);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "varlen_attention_(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, float scale) -> ()");
  m.def(
      "causal_attention_(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, float scale, "
      "float? logits_soft_cap=None) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { 
  m.impl("varlen_attention_", varlen_attention);
  m.impl("causal_attention_", causal_attention);
}
