// Bidirectional (non-causal) attention over packed variable-length sequences for x86/ARM CPUs: the encoder
// attention of BERT-family embedders (worker/engine/executor/models/bert.py).
//
// Registered as the Torch op `batchinfer_cpu::varlen_attention_` (built and loaded by cpu_extension.py).
// Sequence s owns rows cu_seqlens[s] .. cu_seqlens[s + 1] of q, k and v and attends to exactly those rows:
// no padding, no mask and no FLOP across sequences (FlashAttention's `cu_seqlens` convention, Dao et al.
// 2022). One work item is one (sequence, head); items are split into one contiguous run per thread of about
// equal cost (L^2 + a fixed overhead per item) with at::parallel_for, so torch.set_num_threads governs it.
//
// Per item, K is packed transposed ([head_size][L], zero padded to whole vectors of keys) and V contiguous
// ([L][head_size]) in a per-thread buffer, so both products are small register-blocked GEMMs:
// scores = Q K^T for kScoreRows query rows x two vectors of keys at a time (AVX2: 6 x 16, 12 of the 16
// registers as accumulators; AVX-512: 12 x 32, 24 of 32), then an exact two-pass softmax per row in float32
// (max, then exp and sum; vLLM's CPU attention does the same), then P V for kOutRows rows x 32 output
// features (AVX2: 3 x 4 vectors; AVX-512: 12 x 2), the division by the row sum applied once at the end.
// Scores for a row block live in a small buffer (L1).
//
// A row's output is a fixed sequence of float operations on its query and its sequence's K/V (the same
// tiles and the same order whatever the other sequences of the call or the thread), so it is batch
// invariant. Every score and output is one chain in order and the softmax sums keep eight lanes in every
// build, so the AVX2 and AVX-512 builds are meant to give the same bits (not yet compared across machines).
// It differs from torch's scaled_dot_product_attention by float32 rounding only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_exp.h"

namespace {

using batchinfer_kernels::exp_clamped;
using batchinfer_kernels::load8;
using batchinfer_kernels::store8;
using batchinfer_kernels::vec16;
using batchinfer_kernels::vec8;

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

// scores[r][j0 .. j0 + NK vectors) = scale * q_r . k_j for R query rows (q rows `q_stride` apart); each
// score is one multiply-add chain over d in order.
template <int R, int NK>
inline void score_tile(const float* __restrict q, int64_t q_stride, const float* __restrict kt, int64_t head_size,
                       int64_t padded_len, float scale, float* __restrict scores) {
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
    for (int n = 0; n < NK; ++n) storev(scores + r * padded_len + n * kLanes, acc[r][n] * scale);
}

// All key tiles of R query rows: two vectors of keys at a time, the last vector alone when it is odd.
template <int R>
inline void score_rows(const float* q, int64_t q_stride, const float* kt, int64_t head_size, int64_t padded_len,
                       float scale, float* scores) {
  int64_t j0 = 0;
  for (; j0 + kKeyTile <= padded_len; j0 += kKeyTile) {
    score_tile<R, 2>(q, q_stride, kt + j0, head_size, padded_len, scale, scores + j0);
  }
  if (j0 < padded_len) score_tile<R, 1>(q, q_stride, kt + j0, head_size, padded_len, scale, scores + j0);
}

// Row of L scores -> exp(s - max) in place; returns 1 / sum. The exponentials run a register wide; the sum
// keeps eight lanes in every build (a wide vector is added as its halves in order), so the bits match.
inline float softmax_row(float* __restrict s, int64_t L) {
  int64_t j = 0;
  float max_score = s[0];
  if (L >= 8) {
    vec8 max8 = load8(s);
    for (j = 8; j + 8 <= L; j += 8) {
      const vec8 x = load8(s + j);
      max8 = x > max8 ? x : max8;
    }
    for (int l = 0; l < 8; ++l) max_score = std::max(max_score, max8[l]);
  }
  for (; j < L; ++j) max_score = std::max(max_score, s[j]);
  vec8 sum8{};
  j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= L; j += 16) {
    const vec16 p = exp_clamped(loadv<vec16>(s + j) - max_score);
    storev(s + j, p);
    sum8 += __builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7);
    sum8 += __builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
  }
#endif
  for (; j + 8 <= L; j += 8) {
    const vec8 p = exp_clamped(load8(s + j) - max_score);
    store8(s + j, p);
    sum8 += p;
  }
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += sum8[l];
  for (; j < L; ++j) {
    s[j] = exp_clamped(s[j] - max_score);
    sum += s[j];
  }
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
void finish_rows(int rows, float* scores, int64_t padded_len, const float* v, int64_t head_size, int64_t L,
                 float* out, int64_t out_stride) {
  float inv_sum[kScoreRows];
  for (int r = 0; r < rows; ++r) inv_sum[r] = softmax_row(scores + r * padded_len, L);
  for (int r0 = 0; r0 < rows; r0 += kOutRows) {
    weigh_block<kOutRows>(std::min(kOutRows, rows - r0), scores + r0 * padded_len, padded_len, v, head_size, L,
                          inv_sum + r0, out + r0 * out_stride, out_stride);
  }
}

template <int R>
inline void score_block(int rows, const float* q, int64_t q_stride, const float* kt, int64_t head_size,
                        int64_t padded_len, float scale, float* scores) {
  if constexpr (R > 0) {
    if (rows == R) {
      score_rows<R>(q, q_stride, kt, head_size, padded_len, scale, scores);
    } else {
      score_block<R - 1>(rows, q, q_stride, kt, head_size, padded_len, scale, scores);
    }
  }
}

// One (sequence, head): L tokens whose head-h rows start at q, k, v; out rows are num_heads * head_size apart.
void attend_item(const float* q, const float* k, const float* v, int64_t L, int64_t q_stride, int64_t k_stride,
                 int64_t v_stride, int64_t head_size, float scale, float* out, int64_t out_stride, float* kt,
                 float* vpack, float* scores) {
  const int64_t padded_len = (L + kLanes - 1) / kLanes * kLanes;
  for (int64_t d = 0; d < head_size; ++d) {
    float* row = kt + d * padded_len;
    for (int64_t j = 0; j < L; ++j) row[j] = k[j * k_stride + d];
    std::fill(row + L, row + padded_len, 0.0f);
  }
  for (int64_t j = 0; j < L; ++j) std::memcpy(vpack + j * head_size, v + j * v_stride, head_size * sizeof(float));
  for (int64_t i0 = 0; i0 < L; i0 += kScoreRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kScoreRows, L - i0));
    score_block<kScoreRows>(rows, q + i0 * q_stride, q_stride, kt, head_size, padded_len, scale, scores);
    finish_rows(rows, scores, padded_len, vpack, head_size, L, out + i0 * out_stride, out_stride);
  }
}

void check_qkv(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(2) == 1, name,
              " must be a float32 CPU tensor [num_tokens, num_heads, head_size] with unit stride in its last "
              "dimension");
}

void varlen_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cu_seqlens, double scale) {
  check_qkv(query, "query");
  check_qkv(key, "key");
  check_qkv(value, "value");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  TORCH_CHECK(key.sizes() == query.sizes() && value.sizes() == query.sizes(), "key and value must have query's shape");
  TORCH_CHECK(D % 8 == 0 && D > 0, "head_size must be a positive multiple of 8, got ", D);
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous float32 with query's shape");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 && cu_seqlens.scalar_type() == at::kInt,
              "cu_seqlens must be int32 [num_seqs + 1]");
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* cp = cu.data_ptr<int32_t>();
  const int64_t num_seqs = cu.size(0) - 1;
  TORCH_CHECK(cp[0] == 0 && cp[num_seqs] == T, "cu_seqlens must run from 0 to num_tokens (", T, ")");
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(cp[s + 1] > cp[s], "cu_seqlens must be strictly increasing (sequence ", s, " is empty)");
    max_len = std::max<int64_t>(max_len, cp[s + 1] - cp[s]);
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "varlen_attention_(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { m.impl("varlen_attention_", varlen_attention); }
