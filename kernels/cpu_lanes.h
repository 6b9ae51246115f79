// Fixed-order float32 sums shared by the C++ CPU kernels (attention's softmax denominator in cpu_attention.cpp,
// LayerNorm's mean in cpu_elementwise.cpp): kLaneSumLanes partial sums (element i in lane i % 16), added lane
// by lane, so the order depends on n only, never on the pointer's alignment or the vector width of the build.

#pragma once

#include <cstdint>

namespace batchinfer_kernels {

constexpr int64_t kLaneSumLanes = 16;

// sum of x[0 .. n-1] in the fixed lane order above.
inline float lane_sum(const float* __restrict x, int64_t n) {
  float partial[kLaneSumLanes] = {};
  int64_t i = 0;
  for (; i + kLaneSumLanes <= n; i += kLaneSumLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLaneSumLanes; ++l) partial[l] += x[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) partial[l] += x[i + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < kLaneSumLanes; ++l) sum += partial[l];
  return sum;
}

}  // namespace batchinfer_kernels
