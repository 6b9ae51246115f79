// Row grouping shared by the packed-panel GEMMs (cpu_gemm.cpp: float32, cpu_gemm_bf16.cpp: bfloat16): how the M
// activation rows of one call are split into micro-kernel calls, and the dispatch of a group's row count to the
// micro-kernel instantiated for exactly that many rows.

#pragma once

#include <cstdint>
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

}  // namespace batchinfer_kernels
