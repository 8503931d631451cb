#pragma once
// The CPU GEMV of decode: a few rows of x times a float32, bfloat16 or float16 weight,
// streamed at memory bandwidth (NOTE [few-row GEMV on the CPU] in gemv_cpu.cpp).

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace torch_tp {

// out [M, N] = x2d [M, K] @ weight [N, K]^T + bias [N], or nullopt where it does
// not apply (the caller then runs ATen's GEMM): it applies to CPU tensors, all
// float32, all bfloat16 or all float16, with 1 <= M <= kSmallBatchRows (chosen
// by measurement, see the NOTE), weight contiguous, x2d's rows contiguous in K,
// bias contiguous, on an x86-64 CPU with AVX-512 BF16 or else AVX2, FMA and
// F16C (the widest it has). Plain tensors only: no autograd (it runs inside the
// ops' forward kernels).
inline constexpr int64_t kSmallBatchRows = 8;
std::optional<at::Tensor> small_batch_linear_cpu(const at::Tensor& x2d, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias);

// The kernel's instruction-set variants, for tests that hold every one this CPU
// runs to the same results: the variants it supports (widest first, the one
// small_batch_linear_cpu takes), and the GEMV in a given one (which must be
// among them; nullopt where the arguments do not apply, as above).
enum class GemvIsa { Avx512, Avx2 };
std::vector<GemvIsa> supported_gemv_isas();
const char* gemv_isa_name(GemvIsa isa);
std::optional<at::Tensor> small_batch_linear_cpu_with(GemvIsa isa, const at::Tensor& x2d, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias);

} // namespace torch_tp
