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

#include "cpu_gemm_bf16.h"

namespace {

using batchinfer_kernels::packed_bf16::kNR;
#if defined(__AVX512BF16__)
using batchinfer_kernels::packed_bf16::pack_rows;
using batchinfer_kernels::packed_bf16::panel_rows;
#endif

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
  const int64_t row_block = batchinfer_kernels::packed_bf16::row_block(K2);
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
