#pragma once
// What the kernels of torch_tp::vocab_parallel_cross_entropy's pieces and
// their Meta kernels share (cross_entropy.cpp, meta.cpp).

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>

namespace torch_tp {

// F.cross_entropy's `reduction`.
enum class LossReduction { None, Mean, Sum };

struct CrossEntropyArgs {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t class_start = 0;  // the first of num_classes this rank holds
  LossReduction reduction = LossReduction::Mean;
};

// Checks the forward's arguments, naming `op`: logits [.., n] floating point,
// n this rank's torch.chunk piece of num_classes (NOTE [torch.chunk shards]);
// target [..] int64 on logits' device; weight, if given, [num_classes]
// floating point on that device; reduction one of "none", "mean", "sum";
// group_name a registered group. Works on symbolic sizes.
CrossEntropyArgs check_cross_entropy_args(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                          c10::string_view group_name, int64_t num_classes,
                                          const std::optional<at::Tensor>& weight, c10::string_view reduction);

// Checks the backward's further arguments: grad_loss shaped like the loss
// (target's shape for "none", 0-d otherwise); max, sum_exp and row_weight
// holding one value per row (target.numel()) in logits' math type.
void check_cross_entropy_backward_args(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& max, const at::Tensor& sum_exp,
                                       const at::Tensor& row_weight, LossReduction reduction);

} // namespace torch_tp
