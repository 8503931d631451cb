#pragma once
// The CPU GEMV of decode: a few rows of x times a bfloat16 or float32 weight,
// streamed at memory bandwidth (NOTE [few-row GEMV on the CPU] in gemv_cpu.cpp).

#include <ATen/core/Tensor.h>

#include <optional>

namespace torch_tp {

// out [M, N] = x2d [M, K] @ weight [N, K]^T + bias [N], or nullopt where it does
// not apply (the caller then runs ATen's GEMM): it applies to CPU tensors, all
// bfloat16 or all float32, with 1 <= M <= kSmallBatchRows (chosen by
// measurement, see the NOTE), weight contiguous, x2d's rows contiguous in K,
// bias contiguous, on a CPU with AVX-512 BF16 (float32 too: one guard, one
// instruction set for both). Plain tensors only: no autograd (it runs inside
// the ops' forward kernels).
inline constexpr int64_t kSmallBatchRows = 8;
std::optional<at::Tensor> small_batch_linear_cpu(const at::Tensor& x2d, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias);

} // namespace torch_tp
