// Sharded embeddings, written as compositions of ATen ops and the torch_tp
// collectives (CompositeImplicitAutograd): their gradients, Meta shapes and
// torch.compile decompositions come from the pieces, so there is no backward
// to hand-write and no communication to overlap.
//
// vocab_parallel_embedding: rows (the vocabulary) sharded, rank r holding
// torch.chunk piece r of vocab_size rows, [start, start + rows):
//   ids [..] (replicated) -> local = ids - start, masked where out of range
//   -> embedding(W_r, local) [.., D] with masked rows zeroed
//   -> reduce_from_tp_region (sum forward, identity backward)  [.., D]
//      or reduce_scatter along scatter_dim (sequence parallel) [.., s/p, .., D]
// Exactly one rank owns each id, so the sum is the unsharded lookup.
//
// column_parallel_embedding: columns (the embedding dim) sharded, W_r [V, D/p]:
//   ids [..] (all-gathered along gather_dim first, if given) -> [.., D/p].
//   No communication forward or backward for the table.
//
// padding_idx is a global id, as in nn.Embedding (negative counts from the
// end): its row gets no gradient; the rank that owns it passes it on as a
// local index.

#include <torch_tp/ops.h>

#include "ops/comm.h"
#include "ops/common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_tp {
namespace {

void check_embedding_args(const char* op, const at::Tensor& ids, const at::Tensor& weight) {
  check_defined(op, "ids", ids);
  check_defined(op, "weight", weight);
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op, ": ids has dtype ",
              ids.scalar_type(), "; expected int64 or int32");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [rows, embedding_dim], got shape ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), op, ": weight has dtype ", weight.scalar_type(),
              "; expected a floating-point dtype");
  TORCH_CHECK(ids.device() == weight.device(), op, ": ids is on ", ids.device(), " but weight is on ",
              weight.device());
}

// NOTE [ids out of range]
// F.embedding raises for an id outside [0, num_embeddings); so must these
// ops, on every rank, before any collective (every rank sees the same ids:
// replicated, or all-gathered first). vocab_parallel_embedding masks the ids
// other ranks own, so an id no rank owns would otherwise come back as a zero
// row. The check is at::_assert_async on whether all ids are in range: on
// CUDA a device-side assert, as ATen's index kernels do, with no host sync;
// on the CPU it raises at once, and we re-raise an IndexError (as
// F.embedding's) naming the op and the first offending id. Under Meta and
// fake tensors (torch.compile) it is a no-op, as ATen's own.
void check_ids_in_range(const char* op, const at::Tensor& ids, int64_t num_embeddings, const char* what) {
  const std::string message =
      c10::str(op, ": ids must lie in [0, ", num_embeddings, ") (", what, "); an id outside it was given");
  try {
    at::_assert_async(((ids >= 0) & (ids < num_embeddings)).all(), message);
  } catch (const c10::Error&) {
    // Only real CPU data gets here, so reading it is fine.
    const at::Tensor bad = ids.masked_select((ids < 0) | (ids >= num_embeddings));
    TORCH_CHECK_INDEX(false, op, ": ids contains ", bad.numel() > 0 ? bad[0].item<int64_t>() : -1,
                      ", outside [0, ", num_embeddings, ") (", what, ")");
  }
}

// nn.Embedding's rule: -num_embeddings <= padding_idx < num_embeddings, negative counts from the end.
std::optional<int64_t> wrap_padding_idx(const char* op, std::optional<int64_t> padding_idx, int64_t num_embeddings) {
  if (!padding_idx) {
    return std::nullopt;
  }
  TORCH_CHECK(*padding_idx >= -num_embeddings && *padding_idx < num_embeddings, op, ": padding_idx=", *padding_idx,
              " is out of range for ", num_embeddings, " embeddings");
  return *padding_idx < 0 ? *padding_idx + num_embeddings : *padding_idx;
}

at::Tensor vocab_parallel_embedding_composite(const at::Tensor& ids, const at::Tensor& weight,
                                              c10::string_view group_name, int64_t vocab_size,
                                              std::optional<int64_t> padding_idx,
                                              std::optional<int64_t> scatter_dim) {
  constexpr const char* op = "torch_tp::vocab_parallel_embedding";
  check_embedding_args(op, ids, weight);
  TORCH_CHECK(vocab_size >= 0, op, ": vocab_size=", vocab_size, " must be >= 0");
  const auto group = resolve_group(op, group_name);
  const int64_t rank = group->getRank();
  const auto rows = chunk_range(vocab_size, group->getSize(), rank);
  TORCH_CHECK(weight.size(0) == rows.length, op, ": weight.size(0)=", weight.size(0), " but rank ", rank,
              "'s torch.chunk piece of vocab_size=", vocab_size, " over ", group->getSize(), " ranks has ",
              rows.length, " rows");
  const auto padding = wrap_padding_idx(op, padding_idx, vocab_size);
  check_ids_in_range(op, ids, vocab_size, "vocab_size");
  const bool scatter = scatter_dim.has_value();
  const int64_t dim = scatter ? wrap_dim(op, *scatter_dim, ids.dim() + 1, "scatter_dim", "the output") : 0;
  TORCH_CHECK(!scatter || dim != ids.dim(), op, ": scatter_dim=", *scatter_dim,
              " is the embedding dimension; it must name a dimension of ids");
  if (cross_rank_checks_enabled()) {
    check_same_across_ranks(op, group, ids, std::nullopt, scatter ? std::optional<int64_t>(dim) : std::nullopt,
                            std::nullopt, "scatter_dim");
  }

  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(weight.size(1));
  at::Tensor partial;
  if (rows.length == 0) {
    // This rank owns no rows (uneven split). The zeros still hang off the
    // (empty) table, so that every rank's autograd graph holds the same
    // collectives and the backward ones are not skipped here while peers wait.
    partial = at::zeros(out_sizes, weight.options()) + weight.sum();
  } else {
    const at::Tensor owned = (ids >= rows.start) & (ids < rows.start + rows.length);
    const at::Tensor local = (ids - rows.start).masked_fill(owned.logical_not(), 0);
    const bool owns_padding = padding && *padding >= rows.start && *padding < rows.start + rows.length;
    const int64_t local_padding = owns_padding ? *padding - rows.start : -1;
    const at::Tensor looked_up = at::embedding(weight, local, local_padding);
    partial = at::where(owned.unsqueeze(-1), looked_up, at::zeros({}, looked_up.options()));
  }
  return scatter ? reduce_scatter(partial, dim, "sum", group_name) : reduce_from_tp_region(partial, group_name);
}

at::Tensor column_parallel_embedding_composite(const at::Tensor& ids, const at::Tensor& weight,
                                               c10::string_view group_name, std::optional<int64_t> padding_idx,
                                               std::optional<int64_t> gather_dim, std::optional<int64_t> full_size) {
  constexpr const char* op = "torch_tp::column_parallel_embedding";
  check_embedding_args(op, ids, weight);
  const auto group = resolve_group(op, group_name);
  const auto padding = wrap_padding_idx(op, padding_idx, weight.size(0));
  at::Tensor all_ids = ids;
  if (gather_dim) {
    // Checked here so that errors name this op rather than torch_tp::all_gather.
    const int64_t dim = wrap_dim(op, *gather_dim, ids.dim(), "gather_dim", "ids");
    gathered_size(op, ids.size(dim), dim, full_size, group->getSize(), group->getRank());
    if (cross_rank_checks_enabled()) {
      check_same_across_ranks(op, group, ids, std::nullopt, dim, full_size, "gather_dim");
    }
    all_ids = all_gather(ids, dim, group_name, full_size);
  }
  check_ids_in_range(op, all_ids, weight.size(0), "weight.size(0)");
  return at::embedding(weight, all_ids, padding.value_or(-1));
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CompositeImplicitAutograd, m) {
  m.impl("vocab_parallel_embedding", vocab_parallel_embedding_composite);
  m.impl("column_parallel_embedding", column_parallel_embedding_composite);
}

} // namespace torch_tp
