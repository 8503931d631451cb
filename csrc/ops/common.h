#pragma once
// Argument checking and process-group plumbing shared by the op kernels.
// Every helper takes the op's qualified name so that errors read
// "torch_tp::all_gather: dim=3 is out of range for x of 2 dimensions".

#include "backend/reduction.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <string>

namespace torch_tp {

// The typed dispatcher handle of a torch_tp op (look it up once, in a static).
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Parses `reduce_op` and checks that `dtype` allows it (avg needs a floating
// dtype; bool allows none). Throws naming the op, the argument and the value.
Reduction parse_reduction(const char* op, c10::string_view reduce_op, c10::ScalarType dtype);

// The c10d reduction that computes `reduction` (avg is a sum, divided afterwards,
// so that it works on every backend and integer-free dtypes alike).
c10d::ReduceOp to_c10d(Reduction reduction);

// Looks `group_name` up in c10d's group registry (the names ProcessGroup.group_name
// returns and torch's _c10d_functional ops take).
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const char* op, c10::string_view group_name);

// Checks that the tensor argument `arg` was given: an undefined tensor (None
// from Python) otherwise fails deep inside autograd or ATen without a name.
void check_defined(const char* op, const char* arg, const at::Tensor& t);

// Whether an op on x must record autograd history: grad mode and x requires
// grad, or x carries a forward-mode tangent (NOTE [no gradient, no Function]
// in collectives_autograd.cpp).
bool needs_autograd(const at::Tensor& x);

// Checks that the dtype is one the collectives support: float32/64, bfloat16,
// float16 and the integer types; bool only where `allow_bool` (no reduction).
void check_dtype(const char* op, const char* arg, const at::Tensor& x, bool allow_bool);

// The checks a collective op's device and Meta kernels share, in one order,
// so that a bad call fails at trace time with the same message: x's dtype
// (bool only where `allow_bool`), reduce_op if the op has one, dim wrapped if
// the op has one, then the group resolved.
struct CollectiveArgs {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  Reduction reduction = Reduction::Sum;  // unused by an op without reduce_op
  int64_t dim = 0;                       // wrapped; unused by an op without dim
};
CollectiveArgs check_collective_args(const char* op, const at::Tensor& x, c10::string_view group_name,
                                     std::optional<c10::string_view> reduce_op, std::optional<int64_t> dim,
                                     bool allow_bool);

// Wraps a possibly negative `dim` (the argument `arg` of the op) into
// [0, ndim) for the tensor called `tensor`, or throws.
int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim, const char* arg = "dim", const char* tensor = "x");

} // namespace torch_tp
