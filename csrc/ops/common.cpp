#include "ops/common.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace torch_tp {

Reduction parse_reduction(const char* op, c10::string_view reduce_op, c10::ScalarType dtype) {
  Reduction reduction;
  if (reduce_op == "sum") {
    reduction = Reduction::Sum;
  } else if (reduce_op == "avg") {
    reduction = Reduction::Avg;
  } else if (reduce_op == "min") {
    reduction = Reduction::Min;
  } else if (reduce_op == "max") {
    reduction = Reduction::Max;
  } else if (reduce_op == "product") {
    reduction = Reduction::Product;
  } else {
    TORCH_CHECK(false, op, ": reduce_op='", reduce_op,
                "' is not supported; expected one of 'sum', 'avg', 'min', 'max', 'product'");
  }
  TORCH_CHECK(dtype != at::kBool, op, ": reduce_op='", reduce_op,
              "' is not supported for dtype ", dtype);
  // An integer average would have to round; torch refuses it too, so do we.
  TORCH_CHECK(reduction != Reduction::Avg || at::isFloatingType(dtype), op,
              ": reduce_op='avg' needs a floating-point dtype, got ", dtype);
  return reduction;
}

c10d::ReduceOp to_c10d(Reduction reduction) {
  switch (reduction) {
    case Reduction::Sum:
    case Reduction::Avg: return c10d::ReduceOp::SUM;
    case Reduction::Min: return c10d::ReduceOp::MIN;
    case Reduction::Max: return c10d::ReduceOp::MAX;
    case Reduction::Product: return c10d::ReduceOp::PRODUCT;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Reduction");
}

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const char* op, c10::string_view group_name) {
  try {
    return c10d::resolve_process_group(std::string(group_name));
  } catch (const c10::Error&) {
    TORCH_CHECK(false, op, ": group_name='", group_name,
                "' names no registered process group; pass ProcessGroup.group_name "
                "of a live group (after init_process_group / new_group)");
  }
}

void check_defined(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor (None); expected a tensor");
}

CollectiveArgs check_collective_args(const char* op, const at::Tensor& x, c10::string_view group_name,
                                     std::optional<c10::string_view> reduce_op, std::optional<int64_t> dim,
                                     bool allow_bool) {
  check_dtype(op, "x", x, allow_bool);
  CollectiveArgs args;
  if (reduce_op) {
    args.reduction = parse_reduction(op, *reduce_op, x.scalar_type());
  }
  if (dim) {
    args.dim = wrap_dim(op, *dim, x.dim());
  }
  args.group = resolve_group(op, group_name);
  return args;
}

void check_dtype(const char* op, const char* arg, const at::Tensor& x, bool allow_bool) {
  switch (x.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return;
    case at::kBool:
      if (allow_bool) {
        return;
      }
      break;
    default:
      break;
  }
  TORCH_CHECK(false, op, ": ", arg, " has unsupported dtype ", x.scalar_type(),
              "; supported: float32, float64, bfloat16, float16, uint8, int8, int16, int32, int64",
              allow_bool ? ", bool" : "");
}

int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim, const char* arg, const char* tensor) {
  TORCH_CHECK(ndim > 0, op, ": ", tensor, " must have at least one dimension to gather or scatter along, got a 0-d tensor");
  TORCH_CHECK(dim >= -ndim && dim < ndim, op, ": ", arg, "=", dim, " is out of range for ", tensor, " of ", ndim,
              " dimensions (expected -", ndim, " <= ", arg, " < ", ndim, ")");
  return dim < 0 ? dim + ndim : dim;
}

bool needs_autograd(const at::Tensor& x) {
  return (at::GradMode::is_enabled() && x.requires_grad()) || x._fw_grad(/*level=*/0).defined();
}

} // namespace torch_tp
