// Typed dispatcher entry points behind csrc/include/torch_tp/ops.h. The
// collectives check that x is defined here: with no tensor to dispatch on,
// the dispatcher's own error would not name the op's argument.

#include <torch_tp/ops.h>

#include "ops/common.h"

namespace torch_tp {

at::Tensor all_reduce(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, c10::string_view, c10::string_view)>("torch_tp::all_reduce");
  check_defined("torch_tp::all_reduce", "x", x);
  return op.call(x, reduce_op, group_name);
}

void all_reduce_(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  static const auto op = find_op<void(const at::Tensor&, c10::string_view, c10::string_view)>("torch_tp::all_reduce_");
  check_defined("torch_tp::all_reduce_", "x", x);
  op.call(x, reduce_op, group_name);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                      std::optional<int64_t> full_size) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, int64_t, c10::string_view, std::optional<int64_t>)>(
          "torch_tp::all_gather");
  check_defined("torch_tp::all_gather", "x", x);
  return op.call(x, dim, group_name, full_size);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                          c10::string_view group_name) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, int64_t, c10::string_view, c10::string_view)>(
          "torch_tp::reduce_scatter");
  check_defined("torch_tp::reduce_scatter", "x", x);
  return op.call(x, dim, reduce_op, group_name);
}

at::Tensor copy_to_tp_region(const at::Tensor& x, c10::string_view group_name) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, c10::string_view)>("torch_tp::copy_to_tp_region");
  check_defined("torch_tp::copy_to_tp_region", "x", x);
  return op.call(x, group_name);
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, c10::string_view group_name) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, c10::string_view)>("torch_tp::reduce_from_tp_region");
  check_defined("torch_tp::reduce_from_tp_region", "x", x);
  return op.call(x, group_name);
}

at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                  std::optional<int64_t> gather_dim, std::optional<int64_t> full_size,
                                  c10::string_view activation, bool partial_grad_input) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                         std::optional<int64_t>, std::optional<int64_t>, c10::string_view, bool)>(
          "torch_tp::column_parallel_linear");
  return op.call(x, weight, bias, group_name, gather_dim, full_size, activation, partial_grad_input);
}

at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view group_name, std::optional<int64_t> scatter_dim) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                         std::optional<int64_t>)>("torch_tp::row_parallel_linear");
  return op.call(x, weight, bias, group_name, scatter_dim);
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, c10::string_view group_name,
                                    int64_t vocab_size, std::optional<int64_t> padding_idx,
                                    std::optional<int64_t> scatter_dim) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, std::optional<int64_t>,
                         std::optional<int64_t>)>("torch_tp::vocab_parallel_embedding");
  return op.call(ids, weight, group_name, vocab_size, padding_idx, scatter_dim);
}

at::Tensor column_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, c10::string_view group_name,
                                     std::optional<int64_t> padding_idx, std::optional<int64_t> gather_dim,
                                     std::optional<int64_t> full_size) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, std::optional<int64_t>,
                         std::optional<int64_t>, std::optional<int64_t>)>("torch_tp::column_parallel_embedding");
  return op.call(ids, weight, group_name, padding_idx, gather_dim, full_size);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        c10::string_view group_name, int64_t num_classes,
                                        const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                        c10::string_view reduction) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t,
                         const std::optional<at::Tensor>&, int64_t, c10::string_view)>(
          "torch_tp::vocab_parallel_cross_entropy");
  return op.call(logits, target, group_name, num_classes, weight, ignore_index, reduction);
}

at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                    std::optional<double> eps) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&, std::optional<double>)>(
          "torch_tp::rms_norm");
  check_defined("torch_tp::rms_norm", "input", input);
  return op.call(input, normalized_shape, weight, eps);
}

at::Tensor all_to_all_single(const at::Tensor& x, c10::SymIntArrayRef output_split_sizes,
                             c10::SymIntArrayRef input_split_sizes, c10::string_view group_name) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::string_view)>(
          "torch_tp::all_to_all_single");
  check_defined("torch_tp::all_to_all_single", "x", x);
  return op.call(x, output_split_sizes, input_split_sizes, group_name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& tokens,
                                                            const at::Tensor& tokens_per_expert,
                                                            c10::string_view group_name, bool by_expert) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, c10::string_view, bool)>("torch_tp::moe_dispatch");
  check_defined("torch_tp::moe_dispatch", "tokens", tokens);
  return op.call(tokens, tokens_per_expert, group_name, by_expert);
}

at::Tensor moe_dispatch_rows(const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                             const at::Tensor& recv_counts, c10::string_view group_name, bool by_expert) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, bool)>(
          "torch_tp::_moe_dispatch_rows");
  check_defined("torch_tp::_moe_dispatch_rows", "tokens", tokens);
  return op.call(tokens, tokens_per_expert, recv_counts, group_name, by_expert);
}

at::Tensor moe_combine(const at::Tensor& local_out, const at::Tensor& recv_counts,
                       const at::Tensor& tokens_per_expert, c10::string_view group_name, bool by_expert) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, bool)>(
          "torch_tp::moe_combine");
  check_defined("torch_tp::moe_combine", "local_out", local_out);
  return op.call(local_out, recv_counts, tokens_per_expert, group_name, by_expert);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_token_dispatch(
    const at::Tensor& hidden, const at::Tensor& top_k_index, int64_t num_experts, c10::string_view group_name) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, int64_t, c10::string_view)>("torch_tp::moe_token_dispatch");
  check_defined("torch_tp::moe_token_dispatch", "hidden", hidden);
  return op.call(hidden, top_k_index, num_experts, group_name);
}

at::Tensor moe_token_combine(const at::Tensor& local_out, const at::Tensor& top_k_weights, const at::Tensor& order,
                             const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                             c10::string_view group_name) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, c10::string_view)>(
      "torch_tp::moe_token_combine");
  check_defined("torch_tp::moe_token_combine", "local_out", local_out);
  return op.call(local_out, top_k_weights, order, tokens_per_expert, recv_counts, group_name);
}

at::Tensor moe_gated_experts(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
                             const at::Tensor& down_proj) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&)>("torch_tp::moe_gated_experts");
  check_defined("torch_tp::moe_gated_experts", "rows", rows);
  return op.call(rows, counts, gate_up_proj, down_proj);
}

} // namespace torch_tp
