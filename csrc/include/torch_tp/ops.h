#pragma once
// The C++ face of the torch_tp ops. Each function calls the op through the
// dispatcher, exactly as torch.ops.torch_tp.<op> does from Python, so autograd,
// CPU/CUDA and Meta kernels all apply. `group_name` is a name registered in
// c10d's group registry (ProcessGroup::getGroupName()).

#include <ATen/core/Tensor.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace torch_tp {

// Reduces x over the group: every rank gets the same reduced tensor.
// reduce_op: "sum", "avg", "min", "max", "product".
at::Tensor all_reduce(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name);

// The same in place: x becomes the reduction. Not differentiable: refuses an
// x that requires grad.
void all_reduce_(const at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name);

// Concatenates the ranks' x along `dim`, in rank order. Without full_size
// every rank's x has the same shape: x [.., n, ..] -> [.., world_size * n, ..].
// With it, the ranks hold the torch.chunk pieces of full_size rows (uneven
// shards, DTensor's Shard(dim)): x [.., s_rank, ..] -> [.., full_size, ..].
at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group_name,
                      std::optional<int64_t> full_size = std::nullopt);

// Reduces x over the group and keeps this rank's torch.chunk piece along `dim`:
// x [.., n, ..] -> [.., s_rank, ..], s_rank = the size of torch.chunk(n, p)[rank]
// (0 for ranks past the last piece).
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, c10::string_view reduce_op,
                          c10::string_view group_name);

// Megatron's f: identity forward, sum all-reduce of the gradient backward.
at::Tensor copy_to_tp_region(const at::Tensor& x, c10::string_view group_name);

// Megatron's g: sum all-reduce forward, identity backward.
at::Tensor reduce_from_tp_region(const at::Tensor& x, c10::string_view group_name);

// Column-parallel linear: weight is this rank's row shard [N/p, K], bias [N/p].
// x [.., K] is replicated, or with gather_dim a shard along that dim, gathered
// first (sequence parallelism; full_size for uneven shards). Returns
// activation(x @ weight^T + bias) [.., N/p]; activation "none" or "gelu_tanh".
// Backward all-reduces (or reduce-scatters) grad_x, overlapped with grad_weight;
// with partial_grad_input it leaves grad_x as this rank's partial sum instead,
// for a caller that reduces it later (a DTensor input whose gradient is Partial).
at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                  std::optional<int64_t> gather_dim = std::nullopt,
                                  std::optional<int64_t> full_size = std::nullopt,
                                  c10::string_view activation = "none", bool partial_grad_input = false);

// Row-parallel linear: weight is this rank's column shard [N, K/p], x [.., K/p].
// Returns sum_r(x_r @ weight_r^T) + bias [.., N], all-reduced, or with
// scatter_dim reduce-scattered along it (sequence parallelism). bias [N] is
// added once, after the reduction.
at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view group_name, std::optional<int64_t> scatter_dim = std::nullopt);

// Vocab-parallel embedding: weight is this rank's torch.chunk piece of the
// vocab_size rows. ids [..] -> [.., D], all-reduced, or reduce-scattered along scatter_dim.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, c10::string_view group_name,
                                    int64_t vocab_size, std::optional<int64_t> padding_idx = std::nullopt,
                                    std::optional<int64_t> scatter_dim = std::nullopt);

// Embedding-dim-parallel embedding: weight [V, D/p]; ids [..] (all-gathered
// along gather_dim first, if given) -> [.., D/p]. No communication for the table.
at::Tensor column_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, c10::string_view group_name,
                                     std::optional<int64_t> padding_idx = std::nullopt,
                                     std::optional<int64_t> gather_dim = std::nullopt,
                                     std::optional<int64_t> full_size = std::nullopt);

// Cross entropy of logits sharded on the class dim (F.cross_entropy's numbers):
// logits [.., n] holds this rank's torch.chunk piece of the num_classes
// classes along its last dim, target [..] (int64) the global class indices on
// every rank, weight the whole [num_classes]. Returns the loss on every rank
// in logits' dtype: 0-d for reduction "mean" (over the rows' weights) or
// "sum", [..] for "none". One all-gather forward, no communication backward;
// float32 and bfloat16 on the CPU in fused passes over the shard.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        c10::string_view group_name, int64_t num_classes,
                                        const std::optional<at::Tensor>& weight = std::nullopt,
                                        int64_t ignore_index = -100, c10::string_view reduction = "mean");

// RMSNorm with aten::rms_norm's arguments and numbers: input [.., *normalized_shape]
// -> the same shape, x / sqrt(mean(x^2) + eps) * weight over the trailing
// normalized_shape (eps unset: the epsilon of the math dtype, as torch). On the
// CPU one fused pass (float32, float64, bfloat16; weight of input's dtype);
// anything else is at::rms_norm itself.
at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                    const std::optional<at::Tensor>& weight = std::nullopt, std::optional<double> eps = std::nullopt);

// Expert parallelism (NOTE [expert-parallel layout] in csrc/ops/moe.cpp).
// Rows of dim 0 exchanged unevenly, as torch's _c10d_functional.all_to_all_single:
// x [sum(input_split_sizes), ..] -> [sum(output_split_sizes), ..]; backward
// is the reverse exchange.
at::Tensor all_to_all_single(const at::Tensor& x, c10::SymIntArrayRef output_split_sizes,
                             c10::SymIntArrayRef input_split_sizes, c10::string_view group_name);

// tokens [N, ..] sorted by global expert, tokens_per_expert [E] int64 (sum N),
// rank r owning experts [r*E/p, (r+1)*E/p) -> (local_tokens [R, ..] grouped by
// local expert, then source rank (by_expert; else by source rank, then local
// expert); local_tokens_per_expert [E/p]; recv_counts [p, E/p]: rows from each
// source for each local expert).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& tokens,
                                                            const at::Tensor& tokens_per_expert,
                                                            c10::string_view group_name, bool by_expert = true);

// moe_dispatch's movement with recv_counts already known (no count exchange).
at::Tensor moe_dispatch_rows(const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                             const at::Tensor& recv_counts, c10::string_view group_name, bool by_expert = true);

// The inverse of moe_dispatch (the same by_expert): local_out [R, ..] in its
// output order -> the sender's [N, ..] in its sorted order.
at::Tensor moe_combine(const at::Tensor& local_out, const at::Tensor& recv_counts,
                       const at::Tensor& tokens_per_expert, c10::string_view group_name, bool by_expert = true);

// HF's AllToAllEP: hidden [T, H], top_k_index [T, K] -> the T*K (token, slot)
// rows sorted by expert and dispatched -> (local_tokens [R, H] by source rank,
// each source's run by local expert (moe_dispatch's by_expert=false);
// local_expert_ids [R]; order [T*K]: the flat t*K+k of each sorted row;
// tokens_per_expert [E]; recv_counts [p, E/p]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_token_dispatch(
    const at::Tensor& hidden, const at::Tensor& top_k_index, int64_t num_experts, c10::string_view group_name);

// local_out [R, H'] in local_tokens' order back to the senders, then each token's
// K rows summed weighted by top_k_weights [T, K] -> [T, H'].
at::Tensor moe_token_combine(const at::Tensor& local_out, const at::Tensor& top_k_weights, const at::Tensor& order,
                             const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                             c10::string_view group_name);

// transformers' SiLU-gated experts on rows grouped by expert: rows [N, H] in
// the row-major (run b, expert e) blocks of counts [B, L] int64 (or [L]) ->
// [N, H], row of expert e: down_proj[e] (silu(gate_e x) * up_e x), [gate_e |
// up_e] = gate_up_proj[e] [2I, H]; down_proj [L, H, I].
at::Tensor moe_gated_experts(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
                             const at::Tensor& down_proj);

} // namespace torch_tp
