#pragma once
// The C++ face of the torch_tp ops. Each function calls the op through the
// dispatcher, exactly as torch.ops.torch_tp.<op> does from Python, so autograd,
// CPU/CUDA and Meta kernels all apply. `group_name` is a name registered in
// c10d's group registry (ProcessGroup::getGroupName()).

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace torch_tp {

// Reduces x over the group: every rank gets the same reduced tensor.
// reduce_op: "sum", "avg", "min", "max", "product".
at::Tensor all_reduce(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name);

// Concatenates the ranks' x along `dim`, in rank order. Without full_size
// every rank's x has the same shape: x [.., n, ..] -> [.., world_size * n, ..].
// With it, the ranks hold the torch.chunk pieces of full_size rows (uneven
// shards, DTensor's Shard(dim)): x [.., s_rank, ..] -> [.., full_size, ..].
at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                      std::optional<int64_t> full_size = std::nullopt);

// Reduces x over the group and keeps this rank's torch.chunk piece along `dim`:
// x [.., n, ..] -> [.., s_rank, ..], s_rank = the size of torch.chunk(n, p)[rank]
// (0 for ranks past the last piece).
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                          c10::string_view group_name);

// Megatron's f: identity forward, sum all-reduce of the gradient backward.
at::Tensor copy_to_tp_region(const at::Tensor& x, c10::string_view group_name);

// Megatron's g: sum all-reduce forward, identity backward.
at::Tensor reduce_from_tp_region(const at::Tensor& x, c10::string_view group_name);

} // namespace torch_tp
