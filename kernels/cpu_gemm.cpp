// Dense float32 linear layer (y = x W^T + b) for CPUs, tuned for the skinny activations of batched
// decoding (a few to a few hundred rows against a weight that does not fit in cache).
//
// Registered as the Torch ops `batchinfer_cpu::pack_linear_weight` and `batchinfer_cpu::linear_packed`
// (built and loaded by cpu_extension.py). The weight [N, K] is packed once into panels of kNR = 16 output
// columns, each panel K x 16 contiguous, so one pass streams the weight from memory exactly once and
// each 64-byte row of a panel feeds 16 columns of up to kMR = 6 activation rows held in 12 vector
// accumulators (the register-blocked micro-kernel of Goto & van de Geijn 2008, "Anatomy of
// high-performance matrix multiplication"). Panels are split across torch's threads.
//
// Every output element is one fused multiply-add chain over k = 0 .. K-1 in order, whatever the number
// of rows or the row's place in the batch, so a row's result never depends on its batch neighbours.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

typedef float vec8 __attribute__((vector_size(32)));  // GCC/Clang vector extension: AVX on x86, 2x NEON on ARM
constexpr int64_t kNR = 16;                           // output columns per panel (two vectors)
constexpr int kMR = 6;                                // activation rows per micro-kernel call

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// y[r, 0:ncols] = bias + sum_k x[r, k] * panel[k, 0:ncols] for r < MR.
template <int MR>
inline void micro_kernel(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                         const float* __restrict bias16, float* __restrict y, int64_t ldy, int64_t ncols) {
  vec8 acc0[MR], acc1[MR];
  const vec8 bias0 = load8(bias16), bias1 = load8(bias16 + 8);
  for (int r = 0; r < MR; ++r) {
    acc0[r] = bias0;
    acc1[r] = bias1;
  }
  for (int64_t k = 0; k < K; ++k) {
    const vec8 w0 = load8(panel + k * kNR);
    const vec8 w1 = load8(panel + k * kNR + 8);
    for (int r = 0; r < MR; ++r) {
      const float xs = x[r * ldx + k];  // scalar * vector: one broadcast load, no extra add
      acc0[r] += xs * w0;
      acc1[r] += xs * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (ncols == kNR) {
      store8(y + r * ldy, acc0[r]);
      store8(y + r * ldy + 8, acc1[r]);
    } else {
      float tail[kNR];
      store8(tail, acc0[r]);
      store8(tail + 8, acc1[r]);
      std::memcpy(y + r * ldy, tail, ncols * sizeof(float));
    }
  }
}

// All M rows against one panel: full kMR-row blocks, then one block of the remaining rows.
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K, const float* bias16, float* y,
                int64_t ldy, int64_t ncols) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) micro_kernel<kMR>(x + m * ldx, ldx, panel, K, bias16, y + m * ldy, ldy, ncols);
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: micro_kernel<5>(xm, ldx, panel, K, bias16, ym, ldy, ncols); break;
    case 4: micro_kernel<4>(xm, ldx, panel, K, bias16, ym, ldy, ncols); break;
    case 3: micro_kernel<3>(xm, ldx, panel, K, bias16, ym, ldy, ncols); break;
    case 2: micro_kernel<2>(xm, ldx, panel, K, bias16, ym, ldy, ncols); break;
    case 1: micro_kernel<1>(xm, ldx, panel, K, bias16, ym, ldy, ncols); break;
    default: break;
  }
}

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

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU tensor [num_rows, in_features]");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must have unit stride in its last dimension");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed weight must come from pack_linear_weight");
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
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNR, N - p * kNR);
      float bias16[kNR] = {};
      if (b != nullptr) std::memcpy(bias16, b + p * kNR, ncols * sizeof(float));
      panel_rows(xp, ldx, M, pp + p * K * kNR, K, bias16, yp + p * kNR, N, ncols);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("linear_packed", linear_packed);
}
