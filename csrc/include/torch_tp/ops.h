#pragma once
// The C++ face of the torch_tp ops. Each function calls the op through the
// dispatcher, exactly as torch.ops.torch_tp.<op> does from Python, so autograd,
// CPU/CUDA and Meta kernels all apply. `group_name` is a name registered in
// c10d's group registry (ProcessGroup::getGroupName()).

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace torch_tp {

// Reduces x over the group: every rank gets the same reduced tensor.
// reduce_op: "sum", "avg", "min", "max", "product".
at::Tensor all_reduce(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name);

// Concatenates the ranks' x (equal shapes) along `dim`, in rank order:
// x [.., n, ..] -> [.., world_size * n, ..].
at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group_name);

// Reduces x over the group and keeps this rank's piece along `dim`:
// x [.., world_size * n, ..] -> [.., n, ..].
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                          c10::string_view group_name);

// Megatron's f: identity forward, sum all-reduce of the gradient backward.
at::Tensor copy_to_tp_region(const at::Tensor& x, c10::string_view group_name);

// Megatron's g: sum all-reduce forward, identity backward.
at::Tensor reduce_from_tp_region(const at::Tensor& x, c10::string_view group_name);

} // namespace torch_tp
