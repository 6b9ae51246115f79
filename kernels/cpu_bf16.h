// bfloat16 as its 16 bits, shared by the C++ CPU kernels (attention's bfloat16 KV cache in cpu_attention.cpp,
// the bfloat16 decoder ops in cpu_elementwise.cpp): widening is exact (the bits become the high half of a
// float32); narrowing rounds to nearest even, NaN to a quiet NaN (c10::BFloat16's round_to_nearest_even).

#pragma once

#include <cstdint>
#include <cstring>

namespace batchinfer_kernels {

inline float widen_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace batchinfer_kernels
