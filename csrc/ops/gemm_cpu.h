#pragma once
// The linear ops' GEMMs on the CPU in bfloat16 and float16, at float32 speed
// where ATen has no fast GEMM for them (NOTE [half-precision GEMMs through
// float32 panels] in gemm_cpu.cpp).

#include <ATen/core/Tensor.h>

#include <optional>

namespace torch_tp {

// a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype, any strides: at::mm
// (at::addmm), except for bfloat16 or float16 CPU operands on a CPU where
// ATen's GEMM for that dtype is its scalar fallback; there the product is
// computed in float32 panels and rounded once (but for 1-2 rows of a against a
// row-major weight, which ATen's fallback does as fast dot products).
at::Tensor local_mm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias = std::nullopt);

// Whether local_mm takes the float32 panels for this dtype on this CPU.
bool half_gemm_through_float32(at::ScalarType dtype);

} // namespace torch_tp
