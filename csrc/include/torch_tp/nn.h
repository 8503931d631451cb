#pragma once
// Tensor-parallel torch::nn modules for LibTorch programs: Megatron's
// column- and row-parallel linear layers and the vocab-parallel embedding.
//
// Each is built from the full (unsharded) torch::nn module, identical on every
// rank, and keeps only this rank's torch.chunk piece of its weights: the piece
// torch_tp.parallelize_module (and torch's DTensor Shard(dim)) gives the same
// rank, so uneven sizes work and checkpoints line up with Python. The forwards
// run the torch_tp ops (<torch_tp/ops.h>) on the group registered under
// group_name (torch_tp::new_group, or any c10d group in the registry), and
// every gradient they produce is the complete one for this rank's shard.
//
//   torch::nn::Linear up(1024, 4096), down(4096, 1024);             // same values on every rank
//   torch_tp::nn::ColumnParallelLinear up_tp(up, "tp", std::nullopt, "gelu_tanh");  // weight [4096/p, 1024]
//   torch_tp::nn::RowParallelLinear down_tp(down, "tp");            // weight [1024, 4096/p]
//   at::Tensor y = down_tp(up_tp(x));                               // == down(gelu(up(x), "tanh"))

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace torch_tp::nn {

// This rank's torch.chunk piece of `full` along `dim` (a copy; an empty piece
// for ranks past the last one), in the group registered under group_name.
at::Tensor shard(const at::Tensor& full, int64_t dim, const std::string& group_name);

// Column-parallel linear: keeps rows of full.weight [N, K] -> [N_rank, K] and
// of its bias. forward(x [.., K] replicated) -> [.., N_rank]. With gather_dim,
// x is this rank's piece of the sequence along that dim, all-gathered first
// (sequence parallelism; pass full_size when the pieces are uneven).
// activation "gelu_tanh" applies GELU's tanh approximation (torch::gelu(y,
// "tanh")) inside the op: on CUDA in the GEMM's epilogue, and the backward
// takes its gradient from the saved pre-activation. "none" (the default) is
// the plain layer.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(const torch::nn::Linear& full, std::string group_name,
                           std::optional<int64_t> gather_dim = std::nullopt, std::string activation = "none");
  at::Tensor forward(const at::Tensor& x, std::optional<int64_t> full_size = std::nullopt);
  void pretty_print(std::ostream& stream) const override;

  at::Tensor weight;
  at::Tensor bias;  // undefined when the full layer has none

 private:
  std::string group_name_;
  std::optional<int64_t> gather_dim_;
  std::string activation_;
};
TORCH_MODULE(ColumnParallelLinear);

// Row-parallel linear: keeps columns of full.weight [N, K] -> [N, K_rank] and
// the whole bias, added once after the reduction. forward(x [.., K_rank], the
// column-parallel layer's output) -> [.., N], all-reduced, or with scatter_dim
// reduce-scattered into this rank's piece along it (sequence parallelism).
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(const torch::nn::Linear& full, std::string group_name,
                        std::optional<int64_t> scatter_dim = std::nullopt);
  at::Tensor forward(const at::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  at::Tensor weight;
  at::Tensor bias;

 private:
  std::string group_name_;
  std::optional<int64_t> scatter_dim_;
};
TORCH_MODULE(RowParallelLinear);

// Vocab-parallel embedding: keeps rows of full.weight [V, D] -> [V_rank, D].
// forward(ids [..] replicated) -> [.., D]: each rank looks up the ids in its
// rows, then the ranks sum (all-reduce), or with scatter_dim reduce-scatter
// into this rank's piece along it. padding_idx is the full layer's; max_norm
// is refused (it would renormalise rows other ranks hold).
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::string group_name,
                             std::optional<int64_t> scatter_dim = std::nullopt);
  at::Tensor forward(const at::Tensor& ids);
  void pretty_print(std::ostream& stream) const override;

  at::Tensor weight;

 private:
  std::string group_name_;
  int64_t vocab_size_;
  std::optional<int64_t> padding_idx_;
  std::optional<int64_t> scatter_dim_;
};
TORCH_MODULE(VocabParallelEmbedding);

} // namespace torch_tp::nn
