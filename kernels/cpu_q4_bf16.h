// The C++ entry of the bfloat16-activation Q4 linear layer (cpu_q4_bf16.cpp), for the fused decoder-layer calls in
// cpu_elementwise.cpp, which call it directly rather than back through the dispatcher.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace batchinfer_kernels {

// y = x W^T + bias in bfloat16, W Q4_0 (type 2) / Q4_1 (type 3) blocks packed by gguf_pack_bf16; x bfloat16
// [num_rows, in_features]; batch_invariant: the exact-weight chain at every height (a row's bits those of the row
// alone) instead of bfloat16 weights above 24 rows. The op `batchinfer_cpu::gguf_linear_bf16` (checks and raises
// as it does).
at::Tensor gguf_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                            const std::optional<at::Tensor>& bias, bool batch_invariant);

}  // namespace batchinfer_kernels
