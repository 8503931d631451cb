// Meta kernels: output shapes only, for torch.compile (FakeTensor) and
// torch.library.opcheck. They run the same argument checks as the device
// kernels so that a bad call fails at trace time with the same message, and
// they work on symbolic sizes. Outputs are contiguous, as the device kernels'.

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/cross_entropy.h"
#include "ops/linear.h"
#include "ops/norm.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <array>

namespace torch_tp {
namespace {

at::Tensor all_reduce_meta(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  check_collective_args("torch_tp::all_reduce", x, group_name, reduce_op, std::nullopt, /*allow_bool=*/false);
  return at::empty_symint(x.sym_sizes(), x.options());
}

void all_reduce_inplace_meta(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  check_collective_args("torch_tp::all_reduce_", x, group_name, reduce_op, std::nullopt, /*allow_bool=*/false);
}

at::Tensor all_gather_meta(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                           std::optional<int64_t> full_size) {
  constexpr const char* op = "torch_tp::all_gather";
  const auto args = check_collective_args(op, x, group_name, std::nullopt, dim, /*allow_bool=*/true);
  auto sizes = x.sym_sizes().vec();
  sizes[args.dim] =
      gathered_size(op, sizes[args.dim], args.dim, full_size, args.group->getSize(), args.group->getRank());
  return at::empty_symint(sizes, x.options());
}

at::Tensor reduce_scatter_meta(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                               c10::string_view group_name) {
  const auto args =
      check_collective_args("torch_tp::reduce_scatter", x, group_name, reduce_op, dim, /*allow_bool=*/false);
  auto sizes = x.sym_sizes().vec();
  sizes[args.dim] = chunk_range(sizes[args.dim], args.group->getSize(), args.group->getRank()).length;
  return at::empty_symint(sizes, x.options());
}

// Both region ops keep the shape of x.
at::Tensor tp_region_meta(const char* op, const at::Tensor& x, c10::string_view group_name) {
  check_collective_args(op, x, group_name, std::nullopt, std::nullopt, /*allow_bool=*/false);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor copy_to_tp_region_meta(const at::Tensor& x, c10::string_view group_name) {
  return tp_region_meta("torch_tp::copy_to_tp_region", x, group_name);
}

at::Tensor reduce_from_tp_region_meta(const at::Tensor& x, c10::string_view group_name) {
  return tp_region_meta("torch_tp::reduce_from_tp_region", x, group_name);
}

// x [.., K] -> [.., N] with `dim` gathered (column) or scattered (row).
std::vector<c10::SymInt> linear_out_sizes(const at::Tensor& x, const at::Tensor& weight) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return sizes;
}

std::tuple<at::Tensor, at::Tensor> column_parallel_linear_forward_meta(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, c10::string_view group_name,
    std::optional<int64_t> gather_dim, std::optional<int64_t> full_size, c10::string_view activation) {
  constexpr const char* op = "torch_tp::column_parallel_linear";
  const auto dim = check_linear_args(op, x, weight, bias, gather_dim, "gather_dim");
  const Activation act = parse_activation(op, activation);
  const auto group = resolve_group(op, group_name);
  auto sizes = linear_out_sizes(x, weight);
  if (dim) {
    sizes[*dim] = gathered_size(op, sizes[*dim], *dim, full_size, group->getSize(), group->getRank());
  }
  at::Tensor out = at::empty_symint(sizes, x.options());
  at::Tensor pre = act == Activation::None ? at::empty({0}, x.options()) : at::empty_symint(sizes, x.options());
  return {out, pre};
}

at::Tensor row_parallel_linear_meta(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                    std::optional<int64_t> scatter_dim) {
  constexpr const char* op = "torch_tp::row_parallel_linear";
  const auto dim = check_linear_args(op, x, weight, bias, scatter_dim, "scatter_dim");
  const auto group = resolve_group(op, group_name);
  auto sizes = linear_out_sizes(x, weight);
  if (dim) {
    sizes[*dim] = chunk_range(sizes[*dim], group->getSize(), group->getRank()).length;
  }
  return at::empty_symint(sizes, x.options());
}

// Gradients have the shapes of what they are gradients of; the ones
// output_mask leaves out are empty (NOTE [skipped gradients] in linear.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_grads_meta(const at::Tensor& grad_out, const at::Tensor& x,
                                                                 const at::Tensor& weight,
                                                                 std::array<bool, 3> output_mask) {
  const auto [want_x, want_weight, want_bias] = output_mask;
  return {want_x ? at::empty_symint(x.sym_sizes(), x.options()) : skipped_gradient(grad_out),
          want_weight ? at::empty_symint(weight.sym_sizes(), weight.options()) : skipped_gradient(grad_out),
          want_bias ? at::empty_symint({weight.sym_size(0)}, grad_out.options()) : skipped_gradient(grad_out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& /*pre_activation*/,
    c10::string_view /*group_name*/, std::optional<int64_t> /*gather_dim*/, std::optional<int64_t> /*full_size*/,
    c10::string_view /*activation*/, bool /*partial_grad_input*/, std::array<bool, 3> output_mask) {
  return linear_grads_meta(grad_out, x, weight, output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_parallel_linear_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, c10::string_view /*group_name*/,
    std::optional<int64_t> /*scatter_dim*/, std::array<bool, 3> output_mask) {
  return linear_grads_meta(grad_out, x, weight, output_mask);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_meta(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight,
                                                         std::optional<double> /*eps*/) {
  const int64_t n = check_rms_norm_args("torch_tp::rms_norm", input, normalized_shape, weight.value_or(at::Tensor()),
                                        /*fused_kernels=*/true);
  const c10::SymInt rows = n == 0 ? c10::SymInt(0) : input.sym_numel() / n;
  return {at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint({rows}, input.options().dtype(at::toOpMathType(input.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_out, const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& /*rstd*/, at::IntArrayRef normalized_shape,
                                                          std::array<bool, 2> output_mask) {
  const at::Tensor w = weight.value_or(at::Tensor());
  check_rms_norm_args("torch_tp::rms_norm backward", input, normalized_shape, w, /*fused_kernels=*/true);
  const bool want_weight = output_mask[1] && w.defined();
  return {output_mask[0] ? at::empty_symint(input.sym_sizes(), input.options()) : at::empty({0}, grad_out.options()),
          want_weight ? at::empty_symint(w.sym_sizes(), w.options()) : at::empty({0}, grad_out.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_meta(
    const at::Tensor& logits, const at::Tensor& target, c10::string_view group_name, int64_t num_classes,
    const std::optional<at::Tensor>& weight, int64_t /*ignore_index*/, c10::string_view reduction) {
  const auto args = check_cross_entropy_args("torch_tp::vocab_parallel_cross_entropy", logits, target, group_name,
                                             num_classes, weight, reduction);
  const auto per_row = target.options().dtype(at::toOpMathType(logits.scalar_type()));
  const auto loss_sizes = args.reduction == LossReduction::None ? target.sym_sizes() : c10::SymIntArrayRef();
  return {at::empty_symint(loss_sizes, logits.options()), at::empty_symint({target.sym_numel()}, per_row),
          at::empty_symint({target.sym_numel()}, per_row), at::empty_symint({target.sym_numel()}, per_row)};
}

at::Tensor cross_entropy_backward_meta(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                       const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& row_weight,
                                       c10::string_view group_name, int64_t num_classes, c10::string_view reduction) {
  constexpr const char* op = "torch_tp::vocab_parallel_cross_entropy backward";
  const auto args = check_cross_entropy_args(op, logits, target, group_name, num_classes, std::nullopt, reduction);
  check_cross_entropy_backward_args(op, grad_loss, logits, target, max, sum_exp, row_weight, args.reduction);
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

at::Tensor vocab_shard_lookup_meta(const at::Tensor& ids, const at::Tensor& weight, int64_t /*start*/,
                                   int64_t /*vocab_size*/) {
  auto sizes = ids.sym_sizes().vec();
  sizes.push_back(weight.sym_size(1));
  return at::empty_symint(sizes, weight.options());
}

at::Tensor vocab_shard_lookup_backward_meta(const at::Tensor& grad, const at::Tensor& /*ids*/, int64_t /*start*/,
                                            int64_t rows, int64_t /*padding_idx*/) {
  return at::empty_symint({c10::SymInt(rows), grad.sym_size(-1)}, grad.options());
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, Meta, m) {
  m.impl("all_reduce", all_reduce_meta);
  m.impl("all_reduce_", all_reduce_inplace_meta);
  m.impl("all_gather", all_gather_meta);
  m.impl("reduce_scatter", reduce_scatter_meta);
  m.impl("copy_to_tp_region", copy_to_tp_region_meta);
  m.impl("reduce_from_tp_region", reduce_from_tp_region_meta);
  m.impl("column_parallel_linear", column_parallel_linear_from_forward<column_parallel_linear_forward_meta>);
  m.impl("_column_parallel_linear_forward", column_parallel_linear_forward_meta);
  m.impl("_column_parallel_linear_backward", column_parallel_linear_backward_meta);
  m.impl("row_parallel_linear", row_parallel_linear_meta);
  m.impl("_row_parallel_linear_backward", row_parallel_linear_backward_meta);
  m.impl("_rms_norm_forward", rms_norm_forward_meta);
  m.impl("_rms_norm_backward", rms_norm_backward_meta);
  m.impl("_vocab_parallel_cross_entropy_forward", cross_entropy_forward_meta);
  m.impl("_vocab_parallel_cross_entropy_backward", cross_entropy_backward_meta);
  m.impl("_vocab_shard_lookup", vocab_shard_lookup_meta);
  m.impl("_vocab_shard_lookup_backward", vocab_shard_lookup_backward_meta);
}

} // namespace torch_tp
