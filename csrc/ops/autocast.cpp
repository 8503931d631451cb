// Autocast kernels of the sharded linear ops, for torch.autocast on CPU and CUDA.
//
// NOTE [sharded linear under autocast]
// Under torch.autocast, aten::linear runs in the autocast dtype (bfloat16 by
// default on the CPU, float16 on CUDA): its "lower precision" policy casts x,
// weight and bias before the GEMM, and the casts are differentiable, so float32
// parameters keep float32 gradients. column_parallel_linear and
// row_parallel_linear follow the same policy, so a tensor-parallel model under
// autocast computes what the unsharded one computes, and what torch's TP
// computes (DTensor's linear is aten::linear). A sequence-parallel column layer
// therefore gathers x after the cast: the values a gather-then-cast gives, in
// half the bytes. The embedding ops need no kernel of their own: they are
// composite, so their aten::embedding runs as it does under autocast (in the
// weight's dtype), and the collectives move whatever dtype they are handed.

#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <torch_tp/ops.h>

namespace torch_tp {
namespace {

template <c10::DeviceType Device>
at::Tensor column_parallel_linear_autocast(const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                           std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
                                           c10::string_view activation, bool partial_grad_input) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  const at::ScalarType dtype = at::autocast::get_lower_precision_fp_from_device_type(Device);
  return column_parallel_linear(at::autocast::cached_cast(dtype, x, Device),
                                at::autocast::cached_cast(dtype, weight, Device),
                                at::autocast::cached_cast(dtype, bias, Device), group_name, gather_dim, full_size,
                                activation, partial_grad_input);
}

template <c10::DeviceType Device>
at::Tensor row_parallel_linear_autocast(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                        std::optional<int64_t> scatter_dim) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  const at::ScalarType dtype = at::autocast::get_lower_precision_fp_from_device_type(Device);
  return row_parallel_linear(at::autocast::cached_cast(dtype, x, Device),
                             at::autocast::cached_cast(dtype, weight, Device),
                             at::autocast::cached_cast(dtype, bias, Device), group_name, scatter_dim);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, AutocastCPU, m) {
  m.impl("column_parallel_linear", column_parallel_linear_autocast<c10::DeviceType::CPU>);
  m.impl("row_parallel_linear", row_parallel_linear_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(torch_tp, AutocastCUDA, m) {
  m.impl("column_parallel_linear", column_parallel_linear_autocast<c10::DeviceType::CUDA>);
  m.impl("row_parallel_linear", row_parallel_linear_autocast<c10::DeviceType::CUDA>);
}

} // namespace torch_tp
