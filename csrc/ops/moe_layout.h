#pragma once
// The pieces of NOTE [expert-parallel layout] (moe.cpp) that the slot
// exchanges (moe_slot_exchange.cpp) share with the movements: the checks of
// the count tensors, the counts on the host, and the two movements.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <vector>

namespace torch_tp {

// A 1-D int64 count tensor (tokens_per_expert, dims 1) or the [p, L] recv_counts (dims 2).
void check_counts(const char* op, const char* arg, const at::Tensor& counts, int64_t dims);
// L = E / p, checked.
int64_t local_experts(const char* op, int64_t num_experts, int64_t world_size);
// tokens [N, rest..] and tokens_per_expert [E] of the sender; returns L.
int64_t check_dispatch_args(const char* op, const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                            int64_t world_size);
// recv_counts must be [p, L].
void check_recv_counts(const char* op, const at::Tensor& recv_counts, int64_t world_size, int64_t local);

// Counts on the host, checked non-negative and, where `sum_of` names
// something, to sum to expected_sum.
at::Tensor host_counts(const char* op, const char* arg, const at::Tensor& counts, int64_t expected_sum,
                       const char* sum_of);
// Row sums of a host [a, b] count matrix: the split sizes of its row blocks.
std::vector<int64_t> row_sums(const at::Tensor& counts);

// The count exchange that starts a dispatch: the sender's tokens_per_expert
// [E] -> recv_counts [p, L] (row s: what rank s sends this rank).
at::Tensor exchange_counts(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                           const at::Tensor& tokens_per_expert, int64_t local);
// tokens [N, ..] -> the rows this rank receives, with both counts on the host
// (by_expert: regrouped by local expert, NOTE [token rows by source rank]).
at::Tensor dispatch_rows(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const at::Tensor& tokens, const at::Tensor& tpe_host, const at::Tensor& recv_host,
                         bool by_expert);
// Its inverse: local_out [R, ..] -> the sender's [N, ..].
at::Tensor combine_rows(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                        const at::Tensor& local_out, const at::Tensor& tpe_host, const at::Tensor& recv_host,
                        bool by_expert);

} // namespace torch_tp
