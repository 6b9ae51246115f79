// Dense float32 linear layer (y = x W^T + b) for CPUs, for every activation height a batch visits: the
// skinny activations of batched decoding (a few to a few hundred rows against a weight that does not fit in
// cache) and prefill chunks of thousands of rows.
//
// Registered as the Torch ops `batchinfer_cpu::pack_linear_weight`, `batchinfer_cpu::linear_packed` and
// `batchinfer_cpu::linear_panel_width` (built and loaded by cpu_extension.py). The weight [N, K] is packed
// once into panels of kNR output columns (two vector registers: 32 with AVX-512, 16 otherwise), each panel
// K x kNR contiguous, so one pass streams the weight from memory exactly once and each row of a panel
// feeds kNR columns of up to kMR activation rows (12 with AVX-512's 32 vector registers, 6 with 16) held in
// 2 * kMR vector accumulators (the register-blocked micro-kernel of Goto & van de Geijn 2008, "Anatomy of
// high-performance matrix multiplication"). Panels are split across torch's threads.
//
// Every output element is one fused multiply-add chain over k = 0 .. K-1 in order, whatever the number
// of rows, the row's place in the batch or the vector width, so a row's result never depends on its batch
// neighbours (and the AVX-512 and AVX2 builds give the same bits). GCC's vector extensions make the same
// source an AVX-512, AVX2 or plain scalar loop, whatever -march=native offers.

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

namespace {

// GCC/Clang vector extension: one AVX-512 register, or one AVX register (two NEON registers on ARM).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kMR = 12;  // 24 accumulators + 2 weight vectors of the 32 registers
#else
constexpr int64_t kLanes = 8;
constexpr int kMR = 6;  // 12 accumulators + 2 weight vectors of the 16 registers
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kNR = 2 * kLanes;  // output columns per panel (two vectors)
constexpr int64_t kRowBlockBytes = 1 << 20;  // activation rows per pass over the panels: about half of L2

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// y[r, 0:ncols] = bias + sum_k x[r, k] * panel[k, 0:ncols] for r < MR. The `prefetch_rows` rows of the next panel at `prefetch` are pulled into cache spread evenly over this call's K
// steps, so the weight keeps streaming from memory while every row group computes (not only the first).
template <int MR>
inline void micro_kernel(const float* __restrict x, const float* __restrict panel, int64_t K,
                         const float* __restrict bias_panel, float* __restrict y, int64_t ldy, int64_t ncols,
                         const float* prefetch, int64_t prefetch_rows) {
  constexpr int64_t kLine = 64 / sizeof(float);  // panel elements per cache line
  vec acc0[MR], acc1[MR];
  const vec bias0 = loadv(bias_panel), bias1 = loadv(bias_panel + kLanes);
  for (int r = 0; r < MR; ++r) {  // the bias starts the chain
    acc0[r] = bias0;
    acc1[r] = bias1;
  }
  int64_t prefetched = 0;
  for (int64_t k = 0; k < K; ++k) {
    for (; prefetched * K < (k + 1) * prefetch_rows; ++prefetched) {
      for (int64_t line = 0; line < kNR; line += kLine) __builtin_prefetch(prefetch + prefetched * kNR + line, 0, 2);
    }
    const vec w0 = loadv(panel + k * kNR), w1 = loadv(panel + k * kNR + kLanes);
    for (int r = 0; r < MR; ++r) {
      const float xs = x[k * MR + r];  // scalar * vector: one broadcast load, no extra add
      acc0[r] += xs * w0;
      acc1[r] += xs * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (ncols == kNR) {
      storev(y + r * ldy, acc0[r]);
      storev(y + r * ldy + kLanes, acc1[r]);
    } else {
      float tail[kNR];
      storev(tail, acc0[r]);
      storev(tail + kLanes, acc1[r]);
      std::memcpy(y + r * ldy, tail, ncols * sizeof(float));
    }
  }
}

using RowGroups = batchinfer_kernels::RowGroups<kMR>;

constexpr int64_t kPackBytes = 32 << 10;  // a group's packed activations written in spans of up to this (L1)

// Rows [0, M) of x (M > 0) repacked so that each micro-kernel call reads its activations contiguously: the
// group of `rows` rows that starts at row m lies at xpack + m * K, laid out [K][rows]. A group wider than
// kPackBytes is written 256 k values at a time: one row across all of K at a stride of `rows` floats would
// leave L1 before the next row fills the same lines (K = 1536, 2048 rows: 3 ms a thread instead of 0.3).
void pack_rows(const float* x, int64_t ldx, int64_t M, int64_t K, float* xpack) {
  const int64_t span = K * kMR * static_cast<int64_t>(sizeof(float)) <= kPackBytes ? K : 256;
  const RowGroups groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t rows = groups.size(g);
    float* dst = xpack + m * K;
    for (int64_t k0 = 0; k0 < K; k0 += span) {
      const int64_t k1 = std::min(K, k0 + span);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (m + r) * ldx;
        for (int64_t k = k0; k < k1; ++k) dst[k * rows + r] = src[k];
      }
    }
  }
}

// All M (> 0) packed rows against one panel, group by group; the groups share the prefetch of
// `next_panel` (null: none), group g taking its rows [g K / G, (g + 1) K / G).
void panel_rows(const float* xpack, int64_t M, const float* panel, int64_t K, const float* bias_panel, float* y,
                int64_t ldy, int64_t ncols, const float* next_panel) {
  const RowGroups groups(M);
  for (int64_t g = 0, m = 0; g < groups.count; m += groups.size(g), ++g) {
    const int64_t first = g * K / groups.count, last = next_panel == nullptr ? first : (g + 1) * K / groups.count;
    const float* prefetch = next_panel == nullptr ? nullptr : next_panel + first * kNR;
    batchinfer_kernels::with_rows<kMR>(groups.size(g), [&](auto rows) {
      micro_kernel<decltype(rows)::value>(xpack + m * K, panel, K, bias_panel, y + m * ldy, ldy, ncols, prefetch, last - first);
    });
  }
}

// Weight [N, K] into [ceil(N / kNR), K, kNR] panels, zero padded.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight must be float32");
  TORCH_CHECK(weight.device().is_cpu(), "weight must be on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t num_panels = (N + kNR - 1) / kNR;
  at::Tensor packed = at::zeros({num_panels, K, kNR}, weight.options());
  const at::Tensor src = weight.contiguous();
  const float* w = src.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNR, N - p * kNR);
      for (int64_t c = 0; c < ncols; ++c) {
        const float* row = w + (p * kNR + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kNR + c] = row[k];
      }
    }
  });
  return packed;
}

// y = x W^T (+ bias) over packed panels, the panels split across torch's threads.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed weight must come from pack_linear_weight");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU tensor [num_rows, in_features]");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must have unit stride in its last dimension");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features but the weight expects ", packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * kNR && N <= packed.size(0) * kNR, "out_features ", N,
              " does not match the packed weight");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N, "bias must be float32 [out_features]");
    b = bias_c.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows in blocks of about kRowBlockBytes of activations, so a block stays in L2 while a thread's panels
  // stream past it (a prefill chunk of thousands of rows would otherwise be re-read from L3 per panel).
  const int64_t row_block = std::max<int64_t>(kMR, kRowBlockBytes / (K * sizeof(float)) / kMR * kMR);
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> xpack(std::min(row_block, M) * K);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t rows = std::min(row_block, M - m0);
      pack_rows(xp + m0 * ldx, ldx, rows, K, xpack.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ncols = std::min(kNR, N - p * kNR);
        float bias_panel[kNR] = {};
        if (b != nullptr) std::memcpy(bias_panel, b + p * kNR, ncols * sizeof(float));
        const float* next_panel = p + 1 < p1 ? pp + (p + 1) * K * kNR : nullptr;
        panel_rows(xpack.data(), rows, pp + p * K * kNR, K, bias_panel, yp + m0 * N + p * kNR, N, ncols, next_panel);
      }
    }
  });
  return y;
}

int64_t linear_panel_width() { return kNR; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_panel_width() -> int", linear_panel_width);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("linear_packed", linear_packed);
}
