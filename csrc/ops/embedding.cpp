// Sharded embeddings, written as compositions of ATen ops, the torch_tp
// collectives and (vocab_parallel_embedding's local lookup) one op pair of
// their own (CompositeImplicitAutograd): their gradients, Meta shapes and
// torch.compile decompositions come from the pieces, and there is no
// communication to overlap.
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
#include "ops/row_io.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstring>
#include <utility>

namespace torch_tp {
namespace {

constexpr const char* kVocabOp = "torch_tp::vocab_parallel_embedding";

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

// The IndexError of an id outside [0, num_embeddings), as F.embedding's, naming the op.
[[noreturn]] void raise_id_out_of_range(const char* op, int64_t id, int64_t num_embeddings, const char* what) {
  TORCH_CHECK_INDEX(false, op, ": ids contains ", id, ", outside [0, ", num_embeddings, ") (", what, ")");
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
    raise_id_out_of_range(op, bad.numel() > 0 ? bad[0].item<int64_t>() : -1, num_embeddings, what);
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

// NOTE [the vocab shard's lookup]
// vocab_parallel_embedding's local part on rank r, whose table holds rows
// [start, start + rows) of vocab_size:
//   out[i]        = weight[ids[i] - start]   where start <= ids[i] < start + rows
//                 = 0                        elsewhere                 [.., D]
//   grad_weight[k] = sum of grad[i] over i with ids[i] = start + k,
//                    k != padding_idx (local)                          [rows, D]
// As ATen ops that is a dozen calls forward (the range check, the masks, the
// shifted ids, embedding, where) and where's and embedding's gradients
// backward: on a training step's ids each is dispatch around almost no work,
// and at the example's shape (ids [4, 64], a [128, 256] shard) that dispatch
// is most of the op's time, forward and backward. So the pieces
// _vocab_shard_lookup and _vocab_shard_lookup_backward run one loop each on
// the CPU: a row copied or zeroed per id (after a pass that checks every id,
// so a bad one raises before anything is written or communicated), and a row
// added per owned id, in the order of i and with embedding_dense_backward's
// rounding (opmath adds, bfloat16 and float16 rounded after each, as its row
// add_), so both give the composition's numbers. Elsewhere (CUDA) the
// pieces are that composition. The op differentiates through a Function
// whose backward is the backward piece; a gradient taken with create_graph,
// and a forward-mode tangent on the weight, go through the composition
// instead, which ATen differentiates.

// The composition's masks: which ids the shard owns, and their rows in it (0 for the others).
std::pair<at::Tensor, at::Tensor> owned_and_local(const at::Tensor& ids, int64_t start, int64_t rows) {
  at::Tensor owned = (ids >= start) & (ids < start + rows);
  at::Tensor local = (ids - start).masked_fill(owned.logical_not(), 0);
  return {std::move(owned), std::move(local)};
}

// The composition: out[i] as above, from ATen ops (differentiable, forward
// mode included). padding_idx is local (-1: none); it matters to the backward.
at::Tensor shard_lookup_composition(const at::Tensor& ids, const at::Tensor& weight, int64_t start,
                                    int64_t vocab_size, int64_t padding_idx) {
  check_ids_in_range(kVocabOp, ids, vocab_size, "vocab_size");
  const auto [owned, local] = owned_and_local(ids, start, weight.size(0));
  const at::Tensor looked_up = at::embedding(weight, local, padding_idx);
  return at::where(owned.unsqueeze(-1), looked_up, at::zeros({}, looked_up.options()));
}

// The composition's gradient for the table: where's, then embedding's.
at::Tensor shard_lookup_backward_composition(const at::Tensor& grad, const at::Tensor& ids, int64_t start,
                                             int64_t rows, int64_t padding_idx) {
  const auto [owned, local] = owned_and_local(ids, start, rows);
  const at::Tensor masked = at::where(owned.unsqueeze(-1), grad, at::zeros({}, grad.options()));
  return at::embedding_dense_backward(masked, local, rows, padding_idx, /*scale_grad_by_freq=*/false);
}

bool is_cpu_strided(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided;
}

// _vocab_shard_lookup: [.., D] of ids [..] in a table of rows [start, start +
// weight.size(0)) (NOTE [the vocab shard's lookup]).
at::Tensor vocab_shard_lookup_kernel(const at::Tensor& ids, const at::Tensor& weight, int64_t start,
                                     int64_t vocab_size) {
  if (!is_cpu_strided(ids) || !is_cpu_strided(weight)) {
    return shard_lookup_composition(ids, weight, start, vocab_size, /*padding_idx=*/-1);
  }
  const at::Tensor ids_c = ids.contiguous();
  const at::Tensor table = weight.stride(1) == 1 ? weight : weight.contiguous();
  const int64_t n = ids_c.numel();
  const int64_t rows = table.size(0);
  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(table.size(1));
  at::Tensor out = at::empty(out_sizes, table.options().memory_format(at::MemoryFormat::Contiguous));
  const size_t row_bytes = static_cast<size_t>(table.size(1)) * table.element_size();
  const int64_t table_stride = table.stride(0) * static_cast<int64_t>(table.element_size());
  const auto* src = static_cast<const char*>(table.const_data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  AT_DISPATCH_INDEX_TYPES(ids_c.scalar_type(), "vocab_shard_lookup", [&] {
    const index_t* id = ids_c.const_data_ptr<index_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (id[i] < 0 || id[i] >= vocab_size) {
        raise_id_out_of_range(kVocabOp, id[i], vocab_size, "vocab_size");
      }
    }
    at::parallel_for(0, n, row_grain(table.size(1)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t k = static_cast<int64_t>(id[i]) - start;
        char* to = dst + static_cast<size_t>(i) * row_bytes;
        if (k >= 0 && k < rows) {
          std::memcpy(to, src + k * table_stride, row_bytes);
        } else if (row_bytes > 0) {
          std::memset(to, 0, row_bytes);  // all-zero bits: +0.0 in every floating dtype
        }
      }
    });
  });
  return out;
}

// _vocab_shard_lookup_backward: grad_weight [rows, D] from grad [.., D].
at::Tensor vocab_shard_lookup_backward_kernel(const at::Tensor& grad, const at::Tensor& ids, int64_t start,
                                              int64_t rows, int64_t padding_idx) {
  // The op's Function passes the output's gradient; a direct call could pass any.
  TORCH_CHECK(grad.dim() == ids.dim() + 1 && grad.sizes().slice(0, ids.dim()).equals(ids.sizes()),
              "torch_tp::_vocab_shard_lookup_backward: grad has shape ", grad.sizes(), ", but ids has shape ",
              ids.sizes(), ": grad must be [*ids.shape, embedding_dim]");
  if (!is_cpu_strided(grad) || !is_cpu_strided(ids)) {
    return shard_lookup_backward_composition(grad, ids, start, rows, padding_idx);
  }
  const at::Tensor ids_c = ids.contiguous();
  const at::Tensor grad_c = grad.contiguous();
  const int64_t n = ids_c.numel();
  const int64_t dim = grad.size(-1);
  at::Tensor grad_weight = at::zeros({rows, dim}, grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "vocab_shard_lookup_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_c.const_data_ptr<scalar_t>();
    scalar_t* gw = grad_weight.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(ids_c.scalar_type(), "vocab_shard_lookup_backward", [&] {
      const index_t* id = ids_c.const_data_ptr<index_t>();
      // Threads split the table's rows, as embedding_dense_backward does (its
      // grain too); each reads every id, so a row's sum keeps the ids' order.
      at::parallel_for(0, rows, /*grain_size=*/1000, [&](int64_t first_row, int64_t end_row) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t k = static_cast<int64_t>(id[i]) - start;
          if (k < first_row || k >= end_row || k == padding_idx) {
            continue;
          }
          scalar_t* to = gw + k * dim;
          const scalar_t* from = g + i * dim;
          for (int64_t j = 0; j < dim; ++j) {
            to[j] = static_cast<scalar_t>(static_cast<opmath_t>(to[j]) + static_cast<opmath_t>(from[j]));
          }
        }
      });
    });
  });
  return grad_weight;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using LookupSignature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using LookupBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t);

// Inputs: weight, ids, start, vocab_size, padding_idx; only weight is differentiable.
struct VocabShardLookupFunction : public torch::autograd::Function<VocabShardLookupFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids, int64_t start,
                            int64_t vocab_size, int64_t padding_idx) {
    static const auto lookup_op = find_op<LookupSignature>("torch_tp::_vocab_shard_lookup");
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = lookup_op.call(ids, weight, start, vocab_size);
    }
    ctx->save_for_backward({ids});
    ctx->saved_data["start"] = start;
    ctx->saved_data["rows"] = weight.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op = find_op<LookupBackwardSignature>("torch_tp::_vocab_shard_lookup_backward");
    variable_list out(5);
    if (!grads[0].defined()) {
      return out;
    }
    const at::Tensor ids = ctx->get_saved_variables()[0];
    const int64_t start = ctx->saved_data["start"].toInt();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    // create_graph: a gradient that is differentiable again (the pieces are not).
    out[0] = at::GradMode::is_enabled() ? shard_lookup_backward_composition(grads[0], ids, start, rows, padding_idx)
                                        : backward_op.call(grads[0], ids, start, rows, padding_idx);
    return out;
  }
};

at::Tensor vocab_shard_lookup(const at::Tensor& ids, const at::Tensor& weight, int64_t start, int64_t vocab_size,
                              int64_t padding_idx) {
  if (weight._fw_grad(/*level=*/0).defined()) {
    return shard_lookup_composition(ids, weight, start, vocab_size, padding_idx);
  }
  if (needs_autograd(weight)) {
    return VocabShardLookupFunction::apply(weight, ids, start, vocab_size, padding_idx);
  }
  static const auto lookup_op = find_op<LookupSignature>("torch_tp::_vocab_shard_lookup");
  at::AutoDispatchBelowADInplaceOrView guard;
  return lookup_op.call(ids, weight, start, vocab_size);
}

at::Tensor vocab_parallel_embedding_composite(const at::Tensor& ids, const at::Tensor& weight,
                                              c10::string_view group_name, int64_t vocab_size,
                                              std::optional<int64_t> padding_idx,
                                              std::optional<int64_t> scatter_dim) {
  constexpr const char* op = kVocabOp;
  check_embedding_args(op, ids, weight);
  TORCH_CHECK(vocab_size >= 0, op, ": vocab_size=", vocab_size, " must be >= 0");
  const auto group = resolve_group(op, group_name);
  const int64_t rank = group->getRank();
  const auto rows = chunk_range(vocab_size, group->getSize(), rank);
  TORCH_CHECK(weight.size(0) == rows.length, op, ": weight.size(0)=", weight.size(0), " but rank ", rank,
              "'s torch.chunk piece of vocab_size=", vocab_size, " over ", group->getSize(), " ranks has ",
              rows.length, " rows");
  const auto padding = wrap_padding_idx(op, padding_idx, vocab_size);
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
    check_ids_in_range(op, ids, vocab_size, "vocab_size");
    partial = at::zeros(out_sizes, weight.options()) + weight.sum();
  } else {
    // Checks the ids itself, before any collective (NOTE [ids out of range]).
    const bool owns_padding = padding && *padding >= rows.start && *padding < rows.start + rows.length;
    partial = vocab_shard_lookup(ids, weight, rows.start, vocab_size, owns_padding ? *padding - rows.start : -1);
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

// The loops on the CPU, the composition elsewhere (NOTE [the vocab shard's lookup]).
TORCH_LIBRARY_IMPL(torch_tp, CompositeExplicitAutograd, m) {
  m.impl("_vocab_shard_lookup", vocab_shard_lookup_kernel);
  m.impl("_vocab_shard_lookup_backward", vocab_shard_lookup_backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  // The pieces are not differentiable themselves; the public op is.
  m.impl("_vocab_shard_lookup", torch::autograd::autogradNotImplementedFallback());
  m.impl("_vocab_shard_lookup_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
