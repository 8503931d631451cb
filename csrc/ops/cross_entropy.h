#pragma once
// What the kernels of torch_tp::vocab_parallel_cross_entropy's pieces and
// their Meta kernels share (cross_entropy.cpp, meta.cpp).

#include "ops/cpu_isa.h"

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

// The fused CPU loops run with a given instruction-set variant (NOTE
// [instruction-set variants of the row loops] in cpu_isa.h), for tests that
// hold every one this CPU runs to the same results; the op runs the widest.
// Each row's (m_r, S_r, x_t or 0) of logits [rows, n] (contiguous CPU float32
// or bfloat16; target [rows] int64): [3, rows] float32 (NOTE [vocab-parallel
// cross entropy]); x_t is 0 where the target class is outside [class_start,
// class_start + n).
at::Tensor cross_entropy_local_statistics_with(CpuIsa isa, const at::Tensor& logits,
                                               const at::Tensor& target, int64_t class_start);

// The logits' gradient [rows, n] in their dtype: exp(x - max) * scale /
// sum_exp, less scale at the target class (max, sum_exp, scale: [rows] float32).
at::Tensor cross_entropy_logits_grad_with(CpuIsa isa, const at::Tensor& logits, const at::Tensor& target,
                                          const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& scale,
                                          int64_t class_start);

} // namespace torch_tp
