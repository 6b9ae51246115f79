// exp(x) for float32, vectorisable (no libm call), shared by the C++ CPU kernels: the attention softmax
// (cpu_attention.cpp) and SiLU (cpu_elementwise.cpp). Cephes' expf range reduction and polynomial, relative
// error about 2e-7; x is clamped to [-87, 88], so the result stays finite and positive.

#pragma once

#include <algorithm>
#include <cstdint>

namespace batchinfer_kernels {

#pragma omp declare simd notinbranch
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: floorf would keep GCC from vectorising the loop (it may
  // raise an inexact flag).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

}  // namespace batchinfer_kernels
