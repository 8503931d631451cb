// Autograd kernels of the collective ops: torch::autograd::Function subclasses
// registered on the Autograd key. Each forward redispatches below autograd to
// the device kernel; each backward calls torch_tp ops through the dispatcher,
// so backward communication is itself differentiable (double backward) and
// traceable.
//
// NOTE [adjoint of a reduction over ranks]
// Rank k holds x_k; the reduced tensor is y = reduce_j x_j, held whole by every
// rank (all_reduce) or in pieces along `dim` (reduce_scatter). With g_r the
// gradient arriving at rank r's output,
//     dL/dx_k = (sum_r g_r, laid out like y) * dy/dx_k
// The first factor, `upstream`, is all_reduce_sum(g) for all_reduce and
// all_gather(g, dim) for reduce_scatter. The second is local:
//     sum: 1    avg: 1/p    max, min: [x_k == y] / #ranks tied at y (ties
//     share the gradient, as torch.amax does)    product: prod_{j != k} x_j
// (computed from the gathered x, never as y / x_k, so zeros are exact).

#include <torch_tp/ops.h>

#include "ops/common.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace torch_tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// dL/dx_k given the summed upstream gradient and the full reduced tensor;
// see NOTE [adjoint of a reduction over ranks].
at::Tensor reduction_adjoint(Reduction reduction, const at::Tensor& upstream, const at::Tensor& x,
                             const at::Tensor& y_full, const std::string& group_name) {
  switch (reduction) {
    case Reduction::Sum:
      return upstream;
    case Reduction::Avg:
      return upstream / resolve_group("torch_tp::all_reduce backward", group_name)->getSize();
    case Reduction::Min:
    case Reduction::Max: {
      const at::Tensor winners = x.eq(y_full).to(x.scalar_type());
      const at::Tensor ties = all_reduce(winners, "sum", group_name);
      return upstream * winners / ties;
    }
    case Reduction::Product: {
      // gathered [p, *x.shape]; the product over every row but this rank's is prod_{j != k} x_j.
      const auto group = resolve_group("torch_tp::all_reduce backward", group_name);
      const int64_t rank = group->getRank();
      const int64_t world_size = group->getSize();
      const at::Tensor gathered = all_gather(x.unsqueeze(0), 0, group_name);
      const at::Tensor others =
          at::cat({gathered.narrow(0, 0, rank), gathered.narrow(0, rank + 1, world_size - rank - 1)});
      return upstream * others.prod(0);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Reduction");
}

bool needs_inputs_for_backward(Reduction reduction) {
  return reduction == Reduction::Min || reduction == Reduction::Max || reduction == Reduction::Product;
}

struct AllReduceFunction : public torch::autograd::Function<AllReduceFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& reduce_op,
                            const std::string& group_name) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      y = all_reduce(x, reduce_op, group_name);
    }
    ctx->saved_data["reduce_op"] = reduce_op;
    ctx->saved_data["group_name"] = group_name;
    if (needs_inputs_for_backward(parse_reduction("torch_tp::all_reduce", reduce_op, x.scalar_type()))) {
      ctx->save_for_backward({x, y});
    }
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto reduce_op = ctx->saved_data["reduce_op"].toStringRef();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const Reduction reduction = parse_reduction("torch_tp::all_reduce", reduce_op, grad.scalar_type());
    const at::Tensor upstream = all_reduce(grad, "sum", group_name);
    at::Tensor grad_x;
    if (needs_inputs_for_backward(reduction)) {
      const auto saved = ctx->get_saved_variables();
      grad_x = reduction_adjoint(reduction, upstream, saved[0], saved[1], group_name);
    } else {
      grad_x = reduction_adjoint(reduction, upstream, at::Tensor(), at::Tensor(), group_name);
    }
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

struct AllGatherFunction : public torch::autograd::Function<AllGatherFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, const std::string& group_name,
                            std::optional<int64_t> full_size) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return all_gather(x, dim, group_name, full_size);
  }

  // The adjoint of a concatenation over ranks: each rank's block of the
  // gradient, summed over the ranks that received it. reduce_scatter cuts the
  // same torch.chunk pieces that were gathered.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    return {reduce_scatter(grad, dim, "sum", group_name), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterFunction : public torch::autograd::Function<ReduceScatterFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, const std::string& reduce_op,
                            const std::string& group_name) {
    at::Tensor piece;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      piece = reduce_scatter(x, dim, reduce_op, group_name);
    }
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["full_size"] = x.size(dim);
    ctx->saved_data["reduce_op"] = reduce_op;
    ctx->saved_data["group_name"] = group_name;
    if (needs_inputs_for_backward(parse_reduction("torch_tp::reduce_scatter", reduce_op, x.scalar_type()))) {
      ctx->save_for_backward({x, piece});
    }
    return piece;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const auto reduce_op = ctx->saved_data["reduce_op"].toStringRef();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const int64_t full_size = ctx->saved_data["full_size"].toInt();
    const Reduction reduction = parse_reduction("torch_tp::reduce_scatter", reduce_op, grad.scalar_type());
    const at::Tensor upstream = all_gather(grad, dim, group_name, full_size);
    at::Tensor grad_x;
    if (needs_inputs_for_backward(reduction)) {
      const auto saved = ctx->get_saved_variables();
      const at::Tensor y_full = all_gather(saved[1], dim, group_name, full_size);
      grad_x = reduction_adjoint(reduction, upstream, saved[0], y_full, group_name);
    } else {
      grad_x = reduction_adjoint(reduction, upstream, at::Tensor(), at::Tensor(), group_name);
    }
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// f: identity forward, sum all-reduce backward; g: the reverse. See NOTE
// [tensor-parallel region pair]. Each one's backward is the other op, not a
// plain all_reduce or identity, so that a backward with create_graph=True
// differentiates correctly: all_reduce's own backward (an all-reduce) would
// count a replicated gradient once per rank, and an identity would drop
// the sum over ranks. Without create_graph the backward skips g's copy.
struct CopyToTpRegionFunction : public torch::autograd::Function<CopyToTpRegionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group_name) {
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return copy_to_tp_region(x, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    return {reduce_from_tp_region(grad, ctx->saved_data["group_name"].toStringRef()), at::Tensor()};
  }
};

struct ReduceFromTpRegionFunction : public torch::autograd::Function<ReduceFromTpRegionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group_name) {
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return reduce_from_tp_region(x, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined() || !at::GradMode::is_enabled()) {
      return {grad, at::Tensor()};
    }
    return {copy_to_tp_region(grad, ctx->saved_data["group_name"].toStringRef()), at::Tensor()};
  }
};

// NOTE [no gradient, no Function]
// Function::apply builds a graph node, its context and saved data even when
// nothing needs a gradient, which costs more than a small all-reduce on the
// torch_tp backend takes. So when x needs no gradient (no
// grad mode or x does not require grad, and x carries no forward-mode
// tangent, which apply would reject), the kernels below redispatch straight
// below autograd (redispatch_or_apply): the same result, and no graph either way.
// The linear layers do the same when none of x, weight and bias needs a
// gradient (a decode step under torch.no_grad(), linear.cpp).

// `below()` under a guard that skips autograd when x needs no gradient, else `apply()`.
template <typename Below, typename Apply>
at::Tensor redispatch_or_apply(const at::Tensor& x, const Below& below, const Apply& apply) {
  if (!needs_autograd(x)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return below();
  }
  return apply();
}

at::Tensor all_reduce_autograd(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  return redispatch_or_apply(
      x, [&] { return all_reduce(x, reduce_op, group_name); },
      [&] { return AllReduceFunction::apply(x, std::string(reduce_op), std::string(group_name)); });
}

// NOTE [the in-place all-reduce and autograd]
// all_reduce_ records no history, so it refuses an x that needs a gradient
// (torch's _c10d_functional.all_reduce_ is not differentiable either; the
// differentiable one is all_reduce). Like every in-place op it bumps x's
// version counter, so autograd still reports a tensor saved for backward
// that it changed.
void all_reduce_inplace_autograd(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  TORCH_CHECK(!needs_autograd(x),
              "torch_tp::all_reduce_: x requires grad, and the in-place all-reduce is not differentiable; use "
              "torch_tp::all_reduce, or call it under torch.no_grad()");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    all_reduce_(x, reduce_op, group_name);
  }
  torch::autograd::impl::bump_version(x);
}

at::Tensor all_gather_autograd(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                               std::optional<int64_t> full_size) {
  return redispatch_or_apply(
      x, [&] { return all_gather(x, dim, group_name, full_size); },
      [&] { return AllGatherFunction::apply(x, dim, std::string(group_name), full_size); });
}

at::Tensor reduce_scatter_autograd(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                                   c10::string_view group_name) {
  return redispatch_or_apply(
      x, [&] { return reduce_scatter(x, dim, reduce_op, group_name); },
      [&] { return ReduceScatterFunction::apply(x, dim, std::string(reduce_op), std::string(group_name)); });
}

at::Tensor copy_to_tp_region_autograd(const at::Tensor& x, c10::string_view group_name) {
  return redispatch_or_apply(
      x, [&] { return copy_to_tp_region(x, group_name); },
      [&] { return CopyToTpRegionFunction::apply(x, std::string(group_name)); });
}

at::Tensor reduce_from_tp_region_autograd(const at::Tensor& x, c10::string_view group_name) {
  return redispatch_or_apply(
      x, [&] { return reduce_from_tp_region(x, group_name); },
      [&] { return ReduceFromTpRegionFunction::apply(x, std::string(group_name)); });
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("all_reduce", all_reduce_autograd);
  m.impl("all_reduce_", all_reduce_inplace_autograd);
  m.impl("all_gather", all_gather_autograd);
  m.impl("reduce_scatter", reduce_scatter_autograd);
  m.impl("copy_to_tp_region", copy_to_tp_region_autograd);
  m.impl("reduce_from_tp_region", reduce_from_tp_region_autograd);
}

} // namespace torch_tp
