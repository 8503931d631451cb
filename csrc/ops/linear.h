#pragma once
// Column- and row-parallel linear: argument checks and the kernel bodies
// shared by the CPU and CUDA registrations (linear.cpp, linear_cuda.cpp) and
// the Meta kernels (meta.cpp). Only the forward GEMM differs by device: ATen
// on the CPU, cuBLASLt with the bias (and GELU) fused into the epilogue on CUDA.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace torch_tp {

// The activation a column-parallel layer may fuse after its bias.
// "gelu_tanh" is GELU's tanh approximation (F.gelu(approximate="tanh")), the
// one cuBLASLt's epilogue computes.
enum class Activation { None, GeluTanh };
Activation parse_activation(const char* op, c10::string_view activation);

// out [M, N] = activation(x2d [M, K] @ weight [N, K]^T + bias [N]);
// pre_activation holds the value before the activation, or is undefined without one.
// `op` is the calling op's name, for error messages.
struct GemmResult {
  at::Tensor out;
  at::Tensor pre_activation;
};
using LinearGemm = GemmResult (*)(const char* op, const at::Tensor& x2d, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, Activation activation);
GemmResult linear_gemm_aten(const char* op, const at::Tensor& x2d, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, Activation activation);

// Checks x [.., K], weight [N, K], bias [N] (dtypes, devices, shapes) and
// wraps `dim` (a gather or scatter dim, never the feature dim) against x.dim().
// Returns the wrapped dim.
std::optional<int64_t> check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                                         const char* dim_name);

// (out, pre_activation); pre_activation is an empty tensor without an activation.
std::tuple<at::Tensor, at::Tensor> column_parallel_linear_forward(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, c10::string_view group_name,
    std::optional<int64_t> gather_dim, std::optional<int64_t> full_size, c10::string_view activation,
    LinearGemm gemm);

at::Tensor row_parallel_linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                       std::optional<int64_t> scatter_dim, LinearGemm gemm);

// A gradient the backward was not asked for (NOTE [skipped gradients] in
// linear.cpp): an empty tensor, from the device kernels and the Meta kernels alike.
at::Tensor skipped_gradient(const at::Tensor& like);

// partial_grad_input leaves grad_x partial (NOTE [partial grad_x] in
// linear.cpp); with a gather_dim the backward must reduce-scatter it, so the
// pair is refused here, in the forward, not first in the backward.
void check_partial_grad_input(const char* op, bool partial_grad_input, std::optional<int64_t> gather_dim);

// The forward kernels, one instantiation per device GEMM (linear.cpp: ATen,
// linear_cuda.cpp: cuBLASLt).
template <LinearGemm Gemm>
std::tuple<at::Tensor, at::Tensor> column_parallel_linear_forward_kernel(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, c10::string_view group_name,
    std::optional<int64_t> gather_dim, std::optional<int64_t> full_size, c10::string_view activation) {
  return column_parallel_linear_forward(x, weight, bias, group_name, gather_dim, full_size, activation, Gemm);
}

// column_parallel_linear is its forward op's output without the
// pre-activation: one body for the device kernels (Forward =
// column_parallel_linear_forward_kernel<Gemm>) and the Meta kernel (Forward =
// column_parallel_linear_forward_meta). partial_grad_input only changes the
// backward (see linear.cpp).
template <auto Forward>
at::Tensor column_parallel_linear_from_forward(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                               std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
                                               c10::string_view activation, bool partial_grad_input) {
  check_partial_grad_input("torch_tp::column_parallel_linear", partial_grad_input, gather_dim);
  return std::get<0>(Forward(x, weight, bias, group_name, gather_dim, full_size, activation));
}

template <LinearGemm Gemm>
constexpr auto column_parallel_linear_kernel =
    column_parallel_linear_from_forward<column_parallel_linear_forward_kernel<Gemm>>;

template <LinearGemm Gemm>
at::Tensor row_parallel_linear_kernel(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                      std::optional<int64_t> scatter_dim) {
  return row_parallel_linear_forward(x, weight, bias, group_name, scatter_dim, Gemm);
}

} // namespace torch_tp
