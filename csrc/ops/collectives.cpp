// Device kernels of the collective ops. The communication itself belongs to
// the process group (gloo, nccl, ...), which handles CPU and CUDA tensors and,
// for NCCL, orders its stream after the caller's current stream and makes
// the current stream wait on wait(); so one kernel per op serves both the
// CPU and the CUDA dispatch key. The kernels own the layout work: moving the
// gather/scatter dim to the front so each rank's piece is one contiguous
// block, and handing back a fresh contiguous tensor (the ops are functional).

#include "ops/common.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/version.h>
#include <torch/library.h>

namespace torch_tp {
namespace {

// ProcessGroup renamed _allgather_base/_reduce_scatter_base to
// all_gather_single/reduce_scatter_single in torch 2.13 and deprecated the old names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
c10::intrusive_ptr<c10d::Work> all_gather_into(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in) {
  return group.all_gather_single(out, in);
}
c10::intrusive_ptr<c10d::Work> reduce_scatter_into(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                   const c10d::ReduceScatterOptions& opts) {
  return group.reduce_scatter_single(out, in, opts);
}
#else
c10::intrusive_ptr<c10d::Work> all_gather_into(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in) {
  return group._allgather_base(out, in);
}
c10::intrusive_ptr<c10d::Work> reduce_scatter_into(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                   const c10d::ReduceScatterOptions& opts) {
  return group._reduce_scatter_base(out, in, opts);
}
#endif

// Runs one collective to completion. A failure inside the process group (a
// dtype the backend cannot reduce, a peer that timed out) comes back naming
// the op, the group, its backend and the tensor, not only the backend's words.
template <typename Launch>
void run_collective(const char* op, c10d::ProcessGroup& group, c10::string_view group_name, const at::Tensor& x,
                    Launch&& launch) {
  try {
    launch()->wait();
  } catch (c10::Error& e) {
    // Context, not a new error: a DistBackendError (timeout, dead peer) stays one.
    e.add_context(c10::str(op, ": the ", group.getBackendName(), " backend of group '", group_name,
                           "' failed on x of dtype ", x.scalar_type(), " and shape ", x.sizes()));
    throw;
  }
}

at::Tensor all_reduce_kernel(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::all_reduce";
  check_dtype(op, "x", x, /*allow_bool=*/false);
  const Reduction reduction = parse_reduction(op, reduce_op, x.scalar_type());
  const auto group = resolve_group(op, group_name);
  c10::OptionalDeviceGuard device_guard(x.device());

  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  const int64_t world_size = group->getSize();
  if (world_size == 1) {
    return out;
  }
  std::vector<at::Tensor> tensors{out};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(reduction);
  run_collective(op, *group, group_name, x, [&] { return group->allreduce(tensors, opts); });
  if (reduction == Reduction::Avg) {
    out.div_(world_size);
  }
  return out;
}

at::Tensor all_gather_kernel(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::all_gather";
  check_dtype(op, "x", x, /*allow_bool=*/true);
  dim = wrap_dim(op, dim, x.dim());
  const auto group = resolve_group(op, group_name);
  c10::OptionalDeviceGuard device_guard(x.device());

  const int64_t world_size = group->getSize();
  if (world_size == 1) {
    return x.clone(at::MemoryFormat::Contiguous);
  }
  // x [.., n, ..] -> front [n, rest] -> gathered [p*n, rest] (rank r's block at
  // rows r*n..(r+1)*n) -> moved back: [.., p*n, ..]. No copy for dim 0 of a
  // contiguous x.
  at::Tensor front = x.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= world_size;
  at::Tensor gathered = at::empty(sizes, front.options());
  run_collective(op, *group, group_name, x, [&] { return all_gather_into(*group, gathered, front); });
  return gathered.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_kernel(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                                 c10::string_view group_name) {
  constexpr const char* op = "torch_tp::reduce_scatter";
  check_dtype(op, "x", x, /*allow_bool=*/false);
  const Reduction reduction = parse_reduction(op, reduce_op, x.scalar_type());
  dim = wrap_dim(op, dim, x.dim());
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  check_divisible(op, x, dim, world_size, group_name);
  c10::OptionalDeviceGuard device_guard(x.device());

  if (world_size == 1) {
    return x.clone(at::MemoryFormat::Contiguous);
  }
  // x [.., p*n, ..] -> front [p*n, rest] -> reduced piece [n, rest] (rows
  // r*n..(r+1)*n of the sum) -> moved back: [.., n, ..].
  at::Tensor front = x.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] /= world_size;
  at::Tensor piece = at::empty(sizes, front.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = to_c10d(reduction);
  run_collective(op, *group, group_name, x, [&] { return reduce_scatter_into(*group, piece, front, opts); });
  if (reduction == Reduction::Avg) {
    piece.div_(world_size);
  }
  return piece.movedim(0, dim).contiguous();
}

// f's forward is the identity; the op still hands back a new tensor, as a
// functional op must (its output may not alias its input).
at::Tensor copy_to_tp_region_kernel(const at::Tensor& x, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::copy_to_tp_region";
  check_dtype(op, "x", x, /*allow_bool=*/false);
  resolve_group(op, group_name);
  return x.clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_from_tp_region_kernel(const at::Tensor& x, c10::string_view group_name) {
  return all_reduce_kernel(x, "sum", group_name);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  m.impl("all_reduce", all_reduce_kernel);
  m.impl("all_gather", all_gather_kernel);
  m.impl("reduce_scatter", reduce_scatter_kernel);
  m.impl("copy_to_tp_region", copy_to_tp_region_kernel);
  m.impl("reduce_from_tp_region", reduce_from_tp_region_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("all_reduce", all_reduce_kernel);
  m.impl("all_gather", all_gather_kernel);
  m.impl("reduce_scatter", reduce_scatter_kernel);
  m.impl("copy_to_tp_region", copy_to_tp_region_kernel);
  m.impl("reduce_from_tp_region", reduce_from_tp_region_kernel);
}

} // namespace torch_tp
