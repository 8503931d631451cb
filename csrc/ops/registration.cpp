// Every torch_tp op schema, and nothing else. Kernels are registered beside
// their code: collectives.cpp (CPU, CUDA), collectives_autograd.cpp (Autograd),
// linear.cpp (CPU, Autograd; CUDA backward), linear_cuda.cpp (CUDA forward),
// autocast.cpp (AutocastCPU, AutocastCUDA: the linear ops),
// embedding.cpp (CompositeImplicitAutograd), norm.cpp (CompositeImplicitAutograd;
// CPU pieces), cross_entropy.cpp (CompositeImplicitAutograd; the pieces for
// every device), moe.cpp, moe_slots.cpp and moe_slot_exchange.cpp (all kernels
// of the expert-parallel ops), moe_experts.cpp (all kernels of moe_gated_experts), meta.cpp (Meta).
//
// `group_name` is what ProcessGroup.group_name returns, the same string torch's
// _c10d_functional ops take; it is resolved through c10d's group registry, so
// the ops run on any process group (gloo, nccl, DeviceMesh groups, torch_tp's
// backend). `reduce_op` is one of "sum", "avg", "min", "max", "product".
//
// NOTE [tensor-parallel region pair]
// Megatron's f and g. A column-parallel layer reads a replicated input; its
// gradient with respect to that input is a partial sum on each rank, so the
// input passes through copy_to_tp_region (f: identity forward, all-reduce
// backward). A row-parallel layer produces partial sums; its output passes
// through reduce_from_tp_region (g: all-reduce forward, identity backward).
// f and g are each other's adjoint.

#include <torch/library.h>

TORCH_LIBRARY(torch_tp, m) {
  m.def("all_reduce(Tensor x, str reduce_op, str group_name) -> Tensor");
  // In place, as torch's _c10d_functional.all_reduce_: x becomes the
  // reduction. It returns nothing, as torch.compile wants of a mutating custom
  // op (it functionalizes the call), and is not differentiable (NOTE [the
  // in-place all-reduce and autograd] in collectives_autograd.cpp).
  m.def("all_reduce_(Tensor(a!) x, str reduce_op, str group_name) -> ()");
  m.def("all_gather(Tensor x, int dim, str group_name, int? full_size=None) -> Tensor");
  m.def("reduce_scatter(Tensor x, int dim, str reduce_op, str group_name) -> Tensor");
  m.def("copy_to_tp_region(Tensor x, str group_name) -> Tensor");
  m.def("reduce_from_tp_region(Tensor x, str group_name) -> Tensor");

  // Sharded layers (linear.cpp, linear_cuda.cpp, embedding.cpp). weight is this
  // rank's shard; a gather/scatter dim turns on sequence parallelism along it;
  // full_size is the gathered length when the shards are uneven (torch.chunk).
  m.def(
      "column_parallel_linear(Tensor x, Tensor weight, Tensor? bias, str group_name, int? gather_dim=None, "
      "int? full_size=None, str activation=\"none\", bool partial_grad_input=False) -> Tensor");
  m.def("row_parallel_linear(Tensor x, Tensor weight, Tensor? bias, str group_name, int? scatter_dim=None) -> Tensor");
  m.def(
      "vocab_parallel_embedding(Tensor ids, Tensor weight, str group_name, int vocab_size, int? padding_idx=None, "
      "int? scatter_dim=None) -> Tensor");
  m.def(
      "column_parallel_embedding(Tensor ids, Tensor weight, str group_name, int? padding_idx=None, "
      "int? gather_dim=None, int? full_size=None) -> Tensor");
  // vocab_parallel_embedding's local lookup and its table gradient (embedding.cpp,
  // NOTE [the vocab shard's lookup]): rows [start, start + weight.size(0)) of a
  // vocab_size table; other ids give zero rows; padding_idx is local (-1: none).
  m.def("_vocab_shard_lookup(Tensor ids, Tensor weight, int start, int vocab_size) -> Tensor");
  m.def("_vocab_shard_lookup_backward(Tensor grad, Tensor ids, int start, int rows, int padding_idx) -> Tensor");

  // The pieces the autograd kernels of the linear ops dispatch to, so that
  // torch.compile traces forward and backward as ops. The forward also returns
  // the pre-activation (empty without an activation) for the backward. The
  // backward computes (grad_x, grad_weight, grad_bias) where output_mask says
  // so, as aten's *_backward ops do, and returns an empty tensor for the rest
  // (NOTE [skipped gradients] in linear.cpp).
  m.def(
      "_column_parallel_linear_forward(Tensor x, Tensor weight, Tensor? bias, str group_name, int? gather_dim, "
      "int? full_size, str activation) -> (Tensor, Tensor)");
  m.def(
      "_column_parallel_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor pre_activation, "
      "str group_name, int? gather_dim, int? full_size, str activation, bool partial_grad_input, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "_row_parallel_linear_backward(Tensor grad_out, Tensor x, Tensor weight, str group_name, int? scatter_dim, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");

  // Cross entropy of logits [.., n] sharded on the class dim (cross_entropy.cpp;
  // loss_parallel runs F.cross_entropy through it): n is this rank's
  // torch.chunk piece of num_classes, target [..] holds global class indices,
  // weight is the whole [num_classes]. One all-gather forward, none backward.
  // Its pieces: the forward also returns the rows' global max and sum of exp
  // and their weights, in opmath, for the backward.
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group_name, int num_classes, "
      "Tensor? weight=None, int ignore_index=-100, str reduction=\"mean\") -> Tensor");
  m.def(
      "_vocab_parallel_cross_entropy_forward(Tensor logits, Tensor target, str group_name, int num_classes, "
      "Tensor? weight, int ignore_index, str reduction) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_vocab_parallel_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor max, "
      "Tensor sum_exp, Tensor row_weight, str group_name, int num_classes, str reduction) -> Tensor");

  // RMSNorm with aten::rms_norm's schema and numbers, fused on the CPU (norm.cpp;
  // SequenceParallel runs nn.RMSNorm through it). Its pieces: the forward also
  // returns rstd [rows] in opmath for the backward, which computes (grad_input,
  // grad_weight) where output_mask says so.
  m.def("rms_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");
  m.def("_rms_norm_forward(Tensor input, int[] normalized_shape, Tensor? weight, float? eps) -> (Tensor, Tensor)");
  m.def(
      "_rms_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor rstd, int[] normalized_shape, "
      "bool[2] output_mask) -> (Tensor, Tensor)");

  // Expert parallelism (moe.cpp, NOTE [expert-parallel layout]). all_to_all_single
  // has _c10d_functional.all_to_all_single's arguments: rows of dim 0, uneven
  // and empty splits; backward swaps the splits. moe_dispatch sends expert-sorted
  // tokens [N, H] (tokens_per_expert [E] int64) to the ranks owning their experts
  // (rank r: experts [r*E/p, (r+1)*E/p)) -> local_tokens [R, H] expert-major
  // (by_expert; else by source rank), local_tokens_per_expert [E/p], recv_counts
  // [p, E/p]; moe_combine is its exact
  // inverse; each is the other's backward. _moe_dispatch_rows is dispatch's
  // movement with the counts known (combine's backward). moe_token_dispatch /
  // moe_token_combine are HF's AllToAllEP: top-k routing [T, K] sorted by expert
  // (order [T*K]: the flat t*K+k of each sorted row), dispatched with the rows
  // left by source rank (local_expert_ids [R] names each one's local expert),
  // combined, and summed per token weighted by top_k_weights; _moe_slot_rows and
  // _moe_slot_sum are the gather that starts and the sum that ends the pair
  // (moe_slots.cpp), _moe_slot_dispatch and _moe_slot_combine each of those
  // with its exchange, as one differentiable op (moe_slot_exchange.cpp);
  // _moe_expert_ids checks the ids.
  m.def("all_to_all_single(Tensor x, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor");
  m.def(
      "moe_dispatch(Tensor tokens, Tensor tokens_per_expert, str group_name, bool by_expert=True) -> (Tensor local_tokens, "
      "Tensor local_tokens_per_expert, Tensor recv_counts)");
  m.def(
      "_moe_dispatch_rows(Tensor tokens, Tensor tokens_per_expert, Tensor recv_counts, str group_name, "
      "bool by_expert=True) -> Tensor");
  m.def(
      "moe_combine(Tensor local_out, Tensor recv_counts, Tensor tokens_per_expert, str group_name, "
      "bool by_expert=True) -> Tensor");
  m.def("_moe_expert_ids(Tensor top_k_index, int num_experts) -> Tensor");
  m.def(
      "moe_token_dispatch(Tensor hidden, Tensor top_k_index, int num_experts, str group_name) -> (Tensor local_tokens, "
      "Tensor local_expert_ids, Tensor order, Tensor tokens_per_expert, Tensor recv_counts)");
  m.def(
      "moe_token_combine(Tensor local_out, Tensor top_k_weights, Tensor order, Tensor tokens_per_expert, "
      "Tensor recv_counts, str group_name) -> Tensor");
  m.def("_moe_slot_rows(Tensor hidden, Tensor order, int top_k) -> Tensor");
  m.def("_moe_slot_sum(Tensor rows, Tensor order, Tensor weights) -> Tensor");
  m.def(
      "_moe_slot_dispatch(Tensor hidden, Tensor order, int top_k, Tensor tokens_per_expert, str group_name) -> "
      "(Tensor local_tokens, Tensor local_tokens_per_expert, Tensor recv_counts)");
  m.def(
      "_moe_slot_dispatch_backward(Tensor grad_local_tokens, Tensor order, SymInt tokens, Tensor tokens_per_expert, "
      "Tensor recv_counts, str group_name) -> Tensor");
  m.def(
      "_moe_slot_combine(Tensor local_out, Tensor top_k_weights, Tensor order, Tensor tokens_per_expert, "
      "Tensor recv_counts, str group_name) -> Tensor");
  m.def(
      "_moe_slot_combine_backward(Tensor grad_out, Tensor local_out, Tensor order, Tensor top_k_weights, "
      "Tensor tokens_per_expert, Tensor recv_counts, str group_name, bool weights_grad) -> "
      "(Tensor grad_local_out, Tensor grad_top_k_weights)");
  // moe_gated_experts (moe_experts.cpp) runs transformers' SiLU-gated experts on
  // rows grouped by expert: rows [N, H] in the row-major (run, expert) blocks of
  // counts [B, L] (moe_token_dispatch's rows with its recv_counts; [L]: one run),
  // gate_up_proj [L, 2I, H] ([gate | up] per expert), down_proj [L, H, I] ->
  // [N, H]; _forward also returns what backward keeps, in expert order:
  // gate_up_out [N, 2I], silu_gate = silu(gate) and gated = silu_gate * up [N, I].
  m.def("moe_gated_experts(Tensor rows, Tensor counts, Tensor gate_up_proj, Tensor down_proj) -> Tensor");
  m.def(
      "_moe_gated_experts_forward(Tensor rows, Tensor counts, Tensor gate_up_proj, Tensor down_proj) -> "
      "(Tensor out, Tensor gate_up_out, Tensor silu_gate, Tensor gated)");
  m.def(
      "_moe_gated_experts_backward(Tensor grad_out, Tensor rows, Tensor counts, Tensor gate_up_proj, "
      "Tensor down_proj, Tensor gate_up_out, Tensor silu_gate, Tensor gated, bool[3] output_mask) -> "
      "(Tensor, Tensor, Tensor)");
}
