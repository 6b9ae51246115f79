// exp(x) for float32, vectorisable (no libm call), shared by the C++ CPU kernels: the attention softmax
// (cpu_attention.cpp) and SiLU (cpu_elementwise.cpp). Cephes' expf range reduction and polynomial, relative
// error about 2e-7; x is clamped to [-87, 88], so the result stays finite and positive.
//
// Three forms with the same operations in the same order: one float (for `#pragma omp simd` loops), vec8
// (eight floats, GCC/Clang vector extension) and vec16 (sixteen: one AVX-512 register). Use the vec8 form where the loop also divides: GCC
// if-converts the scalar form's clamp into per-case selects and evaluates every case in every lane, and the
// case x = 88 turns a division into one by 1.7e38, whose subnormal quotients cost Intel cores a microcode
// assist per lane (SiLU ran 17x slower on a Xeon than in the vec8 form).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace batchinfer_kernels {

// Eight floats in one AVX register; AVX-512 builds use the same width, so both builds give the same bits.
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t ivec8 __attribute__((vector_size(8 * sizeof(int32_t))));
// Sixteen floats (one AVX-512 register, two AVX ones): the same operations lane by lane, so the same bits.
typedef float vec16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t ivec16 __attribute__((vector_size(16 * sizeof(int32_t))));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float clamp_exp_arg(float x) { return std::min(std::max(x, -87.0f), 88.0f); }
inline vec8 clamp_exp_arg(vec8 x) {
  x = x < -87.0f ? vec8{} - 87.0f : x;
  return x > 88.0f ? vec8{} + 88.0f : x;
}
inline vec16 clamp_exp_arg(vec16 x) {
  x = x < -87.0f ? vec16{} - 87.0f : x;
  return x > 88.0f ? vec16{} + 88.0f : x;
}

// 2^n for integral n in [-126, 127], by writing the exponent bits.
inline float pow2i(float n) { return __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23); }
inline vec8 pow2i(vec8 n) {
  const ivec8 bits = (__builtin_convertvector(n, ivec8) + 127) << 23;
  vec8 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline vec16 pow2i(vec16 n) {
  const ivec16 bits = (__builtin_convertvector(n, ivec16) + 127) << 23;
  vec16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#pragma omp declare simd notinbranch
template <typename T>
inline T exp_clamped(T x) {
  x = clamp_exp_arg(x);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: floorf would keep GCC from vectorising the loop (it may
  // raise an inexact flag).
  const T n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  T r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * pow2i(n);
}

}  // namespace batchinfer_kernels
