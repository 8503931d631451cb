#pragma once
// What the CPU and Meta kernels of torch_tp::rms_norm's pieces share (norm.cpp, meta.cpp).

#include <ATen/core/Tensor.h>

namespace torch_tp {

// Checks the arguments as aten::rms_norm does, naming `op`: normalized_shape
// the trailing sizes of input, a floating dtype, weight (when defined) of
// shape normalized_shape on input's device. With `fused_kernels` (the
// pieces' CPU and Meta kernels) also a dtype they take (float32, float64,
// bfloat16) and a weight of input's dtype. Returns the row length
// N = prod(normalized_shape). Works on symbolic sizes.
int64_t check_rms_norm_args(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, bool fused_kernels);

} // namespace torch_tp
