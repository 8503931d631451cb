#pragma once
// What the CPU and Meta kernels of torch_tp::rms_norm's pieces share (norm.cpp, meta.cpp).

#include "ops/cpu_isa.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace torch_tp {

// Checks the arguments as aten::rms_norm does, naming `op`: normalized_shape
// the trailing sizes of input, a floating dtype, weight (when defined) of
// shape normalized_shape on input's device. With `fused_kernels` (the
// pieces' CPU and Meta kernels) also a dtype they take (float32, float64,
// bfloat16) and a weight of input's dtype. Returns the row length
// N = prod(normalized_shape). Works on symbolic sizes.
int64_t check_rms_norm_args(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, bool fused_kernels);

// The CPU kernels of the pieces _rms_norm_forward (-> output, rstd in opmath)
// and _rms_norm_backward (-> grad_input, grad_weight where output_mask says
// so, else empty), run with a given instruction-set variant of the row loops
// (NOTE [instruction-set variants of the row loops] in cpu_isa.h): for tests
// that hold every variant this CPU runs to the same results. The kernels
// registered for the pieces run widest_cpu_isa().
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_with(CpuIsa isa, const at::Tensor& input,
                                                         at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight,
                                                         std::optional<double> eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_with(CpuIsa isa, const at::Tensor& grad_out,
                                                          const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                                          std::array<bool, 2> output_mask);

} // namespace torch_tp
