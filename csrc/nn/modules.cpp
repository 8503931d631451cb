// The tensor-parallel torch::nn modules of <torch_tp/nn.h>: each keeps its
// torch.chunk piece of the full layer's weights and calls the torch_tp op.

#include <torch_tp/nn.h>
#include <torch_tp/ops.h>

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/linear.h"

#include <utility>

namespace torch_tp::nn {

at::Tensor shard(const at::Tensor& full, int64_t dim, const std::string& group_name) {
  const auto group = resolve_group("torch_tp::nn::shard", group_name);
  TORCH_CHECK(full.dim() > 0, "torch_tp::nn::shard: full is a 0-dim tensor; there is no dim ", dim, " to shard");
  const int64_t d = at::maybe_wrap_dim(dim, full.dim());
  const auto piece = chunk_range(full.size(d), group->getSize(), group->getRank());
  return full.narrow(d, piece.start, piece.length).clone(at::MemoryFormat::Contiguous);
}

namespace {

// A shard of a full parameter, registered under `name`; it needs a gradient
// when the full one does.
at::Tensor register_shard(torch::nn::Module& module, const std::string& name, const at::Tensor& full, int64_t dim,
                          const std::string& group_name) {
  at::Tensor piece = shard(full.detach(), dim, group_name);
  return module.register_parameter(name, std::move(piece), full.requires_grad());
}

std::optional<at::Tensor> optional_bias(const at::Tensor& bias) {
  return bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
}

// "torch_tp::nn::<name>(<sizes>, group=<group>[, <dim_name>=<dim>])"
void print_module(std::ostream& stream, const char* name, const std::string& sizes, const std::string& group_name,
                  const char* dim_name, std::optional<int64_t> dim) {
  stream << "torch_tp::nn::" << name << "(" << sizes << ", group=" << group_name;
  if (dim) {
    stream << ", " << dim_name << "=" << *dim;
  }
  stream << ")";
}

} // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full, std::string group_name,
                                                   std::optional<int64_t> gather_dim, std::string activation)
    : group_name_(std::move(group_name)), gather_dim_(gather_dim), activation_(std::move(activation)) {
  parse_activation("torch_tp::nn::ColumnParallelLinear", activation_);  // refused here, not at the first forward
  weight = register_shard(*this, "weight", full->weight, 0, group_name_);
  if (full->bias.defined()) {
    bias = register_shard(*this, "bias", full->bias, 0, group_name_);
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x, std::optional<int64_t> full_size) {
  return column_parallel_linear(x, weight, optional_bias(bias), group_name_, gather_dim_, full_size, activation_);
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  const std::string activation = activation_ == "none" ? "" : ", activation=" + activation_;
  print_module(stream, "ColumnParallelLinear",
               c10::str("weight=", weight.sizes(), ", bias=", bias.defined(), activation), group_name_, "gather_dim",
               gather_dim_);
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full, std::string group_name,
                                             std::optional<int64_t> scatter_dim)
    : group_name_(std::move(group_name)), scatter_dim_(scatter_dim) {
  weight = register_shard(*this, "weight", full->weight, 1, group_name_);
  if (full->bias.defined()) {
    bias = register_parameter("bias", full->bias.detach().clone(), full->bias.requires_grad());
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  return row_parallel_linear(x, weight, optional_bias(bias), group_name_, scatter_dim_);
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  print_module(stream, "RowParallelLinear", c10::str("weight=", weight.sizes(), ", bias=", bias.defined()),
               group_name_, "scatter_dim", scatter_dim_);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::string group_name,
                                                       std::optional<int64_t> scatter_dim)
    : group_name_(std::move(group_name)),
      vocab_size_(full->weight.size(0)),
      padding_idx_(full->options.padding_idx()),
      scatter_dim_(scatter_dim) {
  TORCH_CHECK(!full->options.max_norm(), "torch_tp::nn::VocabParallelEmbedding: max_norm=",
              *full->options.max_norm(), " is not supported: renormalising a looked-up row needs the whole row's "
              "owner, and each rank holds only its vocabulary rows");
  TORCH_CHECK(!full->options.sparse(), "torch_tp::nn::VocabParallelEmbedding: sparse=true is not supported");
  TORCH_CHECK(!full->options.scale_grad_by_freq(),
              "torch_tp::nn::VocabParallelEmbedding: scale_grad_by_freq=true is not supported");
  weight = register_shard(*this, "weight", full->weight, 0, group_name_);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return vocab_parallel_embedding(ids, weight, group_name_, vocab_size_, padding_idx_, scatter_dim_);
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  print_module(stream, "VocabParallelEmbedding", c10::str("vocab_size=", vocab_size_, ", weight=", weight.sizes()),
               group_name_, "scatter_dim", scatter_dim_);
}

} // namespace torch_tp::nn
