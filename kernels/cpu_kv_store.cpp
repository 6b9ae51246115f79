// Quantize-on-store for a quantized paged KV cache (int8 or fp8 e4m3 elements, one float32 scale per stored
// (token, KV head, group of channels); docs/engine.md "Quantized KV cache").
//
// Registered as the Torch op `batchinfer_cpu::quantize_kv_store_` (built and loaded by cpu_extension.py).
// One pass per (token, KV head) row of K and of V, group by group (head_size / num_groups channels each, the
// scales' last dimension): the group's absmax, its scale (absmax / q_max, 1 for an all-zero group), the elements
// divided by the scale, clamped to +-q_max and rounded (int8: half away from zero; fp8: to nearest even, c10's
// cast), stored at the token's slot with the scales. The same float operations in the
// same order as kernels/reference.py:quantize_kv (its twin), so the stored bytes and scales are identical.
// Optionally it also writes each row as stored (element * scale), what every later read sees. This replaces
// two dozen small tensor ops per layer and step (abs, amax, where, divide, clamp, round, cast, indexed copies).
//
// Also `batchinfer_cpu::kv_store_`, the store of a float32 or bfloat16 cache: each (token, KV head) row of K and V
// copied to its slot as it is (the two index_copy_ calls it replaces took about 60 us each on a 64-token decode
// step's strided K/V views of the fused projection, 2 per layer and step).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;

// Group `x` (n floats) quantized into `data` with its scale returned; `stored` (or null) gets element * scale.
template <bool kInt8>
float quantize_row(const float* __restrict x, int64_t n, uint8_t* __restrict data, float* __restrict stored) {
  const float q_max = kInt8 ? kInt8Max : kFp8Max;
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax > 0.0f ? amax / q_max : 1.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = std::min(std::max(x[d] / scale, -q_max), q_max);
    float value;
    if constexpr (kInt8) {
      const float rounded = std::copysign(std::floor(std::fabs(y) + 0.5f), y);
      const int8_t q = static_cast<int8_t>(rounded);
      data[d] = static_cast<uint8_t>(q);
      value = static_cast<float>(q);
    } else {
      const c10::Float8_e4m3fn q(y);
      data[d] = q.x;
      value = static_cast<float>(q);
    }
    if (stored != nullptr) stored[d] = value * scale;
  }
  return scale;
}

void check_rows(const at::Tensor& x, const char* name, int64_t num_tokens, int64_t num_kv_heads, int64_t head_size) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(0) == num_tokens &&
                  x.size(1) == num_kv_heads && x.size(2) == head_size && x.stride(2) == 1,
              "quantize_kv_store_: ", name, " must be float32 [num_tokens, num_kv_heads, head_size] with unit last stride");
}

void quantize_kv_store(const at::Tensor& data, const at::Tensor& scales, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& key_stored,
                       const std::optional<at::Tensor>& value_stored) {
  const bool int8 = data.scalar_type() == at::kChar;
  TORCH_CHECK(data.device().is_cpu() && (int8 || data.scalar_type() == at::kFloat8_e4m3fn) && data.is_contiguous() &&
                  data.dim() == 5 && data.size(0) == 2,
              "quantize_kv_store_: data must be a contiguous int8 or float8_e4m3fn [2, num_blocks, block_size, num_kv_heads, head_size]");
  const int64_t num_slots = data.size(1) * data.size(2), num_kv_heads = data.size(3), head_size = data.size(4);
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 5 && scales.size(0) == 2 && scales.size(1) * scales.size(2) == num_slots &&
                  scales.size(3) == num_kv_heads && scales.size(4) >= 1 && head_size % scales.size(4) == 0,
              "quantize_kv_store_: scales must be a contiguous float32 [2, num_blocks, block_size, num_kv_heads, "
              "num_groups] with num_groups dividing head_size");
  const int64_t num_groups = scales.size(4), group_size = head_size / num_groups;
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "quantize_kv_store_: slot_mapping must be a contiguous int64 [num_tokens]");
  const int64_t num_tokens = slot_mapping.size(0);
  check_rows(key, "key", num_tokens, num_kv_heads, head_size);
  check_rows(value, "value", num_tokens, num_kv_heads, head_size);
  const bool with_stored = key_stored.has_value() && key_stored->defined();
  TORCH_CHECK(with_stored == (value_stored.has_value() && value_stored->defined()),
              "quantize_kv_store_: key_stored and value_stored come together");
  if (with_stored) {
    for (const at::Tensor* t : {&*key_stored, &*value_stored}) {
      TORCH_CHECK(t->is_contiguous(), "quantize_kv_store_: key_stored and value_stored must be contiguous");
      check_rows(*t, "key_stored/value_stored", num_tokens, num_kv_heads, head_size);
    }
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "quantize_kv_store_: slot ", slots[t], " out of range");
  }
  uint8_t* data_ptr = static_cast<uint8_t*>(data.data_ptr());
  float* scales_ptr = scales.data_ptr<float>();
  const int64_t row_elements = num_kv_heads * head_size;
  const at::Tensor* sources[2] = {&key, &value};
  float* stored_ptrs[2] = {with_stored ? key_stored->data_ptr<float>() : nullptr,
                           with_stored ? value_stored->data_ptr<float>() : nullptr};
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t half = 0; half < 2; ++half) {
      const at::Tensor& x = *sources[half];
      const float* x_ptr = x.data_ptr<float>();
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          const float* row = x_ptr + t * x.stride(0) + g * x.stride(1);
          const int64_t slot_row = (half * num_slots + slots[t]) * num_kv_heads + g;
          float* stored = stored_ptrs[half] == nullptr ? nullptr : stored_ptrs[half] + t * row_elements + g * head_size;
          for (int64_t i = 0; i < num_groups; ++i) {
            const int64_t d = i * group_size;
            uint8_t* dst = data_ptr + slot_row * head_size + d;
            float* stored_group = stored == nullptr ? nullptr : stored + d;
            scales_ptr[slot_row * num_groups + i] = int8 ? quantize_row<true>(row + d, group_size, dst, stored_group)
                                                         : quantize_row<false>(row + d, group_size, dst, stored_group);
          }
        }
      }
    }
  });
}

void kv_store(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  const at::ScalarType dtype = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_store_: kv_cache must be a contiguous float32 or bfloat16 [2, num_blocks, block_size, num_kv_heads, "
              "head_size]");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t head_size = kv_cache.size(4);
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "kv_store_: slot_mapping must be a contiguous int64 [num_tokens]");
  const int64_t num_tokens = slot_mapping.size(0);
  for (const at::Tensor* x : {&key, &value}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == dtype && x->dim() == 3 && x->size(0) == num_tokens &&
                    x->size(1) == num_kv_heads && x->size(2) == head_size && (x->stride(2) == 1 || head_size == 1),
                "kv_store_: key and value must be [num_tokens, num_kv_heads, head_size] in the cache's dtype with unit "
                "last stride");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "kv_store_: slot ", slots[t], " out of range");
  }
  const int64_t element_size = kv_cache.element_size(), row_bytes = head_size * element_size;
  const int64_t token_bytes = num_kv_heads * row_bytes;
  auto* cache_ptr = static_cast<char*>(kv_cache.data_ptr());
  const at::Tensor* sources[2] = {&key, &value};
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    // The slots are scattered over a cache far larger than the L3, so every destination line is a miss: ask for
    // them all (for writing) before the copies, so the misses overlap instead of stalling one store after another.
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t t = begin; t < end; ++t) {
        const char* dst = cache_ptr + (half * num_slots + slots[t]) * token_bytes;
        for (int64_t line = 0; line < token_bytes; line += 64) __builtin_prefetch(dst + line, 1, 3);
      }
    }
    for (int64_t half = 0; half < 2; ++half) {
      const at::Tensor& x = *sources[half];
      const auto* x_ptr = static_cast<const char*>(x.const_data_ptr());
      const int64_t token_stride = x.stride(0) * element_size, head_stride = x.stride(1) * element_size;
      for (int64_t t = begin; t < end; ++t) {
        char* dst = cache_ptr + (half * num_slots + slots[t]) * token_bytes;
        const char* src = x_ptr + t * token_stride;
        if (head_stride == row_bytes) {
          std::memcpy(dst, src, token_bytes);  // the token's KV heads side by side, as in the cache
        } else {
          for (int64_t g = 0; g < num_kv_heads; ++g) std::memcpy(dst + g * row_bytes, src + g * head_stride, row_bytes);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "quantize_kv_store_(Tensor(a!) data, Tensor(b!) scales, Tensor key, Tensor value, Tensor slot_mapping, "
      "Tensor(c!)? key_stored=None, Tensor(d!)? value_stored=None) -> ()");
  m.def("kv_store_(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("quantize_kv_store_", quantize_kv_store);
  m.impl("kv_store_", kv_store);
}
