// Bidirectional (non-causal) attention over packed variable-length sequences for x86/ARM CPUs: the encoder
// attention of BERT-family embedders (worker/engine/executor/models/bert.py).
//
// Registered as the Torch op `batchinfer_cpu::varlen_attention_` (built and loaded by cpu_extension.py).
// Sequence s owns rows cu_seqlens[s] .. cu_seqlens[s + 1] of q, k and v and attends to exactly those rows:
// no padding, no mask and no FLOP across sequences (FlashAttention's `cu_seqlens` convention, Dao et al.
// 2022). One work item is one (sequence, head); items are split into one contiguous run per thread of about
// equal cost (L^2 + a fixed overhead per item) with at::parallel_for, so torch.set_num_threads governs it.
//
// Per item, K is packed transposed ([head_size][L], zero padded to a multiple of 16 keys) and V contiguous
// ([L][head_size]) in a per-thread buffer, so both products are small register-blocked GEMMs:
// scores = Q K^T for kScoreRows query rows x 16 keys at a time (12 vector accumulators, AVX2's 16
// registers), then an exact two-pass softmax per row in float32 (max, then exp and sum; vLLM's CPU
// attention does the same), then P V for kOutRows rows x up to 32 output features (12 accumulators), the
// division by the row sum applied once at the end. Scores for a row block live in a small buffer (L1).
//
// A row's output is a fixed sequence of float operations on its query and its sequence's K/V (the same
// tiles and the same order whatever the other sequences of the call or the thread), so it is batch
// invariant; it differs from torch's scaled_dot_product_attention by float32 rounding only.

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
using batchinfer_kernels::vec8;

constexpr int64_t kKeyTile = 16;  // keys scored together: two vectors
constexpr int kScoreRows = 6;     // query rows scored together: 2 x 6 accumulators
constexpr int kOutRows = 3;       // rows of P V together: 3 x 4 accumulators
constexpr int kOutVecs = 4;       // output features per P V pass: 4 vectors (32)
constexpr int64_t kItemOverhead = 64;  // fixed cost of an item (packing, calls), in L^2 units

// scores[r][j0 .. j0 + 16) = scale * q_r . k_j for R query rows (q rows `q_stride` apart) and all key tiles.
template <int R>
inline void score_rows(const float* __restrict q, int64_t q_stride, const float* __restrict kt, int64_t head_size,
                       int64_t padded_len, float scale, float* __restrict scores) {
  for (int64_t j0 = 0; j0 < padded_len; j0 += kKeyTile) {
    vec8 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = vec8{};
    for (int64_t d = 0; d < head_size; ++d) {
      const vec8 w0 = load8(kt + d * padded_len + j0), w1 = load8(kt + d * padded_len + j0 + 8);
      for (int r = 0; r < R; ++r) {
        const float qs = q[r * q_stride + d];
        acc0[r] += qs * w0;
        acc1[r] += qs * w1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(scores + r * padded_len + j0, acc0[r] * scale);
      store8(scores + r * padded_len + j0 + 8, acc1[r] * scale);
    }
  }
}

// Row of L scores -> exp(s - max) in place; returns 1 / sum.
inline float softmax_row(float* __restrict s, int64_t L) {
  float max_score = s[0];
  for (int64_t j = 1; j < L; ++j) max_score = std::max(max_score, s[j]);
  vec8 sum8{};
  int64_t j = 0;
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

// out[r][0 .. 8 * NV) = inv_sum[r] * sum_j p[r][j] v[j][0 .. 8 * NV) for R rows (p rows `padded_len` apart,
// v rows `head_size` apart, out rows `out_stride` apart).
template <int R, int NV>
inline void weigh_values(const float* __restrict p, int64_t padded_len, const float* __restrict v, int64_t head_size,
                         int64_t L, const float* inv_sum, float* __restrict out, int64_t out_stride) {
  vec8 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = vec8{};
  for (int64_t j = 0; j < L; ++j) {
    vec8 w[NV];
    for (int n = 0; n < NV; ++n) w[n] = load8(v + j * head_size + 8 * n);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * padded_len + j];
      for (int n = 0; n < NV; ++n) acc[r][n] += pr * w[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) store8(out + r * out_stride + 8 * n, acc[r][n] * inv_sum[r]);
}

template <int R>
inline void weigh_values_chunk(int nv, const float* p, int64_t padded_len, const float* v, int64_t head_size, int64_t L,
                               const float* inv_sum, float* out, int64_t out_stride) {
  switch (nv) {
    case 4: weigh_values<R, 4>(p, padded_len, v, head_size, L, inv_sum, out, out_stride); break;
    case 3: weigh_values<R, 3>(p, padded_len, v, head_size, L, inv_sum, out, out_stride); break;
    case 2: weigh_values<R, 2>(p, padded_len, v, head_size, L, inv_sum, out, out_stride); break;
    default: weigh_values<R, 1>(p, padded_len, v, head_size, L, inv_sum, out, out_stride); break;
  }
}

// Rows [0, rows) of a score block (rows <= kScoreRows) through softmax and P V.
void finish_rows(int rows, float* scores, int64_t padded_len, const float* v, int64_t head_size, int64_t L,
                 float* out, int64_t out_stride) {
  float inv_sum[kScoreRows];
  for (int r = 0; r < rows; ++r) inv_sum[r] = softmax_row(scores + r * padded_len, L);
  for (int r0 = 0; r0 < rows; r0 += kOutRows) {
    const int R = std::min(kOutRows, rows - r0);
    for (int64_t d0 = 0; d0 < head_size; d0 += 8 * kOutVecs) {
      const int nv = static_cast<int>(std::min<int64_t>(kOutVecs, (head_size - d0) / 8));
      const float* p = scores + r0 * padded_len;
      float* o = out + r0 * out_stride + d0;
      if (R == 3) {
        weigh_values_chunk<3>(nv, p, padded_len, v + d0, head_size, L, inv_sum + r0, o, out_stride);
      } else if (R == 2) {
        weigh_values_chunk<2>(nv, p, padded_len, v + d0, head_size, L, inv_sum + r0, o, out_stride);
      } else {
        weigh_values_chunk<1>(nv, p, padded_len, v + d0, head_size, L, inv_sum + r0, o, out_stride);
      }
    }
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
  const int64_t padded_len = (L + kKeyTile - 1) / kKeyTile * kKeyTile;
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
  const int64_t padded_max = (max_len + kKeyTile - 1) / kKeyTile * kKeyTile;
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
