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

} // namespace torch_tp
