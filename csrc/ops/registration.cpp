// Every torch_tp op schema, and nothing else. Kernels are registered beside
// their code: collectives.cpp (CPU, CUDA), collectives_autograd.cpp (Autograd),
// meta.cpp (Meta).
//
// `group_name` is what ProcessGroup.group_name returns, the same string torch's
// _c10d_functional ops take; it is resolved through c10d's group registry, so
// the ops run on any process group (gloo, nccl, DeviceMesh groups, torch_tp's
// backend). `reduce_op` is one of "sum", "avg", "min", "max", "product".
//
// NOTE [tensor-parallel region pair]
// Megatron's f and g. A column-parallel layer reads a replicated input; its
// gradient with respect to that input is a partial sum on each rank, so the
// input passes through copy_to_tp_region (f: identity forward, all-reduce
// backward). A row-parallel layer produces partial sums; its output passes
// through reduce_from_tp_region (g: all-reduce forward, identity backward).
// f and g are each other's adjoint.

#include <torch/library.h>

TORCH_LIBRARY(torch_tp, m) {
  m.def("all_reduce(Tensor x, str reduce_op, str group_name) -> Tensor");
  m.def("all_gather(Tensor x, int dim, str group_name, int? full_size=None) -> Tensor");
  m.def("reduce_scatter(Tensor x, int dim, str reduce_op, str group_name) -> Tensor");
  m.def("copy_to_tp_region(Tensor x, str group_name) -> Tensor");
  m.def("reduce_from_tp_region(Tensor x, str group_name) -> Tensor");
}
