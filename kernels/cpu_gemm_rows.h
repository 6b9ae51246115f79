// Row grouping shared by the packed-panel GEMMs (cpu_gemm.cpp: float32, cpu_gemm_bf16.cpp: bfloat16): how the M
// activation rows of one call are split into micro-kernel calls, and the dispatch of a group's row count to the
// micro-kernel instantiated for exactly that many rows. Also the argument checks and output of the bfloat16 linear
// ops (cpu_gemm_bf16.cpp's dense weight, cpu_q4_bf16.cpp's Q4 blocks): their activation rows, float32 bias and
// bfloat16 output are the same.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>
#include <type_traits>

namespace batchinfer_kernels {

// M (> 0) rows split into ceil(M / MR) groups of near-equal size (the first M % count one row taller), so a
// decode batch of, say, 50 rows with MR = 12 runs as 5 groups of 10 rather than 4 of 12 and a thin, slow group of 2.
template <int MR>
struct RowGroups {
  int64_t count, base, extra;
  explicit RowGroups(int64_t M) : count((M + MR - 1) / MR), base(M / count), extra(M % count) {}
  int64_t size(int64_t g) const { return base + (g < extra ? 1 : 0); }
};

// Calls kernel(std::integral_constant<int, rows>{}) for a run-time `rows` in 1 .. MR (nothing otherwise), so the
// caller's micro-kernel is instantiated for each height up to MR and runs with its rows as a compile-time constant.
template <int MR, typename Kernel>
inline void with_rows(int64_t rows, Kernel&& kernel) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      kernel(std::integral_constant<int, MR>{});
    } else {
      with_rows<MR - 1>(rows, kernel);
    }
  }
}

// Raises unless x is a bfloat16 CPU tensor [num_rows, in_features] with unit stride along in_features (its rows
// may be strided: a view of every other row is read in place).
inline void check_bf16_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a bfloat16 CPU tensor [num_rows, in_features]");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must have unit stride in its last dimension");
}

// A bfloat16 linear op's bias, widened to a contiguous float32 [out_features] (undefined when there is none), and
// its output y, an uninitialised contiguous bfloat16 [num_rows, out_features] tensor on x's device. Raises unless
// the bias is [out_features] (any shape of that many elements) on the CPU.
struct Bf16LinearOutput {
  at::Tensor bias_f, y;
};

inline Bf16LinearOutput bf16_linear_output(const at::Tensor& x, int64_t out_features,
                                           const std::optional<at::Tensor>& bias) {
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features && bias->device().is_cpu(), "bias must be [out_features] on the CPU");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  return {bias_f, at::empty({x.size(0), out_features}, x.options().memory_format(at::MemoryFormat::Contiguous))};
}

}  // namespace batchinfer_kernels
