// Column- and row-parallel linear layers (Megatron's ColumnParallelLinear and
// RowParallelLinear) as ops with C++ autograd.
//
// Shapes, with p ranks, x's leading dims flattened to M rows:
//   column:  x [.., K] (replicated)  @ W_r [N/p, K]^T + b_r [N/p]  -> [.., N/p]
//            backward: grad_x = all_reduce(grad @ W_r)
//   column, sequence parallel (gather_dim = s):
//            x [.., s/p, .., K] -> all_gather(s) -> [.., s, .., K] @ W_r^T + b_r -> [.., s, .., N/p]
//            backward: grad_x = reduce_scatter(grad @ W_r, s)
//   row:     x [.., K/p] @ W_r [N, K/p]^T -> partial [.., N] -> all_reduce -> + b [N]
//   row, sequence parallel (scatter_dim = s):
//            partial [.., s, .., N] -> reduce_scatter(s) -> [.., s/p, .., N] + b
//            backward: grad = all_gather(grad, s), then the local GEMMs
// (s/p meaning this rank's torch.chunk piece: uneven lengths are allowed.)
//
// NOTE [backward overlap]
// As in Megatron, the column backward starts the grad-input collective
// asynchronously and computes the weight gradient while it runs. Under
// sequence parallelism the forward saves only the local shard of x; the
// backward starts re-gathering it first and computes grad @ W meanwhile:
//     start all_gather(x)     | grad_x_full = grad @ W
//     wait; start reduce_scatter(grad_x_full)
//                             | grad_W = grad^T @ x_full,  grad_b = sum(grad)
//     wait
// On CPU the collective runs on the backend's threads (gloo, and the torch_tp
// backend where its ranks have cores to spare); on CUDA, NCCL runs it on its
// own stream, ordered after the current stream by an event, and wait() makes
// the current stream wait for it, so the GEMM overlaps. Where the torch_tp
// backend's worker would share the rank's core, the op makes the call at
// start and computes after it (NOTE [async calls without a core to run on]).
//
// NOTE [partial grad_x]
// Several column-parallel layers often read one replicated input that was
// all-gathered from sequence shards (q, k, v after PrepareModuleInput). Each
// all-reducing its own grad_x costs one full-size all-reduce per layer; the
// sum of their partial grad_x needs only one reduce-scatter, back through the
// gather. With partial_grad_input=True the op leaves grad_x partial; the
// Python layer uses it where the input is a DTensor, whose gradient DTensor
// then carries a Partial placement and is reduced once where it meets the
// gather, exactly as DTensor's own linear would be.
//
// NOTE [no partial gradients]
// Every gradient these ops return is complete on every rank: the column
// layer's bias is sharded like its output, and the row layer's replicated bias
// gets sum(grad) over the *gathered* gradient under sequence parallelism (the
// gather happens anyway). Replicated parameters used outside these ops on
// sequence shards (norm weights) are partial and must be all-reduced by the
// caller; the Python layer does that.
//
// NOTE [skipped gradients]
// Fine-tuning freezes weights (LoRA, adapters, BitFit), and a layer's input
// often needs no gradient (the first layer's, or one behind frozen layers).
// The autograd kernels pass the backward ops an output_mask, as aten's
// *_backward ops take one, from the node's needs_input_grad, and the backward
// runs only what it asks for:
//   no grad_x:      no grad @ W GEMM, and no all-reduce / reduce-scatter of it
//   no grad_weight: no grad^T @ x GEMM, and under sequence parallelism no
//                   re-gather of x (only grad_weight reads it)
//   no grad_bias:   no sum
// The row layer's gather of grad under sequence parallelism feeds all three,
// so it runs whenever one of them is wanted. A skipped collective must be
// skipped on every rank, or the others wait for it forever. It is: every
// rank runs the same program on the same graph with the same requires_grad
// flags (a frozen parameter is frozen on every rank, its shards being one
// parameter; autograd.grad asks every rank for the same inputs), so
// needs_input_grad, and with it the mask, is the same on every rank. Under
// torch.compile the mask is a constant of the traced backward: AOTAutograd
// traces these kernels with the inputs' requires_grad, on which Dynamo guards.

#include "ops/linear.h"

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/gemm_cpu.h"
#include "ops/gemv_cpu.h"

#include <torch_tp/ops.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>

namespace torch_tp {

Activation parse_activation(const char* op, c10::string_view activation) {
  if (activation == "none") {
    return Activation::None;
  }
  if (activation == "gelu_tanh") {
    return Activation::GeluTanh;
  }
  TORCH_CHECK(false, op, ": activation='", activation, "' is not supported; expected 'none' or 'gelu_tanh'");
}

// Decode's few-row float32, bfloat16 and float16 GEMMs (x [<= 8, K]) go to
// small_batch_linear_cpu, which streams W from DRAM nearer memory bandwidth
// than ATen's GEMV does with one x row, and than ATen's GEMM does with 2-8
// rows (NOTE [few-row GEMV on the CPU] in gemv_cpu.cpp; float16 there too).
// Everything else goes to ATen,
// except bfloat16 and float16 on a CPU where ATen's GEMM for them is its scalar
// fallback (local_mm, NOTE [half-precision GEMMs through float32 panels]).
GemmResult linear_gemm_aten(const char* /*op*/, const at::Tensor& x2d, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, Activation activation) {
  std::optional<at::Tensor> gemv = small_batch_linear_cpu(x2d, weight, bias);
  at::Tensor pre = gemv ? *std::move(gemv) : local_mm(x2d, weight.t(), bias);
  if (activation == Activation::None) {
    return {pre, at::Tensor()};
  }
  return {at::gelu(pre, "tanh"), pre};
}

std::optional<int64_t> check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                                         const char* dim_name) {
  check_defined(op, "x", x);
  check_defined(op, "weight", weight);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": x has dtype ", x.scalar_type(),
              "; expected float32, float64, bfloat16 or float16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight has dtype ", weight.scalar_type(),
              " but x has dtype ", x.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), op, ": weight is on ", weight.device(), " but x is on ", x.device());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got shape ", weight.sizes());
  TORCH_CHECK(x.sym_size(-1) == weight.sym_size(1), op, ": x.size(-1)=", x.sym_size(-1),
              " does not match weight.size(1)=", weight.sym_size(1), " (weight is ", weight.sym_sizes(), ")");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias has dtype ", bias->scalar_type(),
                " but x has dtype ", x.scalar_type());
    TORCH_CHECK(bias->device() == x.device(), op, ": bias is on ", bias->device(), " but x is on ", x.device());
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), op, ": bias must have shape [",
                weight.sym_size(0), "] (weight.size(0)), got ", bias->sym_sizes());
  }
  if (!dim) {
    return std::nullopt;
  }
  const int64_t wrapped = wrap_dim(op, *dim, x.dim(), dim_name);
  TORCH_CHECK(wrapped != x.dim() - 1, op, ": ", dim_name, "=", *dim,
              " is the feature dimension; it must name a sequence or batch dimension");
  return wrapped;
}

at::Tensor skipped_gradient(const at::Tensor& like) {
  return at::empty({0}, like.options());
}

void check_partial_grad_input(const char* op, bool partial_grad_input, std::optional<int64_t> gather_dim) {
  TORCH_CHECK(!(partial_grad_input && gather_dim), op, ": partial_grad_input=True does not combine with gather_dim=",
              gather_dim.value_or(0), " (the backward must reduce-scatter grad_x back to the sequence shards)");
}

// x [.., K] as the 2-D [M, K] the GEMMs take (M = the product of the leading
// dims; spelled out because reshape({-1, 0}) is ambiguous for a rank whose
// shard has no features).
static at::Tensor rows2d(const at::Tensor& x) {
  return x.reshape({c10::multiply_integers(x.sizes().slice(0, x.dim() - 1)), x.size(-1)});
}

// Output sizes: `sizes` with the last dim replaced by n.
static std::vector<int64_t> with_features(at::IntArrayRef sizes, int64_t n) {
  auto out = sizes.vec();
  out.back() = n;
  return out;
}

std::tuple<at::Tensor, at::Tensor> column_parallel_linear_forward(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, c10::string_view group_name,
    std::optional<int64_t> gather_dim, std::optional<int64_t> full_size, c10::string_view activation,
    LinearGemm gemm) {
  constexpr const char* op = "torch_tp::column_parallel_linear";
  const auto dim = check_linear_args(op, x, weight, bias, gather_dim, "gather_dim");
  const Activation act = parse_activation(op, activation);
  const auto group = resolve_group(op, group_name);
  const at::Tensor x_full = dim ? start_all_gather(op, group, false, x, *dim, full_size, "gather_dim").wait() : x;
  const GemmResult result = gemm(op, rows2d(x_full), weight, bias, act);
  const auto sizes = with_features(x_full.sizes(), weight.size(0));
  at::Tensor pre = act == Activation::None ? at::empty({0}, x.options()) : result.pre_activation.view(sizes);
  return {result.out.view(sizes), pre};
}

at::Tensor row_parallel_linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                       std::optional<int64_t> scatter_dim, LinearGemm gemm) {
  constexpr const char* op = "torch_tp::row_parallel_linear";
  const auto dim = check_linear_args(op, x, weight, bias, scatter_dim, "scatter_dim");
  const auto group = resolve_group(op, group_name);
  at::Tensor partial =
      gemm(op, rows2d(x), weight, std::nullopt, Activation::None).out.view(
          with_features(x.sizes(), weight.size(0)));
  at::Tensor y = dim ? start_reduce_scatter(op, group, false, partial, *dim, Reduction::Sum, "scatter_dim").wait()
                     : start_all_reduce(op, group, false, partial, partial, Reduction::Sum).wait();
  // Added once, after the reduction, so the result is nn.Linear's.
  return bias ? y.add_(*bias) : y;
}

namespace {

// The backward kernels run ATen's GEMMs on every device, through local_mm
// (NOTE [half-precision GEMMs through float32 panels]). See NOTE [backward
// overlap] and NOTE [skipped gradients].
std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pre_activation,
    c10::string_view group_name, std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
    c10::string_view activation, bool partial_grad_input, std::array<bool, 3> output_mask) {
  constexpr const char* op = "torch_tp::column_parallel_linear backward";
  check_partial_grad_input(op, partial_grad_input, gather_dim);
  const auto [want_x, want_weight, want_bias] = output_mask;
  const auto group = resolve_group(op, group_name);
  const bool sequence_parallel = gather_dim.has_value();
  const int64_t dim = sequence_parallel ? (*gather_dim < 0 ? *gather_dim + x.dim() : *gather_dim) : 0;

  std::optional<PendingCollective> x_gather;
  if (sequence_parallel && want_weight) {
    x_gather.emplace(start_all_gather(op, group, true, x, dim, full_size, "gather_dim"));
  }
  const at::Tensor grad_pre = parse_activation(op, activation) == Activation::GeluTanh
      ? at::gelu_backward(grad_out, pre_activation, "tanh")
      : grad_out;
  const at::Tensor grad2d = rows2d(grad_pre);
  // grad [.., N/p] @ W_r [N/p, K] -> this rank's partial sum of grad_x [.., K]
  // (gathered length under sequence parallelism); overlaps the gather of x.
  at::Tensor grad_x =
      want_x ? local_mm(grad2d, weight).view(with_features(grad_pre.sizes(), weight.size(1)))
             : skipped_gradient(grad_out);
  const at::Tensor x_full = x_gather ? x_gather->wait() : x;

  // partial_grad_input: the caller reduces grad_x later (see NOTE [partial grad_x]).
  std::optional<PendingCollective> grad_x_comm;
  if (want_x && !partial_grad_input) {
    grad_x_comm.emplace(sequence_parallel
                            ? start_reduce_scatter(op, group, true, grad_x, dim, Reduction::Sum, "gather_dim")
                            : start_all_reduce(op, group, true, grad_x, grad_x, Reduction::Sum));
  }
  // Overlaps the grad-input collective.
  at::Tensor grad_weight = want_weight ? local_mm(grad2d.t(), rows2d(x_full)) : skipped_gradient(grad_out);
  at::Tensor grad_bias = want_bias ? grad2d.sum(0) : skipped_gradient(grad_out);
  if (grad_x_comm) {
    grad_x = grad_x_comm->wait();
  }
  return {grad_x, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_parallel_linear_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    std::optional<int64_t> scatter_dim, std::array<bool, 3> output_mask) {
  constexpr const char* op = "torch_tp::row_parallel_linear backward";
  const auto [want_x, want_weight, want_bias] = output_mask;
  const auto group = resolve_group(op, group_name);
  at::Tensor grad_full = grad_out;
  if (scatter_dim) {
    const int64_t dim = *scatter_dim < 0 ? *scatter_dim + x.dim() : *scatter_dim;
    grad_full = start_all_gather(op, group, false, grad_out, dim, x.size(dim), "scatter_dim").wait();
  }
  const at::Tensor grad2d = rows2d(grad_full);
  at::Tensor grad_x = want_x ? local_mm(grad2d, weight).view(x.sizes()) : skipped_gradient(grad_out);
  at::Tensor grad_weight = want_weight ? local_mm(grad2d.t(), rows2d(x)) : skipped_gradient(grad_out);
  at::Tensor grad_bias = want_bias ? grad2d.sum(0) : skipped_gradient(grad_out);
  return {grad_x, grad_weight, grad_bias};
}

// ---------------------------------------------------------------- double backward

// NOTE [double backward]
// The fused backward kernels above are not differentiable (they are plain
// ops with no autograd kernel), so a backward with create_graph=True would
// silently treat their outputs as constants. Under create_graph the autograd
// functions below instead compute the same gradients as a composition of
// differentiable ATen ops and torch_tp collectives, which autograd records.
// The collectives must be the ones whose own backward is the adjoint, with
// the conventions of the forward (NOTE [tensor-parallel region pair]): a
// replicated tensor counts once, so where a replicated value meets per-rank
// work its gradient goes through f (copy_to_tp_region: identity, its backward
// sums over ranks), and a sum of per-rank partials that yields a replicated
// value is g (reduce_from_tp_region); shards go through all_gather /
// reduce_scatter, each the other's adjoint. Column, with x_in = f(x)
// (or all_gather(x, s) under sequence parallelism, or x itself with
// partial_grad_input, whose grad_x stays partial):
//     pre    = x_in @ W^T + b       (recomputed only for the activation)
//     g_pre  = gelu_backward(grad, pre)  or grad
//     grad_x = g(g_pre @ W)  /  reduce_scatter(g_pre @ W, s)  /  g_pre @ W
//     grad_W = g_pre^T @ x_in,   grad_b = sum(g_pre)
// Row, with grad_in = f(grad) (or all_gather(grad, s)):
//     grad_x = grad_in @ W,   grad_W = grad_in^T @ x
//     grad_b = sum(grad) (replicated, counted once), or under sequence
//              parallelism g(sum of this rank's rows)
// Each costs what the fused backward costs plus, with an activation, the
// forward GEMM again; only second-order training pays it. Like the fused
// kernels, they compute only what output_mask asks for (NOTE [skipped
// gradients]); a gradient not computed is undefined.

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward_differentiable(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const std::string& group_name, std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
    const std::string& activation, bool partial_grad_input, std::array<bool, 3> output_mask) {
  constexpr const char* op = "torch_tp::column_parallel_linear backward";
  const auto [want_x, want_weight, want_bias] = output_mask;
  const bool sequence_parallel = gather_dim.has_value();
  const int64_t dim = sequence_parallel ? wrap_dim(op, *gather_dim, x.dim(), "gather_dim") : 0;
  const bool gelu = parse_activation(op, activation) == Activation::GeluTanh;
  // Only grad_W and the recomputed pre-activation read x_in.
  at::Tensor x_in;
  if (want_weight || gelu) {
    x_in = sequence_parallel ? all_gather(x, dim, group_name, full_size)
                             : (partial_grad_input ? x : copy_to_tp_region(x, group_name));
  }
  at::Tensor grad_pre = grad_out;
  if (gelu) {
    const at::Tensor pre = at::linear(x_in, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
    grad_pre = at::gelu_backward(grad_out, pre, "tanh");
  }
  const at::Tensor grad2d = rows2d(grad_pre);
  at::Tensor grad_x, grad_weight, grad_bias;
  if (want_x) {
    const at::Tensor grad_x_partial = at::matmul(grad_pre, weight);
    grad_x = partial_grad_input ? grad_x_partial
        : sequence_parallel     ? reduce_scatter(grad_x_partial, dim, "sum", group_name)
                                : reduce_from_tp_region(grad_x_partial, group_name);
  }
  if (want_weight) {
    grad_weight = grad2d.t().mm(rows2d(x_in));
  }
  if (want_bias) {
    grad_bias = grad2d.sum(0);
  }
  return {grad_x, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_parallel_linear_backward_differentiable(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const std::string& group_name,
    std::optional<int64_t> scatter_dim, std::array<bool, 3> output_mask) {
  constexpr const char* op = "torch_tp::row_parallel_linear backward";
  const auto [want_x, want_weight, want_bias] = output_mask;
  const std::optional<int64_t> dim =
      scatter_dim ? std::optional<int64_t>(wrap_dim(op, *scatter_dim, x.dim(), "scatter_dim")) : std::nullopt;
  at::Tensor grad_x, grad_weight, grad_bias;
  if (want_x || want_weight) {
    const at::Tensor grad_in = dim ? all_gather(grad_out, *dim, group_name, x.size(*dim))
                                   : copy_to_tp_region(grad_out, group_name);
    if (want_x) {
      grad_x = at::matmul(grad_in, weight);
    }
    if (want_weight) {
      grad_weight = rows2d(grad_in).t().mm(rows2d(x));
    }
  }
  if (want_bias) {
    const at::Tensor local_sum = rows2d(grad_out).sum(0);
    grad_bias = dim ? reduce_from_tp_region(local_sum, group_name) : local_sum;
  }
  return {grad_x, grad_weight, grad_bias};
}

// ---------------------------------------------------------------- autograd

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<int64_t> optional_int(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<int64_t>(value.toInt());
}

// Which of (grad_x, grad_weight, grad_bias) this backward must compute (NOTE
// [skipped gradients]). The node's edges are its tensor arguments that were
// given, so bias, when there is one, is edge 2.
std::array<bool, 3> linear_output_mask(AutogradContext* ctx) {
  const bool bias_defined = ctx->saved_data["bias_defined"].toBool();
  return {ctx->needs_input_grad(0), ctx->needs_input_grad(1), bias_defined && ctx->needs_input_grad(2)};
}

struct ColumnParallelLinearFunction : public torch::autograd::Function<ColumnParallelLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const std::string& group_name,
                            std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
                            const std::string& activation, bool partial_grad_input) {
    static const auto forward_op =
        find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                   const std::optional<at::Tensor>&, c10::string_view,
                                                   std::optional<int64_t>, std::optional<int64_t>, c10::string_view)>(
            "torch_tp::_column_parallel_linear_forward");
    check_partial_grad_input("torch_tp::column_parallel_linear", partial_grad_input, gather_dim);
    at::Tensor out, pre;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, pre) =
          forward_op.call(x, weight, bias, group_name, gather_dim, full_size, activation);
    }
    // Under sequence parallelism x is the local shard: the backward re-gathers
    // it. bias only for NOTE [double backward].
    ctx->save_for_backward({x, weight, pre, bias.value_or(at::Tensor())});
    ctx->saved_data["bias_defined"] = bias.has_value() && bias->defined();
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["gather_dim"] = gather_dim;
    ctx->saved_data["full_size"] = full_size;
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["partial_grad_input"] = partial_grad_input;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
            std::optional<int64_t>, std::optional<int64_t>, c10::string_view, bool, std::array<bool, 3>)>(
            "torch_tp::_column_parallel_linear_backward");
    if (!grads[0].defined()) {
      return variable_list(8);
    }
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> output_mask = linear_output_mask(ctx);
    variable_list grads_in(8);
    if (at::GradMode::is_enabled()) {  // create_graph: NOTE [double backward]
      std::tie(grads_in[0], grads_in[1], grads_in[2]) = column_parallel_linear_backward_differentiable(
          grads[0], saved[0], saved[1], saved[3], ctx->saved_data["group_name"].toStringRef(),
          optional_int(ctx->saved_data["gather_dim"]), optional_int(ctx->saved_data["full_size"]),
          ctx->saved_data["activation"].toStringRef(), ctx->saved_data["partial_grad_input"].toBool(),
          output_mask);
      return grads_in;
    }
    auto [grad_x, grad_weight, grad_bias] = backward_op.call(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["group_name"].toStringRef(),
        optional_int(ctx->saved_data["gather_dim"]), optional_int(ctx->saved_data["full_size"]),
        ctx->saved_data["activation"].toStringRef(), ctx->saved_data["partial_grad_input"].toBool(), output_mask);
    grads_in[0] = output_mask[0] ? grad_x : at::Tensor();
    grads_in[1] = output_mask[1] ? grad_weight : at::Tensor();
    grads_in[2] = output_mask[2] ? grad_bias : at::Tensor();
    return grads_in;
  }
};

struct RowParallelLinearFunction : public torch::autograd::Function<RowParallelLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const std::string& group_name,
                            std::optional<int64_t> scatter_dim) {
    static const auto forward_op =
        find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                           std::optional<int64_t>)>("torch_tp::row_parallel_linear");
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = forward_op.call(x, weight, bias, group_name, scatter_dim);
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias_defined"] = bias.has_value() && bias->defined();
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["scatter_dim"] = scatter_dim;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, c10::string_view,
                                                               std::optional<int64_t>, std::array<bool, 3>)>(
            "torch_tp::_row_parallel_linear_backward");
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> output_mask = linear_output_mask(ctx);
    if (at::GradMode::is_enabled()) {  // create_graph: NOTE [double backward]
      auto [grad_x, grad_weight, grad_bias] = row_parallel_linear_backward_differentiable(
          grads[0], saved[0], saved[1], ctx->saved_data["group_name"].toStringRef(),
          optional_int(ctx->saved_data["scatter_dim"]), output_mask);
      return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
    }
    auto [grad_x, grad_weight, grad_bias] =
        backward_op.call(grads[0], saved[0], saved[1], ctx->saved_data["group_name"].toStringRef(),
                         optional_int(ctx->saved_data["scatter_dim"]), output_mask);
    return {output_mask[0] ? grad_x : at::Tensor(), output_mask[1] ? grad_weight : at::Tensor(),
            output_mask[2] ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Whether a linear op must record autograd history: any of its tensors needs it.
bool any_needs_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return needs_autograd(x) || needs_autograd(weight) || (bias.has_value() && bias->defined() && needs_autograd(*bias));
}

at::Tensor column_parallel_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                           std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
                                           c10::string_view activation, bool partial_grad_input) {
  // Before apply(), which describes every input and fails on an undefined one without naming it.
  check_defined("torch_tp::column_parallel_linear", "x", x);
  check_defined("torch_tp::column_parallel_linear", "weight", weight);
  if (!any_needs_autograd(x, weight, bias)) {  // NOTE [no gradient, no Function] in collectives_autograd.cpp
    static const auto below = find_op<decltype(column_parallel_linear_autograd)>("torch_tp::column_parallel_linear");
    at::AutoDispatchBelowADInplaceOrView guard;
    return below.call(x, weight, bias, group_name, gather_dim, full_size, activation, partial_grad_input);
  }
  return ColumnParallelLinearFunction::apply(x, weight, bias, std::string(group_name), gather_dim, full_size,
                                             std::string(activation), partial_grad_input);
}

at::Tensor row_parallel_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                        std::optional<int64_t> scatter_dim) {
  check_defined("torch_tp::row_parallel_linear", "x", x);  // before apply(), as above
  check_defined("torch_tp::row_parallel_linear", "weight", weight);
  if (!any_needs_autograd(x, weight, bias)) {  // NOTE [no gradient, no Function] in collectives_autograd.cpp
    static const auto below = find_op<decltype(row_parallel_linear_autograd)>("torch_tp::row_parallel_linear");
    at::AutoDispatchBelowADInplaceOrView guard;
    return below.call(x, weight, bias, group_name, scatter_dim);
  }
  return RowParallelLinearFunction::apply(x, weight, bias, std::string(group_name),
                                          scatter_dim);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  m.impl("column_parallel_linear", column_parallel_linear_kernel<linear_gemm_aten>);
  m.impl("_column_parallel_linear_forward", column_parallel_linear_forward_kernel<linear_gemm_aten>);
  m.impl("_column_parallel_linear_backward", column_parallel_linear_backward_kernel);
  m.impl("row_parallel_linear", row_parallel_linear_kernel<linear_gemm_aten>);
  m.impl("_row_parallel_linear_backward", row_parallel_linear_backward_kernel);
}

// The backward kernels are device-generic (ATen GEMMs); the CUDA forward
// kernels live in linear_cuda.cpp, or, in a build without CUDA sources, use
// ATen's GEMMs too.
TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("_column_parallel_linear_backward", column_parallel_linear_backward_kernel);
  m.impl("_row_parallel_linear_backward", row_parallel_linear_backward_kernel);
#ifndef TORCH_TP_WITH_CUDA
  m.impl("column_parallel_linear", column_parallel_linear_kernel<linear_gemm_aten>);
  m.impl("_column_parallel_linear_forward", column_parallel_linear_forward_kernel<linear_gemm_aten>);
  m.impl("row_parallel_linear", row_parallel_linear_kernel<linear_gemm_aten>);
#endif
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("column_parallel_linear", column_parallel_linear_autograd);
  m.impl("row_parallel_linear", row_parallel_linear_autograd);
  // The pieces are not differentiable themselves (the public ops are, to any
  // order: NOTE [double backward]). Called directly on tensors that require
  // grad, a backward through them raises naming the op instead of silently
  // treating their outputs as constants.
  m.impl("_column_parallel_linear_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_column_parallel_linear_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_row_parallel_linear_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
