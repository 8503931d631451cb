// Device kernels of the collective ops. The communication belongs to the
// process group (gloo, nccl, ...), which handles CPU and CUDA tensors and, for
// NCCL, orders its stream after the caller's current stream and makes the
// current stream wait in wait(); so one kernel per op serves both the CPU and
// the CUDA dispatch key. The layout work (dim to the front, torch.chunk
// padding) is in comm.cpp. The ops are functional: they return a fresh
// contiguous tensor and leave x alone; all_reduce_ alone works in place.

#include "ops/comm.h"
#include "ops/common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_tp {
namespace {

// A new contiguous tensor holding x reduced over the group (the backend writes
// it directly, NOTE [direct calls from the ops]).
at::Tensor all_reduce_to_new(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& x,
                             Reduction reduction) {
  const at::Tensor in = x.contiguous();
  return start_all_reduce(op, group, false, in, at::empty(in.sizes(), in.options()), reduction).wait();
}

at::Tensor all_reduce_kernel(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::all_reduce";
  const auto args = check_collective_args(op, x, group_name, reduce_op, std::nullopt, /*allow_bool=*/false);
  return all_reduce_to_new(op, args.group, x, args.reduction);
}

void all_reduce_inplace_kernel(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::all_reduce_";
  const auto args = check_collective_args(op, x, group_name, reduce_op, std::nullopt, /*allow_bool=*/false);
  // A non-contiguous x is reduced through a contiguous copy.
  const at::Tensor dense = x.contiguous();
  start_all_reduce(op, args.group, false, dense, dense, args.reduction).wait();
  if (!dense.is_same(x)) {
    x.copy_(dense);
  }
}

at::Tensor all_gather_kernel(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                             std::optional<int64_t> full_size) {
  constexpr const char* op = "torch_tp::all_gather";
  const auto args = check_collective_args(op, x, group_name, std::nullopt, dim, /*allow_bool=*/true);
  return start_all_gather(op, args.group, false, x, args.dim, full_size).wait();
}

at::Tensor reduce_scatter_kernel(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                                 c10::string_view group_name) {
  constexpr const char* op = "torch_tp::reduce_scatter";
  const auto args = check_collective_args(op, x, group_name, reduce_op, dim, /*allow_bool=*/false);
  return start_reduce_scatter(op, args.group, false, x, args.dim, args.reduction).wait();
}

// f's forward is the identity; the op still hands back a new tensor, as a
// functional op must (its output may not alias its input).
at::Tensor copy_to_tp_region_kernel(const at::Tensor& x, c10::string_view group_name) {
  check_collective_args("torch_tp::copy_to_tp_region", x, group_name, std::nullopt, std::nullopt,
                        /*allow_bool=*/false);
  return x.clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_from_tp_region_kernel(const at::Tensor& x, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::reduce_from_tp_region";
  const auto args = check_collective_args(op, x, group_name, std::nullopt, std::nullopt, /*allow_bool=*/false);
  return all_reduce_to_new(op, args.group, x, Reduction::Sum);
}

// One kernel per op for both device types (see the top of this file).
void impl_collective_kernels(torch::Library& m) {
  m.impl("all_reduce", all_reduce_kernel);
  m.impl("all_reduce_", all_reduce_inplace_kernel);
  m.impl("all_gather", all_gather_kernel);
  m.impl("reduce_scatter", reduce_scatter_kernel);
  m.impl("copy_to_tp_region", copy_to_tp_region_kernel);
  m.impl("reduce_from_tp_region", reduce_from_tp_region_kernel);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  impl_collective_kernels(m);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  impl_collective_kernels(m);
}

} // namespace torch_tp
