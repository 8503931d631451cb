// Expert-parallel token exchange (torchtitan's ExpertParallel, HF's AllToAllEP):
// an uneven all-to-all of rows, the dispatch of expert-sorted tokens to the
// ranks owning their experts, its inverse (combine), and the HF-style pair that
// adds the top-k routing permutation and the weighted sum over slots
// (moe_slots.cpp).
//
// NOTE [expert-parallel layout]
// E experts over p ranks, rank r owning experts [r*L, (r+1)*L), L = E/p. A
// sender's tokens [N, H] are sorted by global expert, tokens_per_expert [E]
// (sum N), so the rows for rank r are one contiguous run: send split r =
// sum(tokens_per_expert[r*L : (r+1)*L]). The counts are exchanged first, the
// [p, L] matrix by an all-to-all of L entries each: recv_counts[s][e] = rows
// rank s sends for local expert e. The rows arrive in (source s, local expert
// e) order; the block transpose of recv_counts puts them in (e, s) order, so
// each local expert's rows are contiguous: local_tokens [R, H], R =
// sum(recv_counts), local_tokens_per_expert = recv_counts.sum(0). Combine is
// the same movement backwards: block transpose of recv_counts^T [L, p] back to
// (s, e) order, then the all-to-all with the splits swapped, giving the
// sender's [N, H'] in its sorted order. Each movement is the other's adjoint,
// so each one's backward is the other. Splits must be known on the host: the
// device kernels copy the counts there (a host sync on CUDA, as torchtitan's).
// Under torch.compile R and N are data-dependent, so the fake kernels of
// moe_dispatch, _moe_dispatch_rows and moe_combine are in torch_tp/ops.py
// (unbacked sizes need torch.library.get_ctx(), which C++ has no face for).
//
// NOTE [token rows by source rank]
// HF's experts sort the rows they are given by expert themselves (their
// grouped_mm path) or pick each expert's rows by mask (eager), so the block
// transposes, a full copy of the rows each way and each again in backward,
// buy them nothing. The movements therefore take by_expert: false leaves
// the received rows in (s, e) order, by source rank and each source's run by
// local expert, and combine takes them back in that order. The HF-style pair
// moves so and hands the experts local_expert_ids [R], each row's local
// expert (arange(L) once per source, repeated by recv_counts' rows).

#include <torch_tp/ops.h>

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/moe_layout.h"

#include <ATen/ATen.h>
#include <c10/core/SymBool.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace torch_tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The value of a size if it is known now (not a symbol of torch.compile).
std::optional<int64_t> known(const c10::SymInt& size) {
  return size.maybe_as_int();
}

// all_to_all_single's checks, shared by the device and Meta kernels: x has a
// dim 0, each split list has one non-negative entry per rank, and the input
// splits cover x's rows.
c10::intrusive_ptr<c10d::ProcessGroup> check_all_to_all_args(const char* op, const at::Tensor& x,
                                                             c10::SymIntArrayRef output_splits,
                                                             c10::SymIntArrayRef input_splits,
                                                             c10::string_view group_name) {
  check_dtype(op, "x", x, /*allow_bool=*/true);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (rows are split along dim 0), got a scalar");
  auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  auto check_splits = [&](const char* arg, c10::SymIntArrayRef splits) {
    TORCH_CHECK(static_cast<int64_t>(splits.size()) == world_size, op, ": ", arg, " has ", splits.size(),
                " entries but the group has ", world_size, " ranks");
    for (const auto& s : splits) {
      const auto v = known(s);
      TORCH_CHECK(!v || *v >= 0, op, ": ", arg, "=", splits, " holds a negative size");
    }
  };
  check_splits("output_split_sizes", output_splits);
  check_splits("input_split_sizes", input_splits);
  c10::SymInt total = 0;
  for (const auto& s : input_splits) {
    total = total + s;
  }
  const auto sum = known(total);
  const auto rows = known(x.sym_size(0));
  TORCH_CHECK(!sum || !rows || *sum == *rows, op, ": input_split_sizes=", input_splits, " sum to ", *sum,
              " but x.size(0)=", *rows);
  return group;
}

std::vector<int64_t> to_ints(c10::SymIntArrayRef splits) {
  return C10_AS_INTARRAYREF_SLOW(splits).vec();
}

at::Tensor all_to_all_single_kernel(const at::Tensor& x, c10::SymIntArrayRef output_splits,
                                    c10::SymIntArrayRef input_splits, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::all_to_all_single";
  const auto group = check_all_to_all_args(op, x, output_splits, input_splits, group_name);
  return start_all_to_all(op, group, false, x, to_ints(output_splits), to_ints(input_splits)).wait();
}

// x [sum(input), rest..] -> [sum(output), rest..].
at::Tensor all_to_all_single_meta(const at::Tensor& x, c10::SymIntArrayRef output_splits,
                                  c10::SymIntArrayRef input_splits, c10::string_view group_name) {
  check_all_to_all_args("torch_tp::all_to_all_single", x, output_splits, input_splits, group_name);
  auto sizes = x.sym_sizes().vec();
  sizes[0] = 0;
  for (const auto& s : output_splits) {
    sizes[0] = sizes[0] + s;
  }
  return at::empty_symint(sizes, x.options());
}

} // namespace

// --------------------------------------------------------------- expert layout (ops/moe_layout.h)

// A 1-D int64 count tensor (tokens_per_expert) or the [p, L] recv_counts.
void check_counts(const char* op, const char* arg, const at::Tensor& counts, int64_t dims) {
  check_defined(op, arg, counts);
  TORCH_CHECK(counts.scalar_type() == at::kLong, op, ": ", arg, " must be int64, got ", counts.scalar_type());
  TORCH_CHECK(counts.dim() == dims, op, ": ", arg, " must have ", dims, " dimension(s), got shape ", counts.sizes());
}

// L = E / p, checked.
int64_t local_experts(const char* op, int64_t num_experts, int64_t world_size) {
  TORCH_CHECK(num_experts > 0 && num_experts % world_size == 0, op, ": the number of experts E=", num_experts,
              " must be a positive multiple of the group size ", world_size);
  return num_experts / world_size;
}

// tokens [N, rest..] and tokens_per_expert [E] of the sender; returns L.
int64_t check_dispatch_args(const char* op, const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                            int64_t world_size) {
  check_defined(op, "tokens", tokens);
  check_dtype(op, "tokens", tokens, /*allow_bool=*/true);
  TORCH_CHECK(tokens.dim() >= 1, op, ": tokens must have at least one dimension (rows), got a scalar");
  check_counts(op, "tokens_per_expert", tokens_per_expert, 1);
  return local_experts(op, tokens_per_expert.size(0), world_size);
}

// recv_counts must be [p, L] for the sender's tokens_per_expert [E].
void check_recv_counts(const char* op, const at::Tensor& recv_counts, int64_t world_size, int64_t local) {
  check_counts(op, "recv_counts", recv_counts, 2);
  TORCH_CHECK(recv_counts.size(0) == world_size && recv_counts.size(1) == local, op, ": recv_counts must be [",
              world_size, ", ", local, "] (group size, experts per rank), got ", recv_counts.sizes());
}

// Counts on the host, checked non-negative and, where `sum_of` names
// something, to sum to expected_sum.
at::Tensor host_counts(const char* op, const char* arg, const at::Tensor& counts, int64_t expected_sum,
                       const char* sum_of) {
  at::Tensor host = counts.to(at::kCPU).contiguous();
  const int64_t* c = host.const_data_ptr<int64_t>();
  int64_t sum = 0;
  for (const auto i : c10::irange(host.numel())) {
    TORCH_CHECK(c[i] >= 0, op, ": ", arg, " holds a negative count ", c[i]);
    sum += c[i];
  }
  TORCH_CHECK(sum_of == nullptr || sum == expected_sum, op, ": ", arg, " sums to ", sum, " but ", sum_of, "=", expected_sum);
  return host;
}

// Row sums of a host [a, b] count matrix: the split sizes of its row blocks.
std::vector<int64_t> row_sums(const at::Tensor& counts) {
  const int64_t a = counts.size(0);
  const int64_t b = counts.size(1);
  const int64_t* c = counts.const_data_ptr<int64_t>();
  std::vector<int64_t> sums(a, 0);
  for (const auto i : c10::irange(a)) {
    sums[i] = c10::sum_integers(c + i * b, c + (i + 1) * b);
  }
  return sums;
}

// rows hold blocks in (i, j) order with sizes counts [a, b] (host, row-major);
// returns them in (j, i) order. Identity when a or b is 1.
static at::Tensor block_transpose(const at::Tensor& rows, const at::Tensor& counts) {
  const int64_t a = counts.size(0);
  const int64_t b = counts.size(1);
  if (a == 1 || b == 1) {
    return rows.contiguous();
  }
  const int64_t* c = counts.const_data_ptr<int64_t>();
  std::vector<int64_t> start(a * b);
  int64_t offset = 0;
  for (const auto k : c10::irange(a * b)) {
    start[k] = offset;
    offset += c[k];
  }
  std::vector<int64_t> index;
  index.reserve(offset);
  for (const auto j : c10::irange(b)) {
    for (const auto i : c10::irange(a)) {
      for (const auto row : c10::irange(c[i * b + j])) {
        index.push_back(start[i * b + j] + row);
      }
    }
  }
  const at::Tensor idx = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(rows.device());
  return rows.index_select(0, idx);
}

// The movement of NOTE [expert-parallel layout] with both count tensors on
// the host: tokens [N, ..] -> all-to-all -> (s, e) -> block transpose -> (e, s)
// where by_expert (else the rows stay by source, NOTE [token rows by source rank]).
at::Tensor dispatch_rows(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const at::Tensor& tokens, const at::Tensor& tpe_host, const at::Tensor& recv_host,
                         bool by_expert) {
  const int64_t world_size = group->getSize();
  const at::Tensor received =
      start_all_to_all(op, group, false, tokens, row_sums(recv_host), row_sums(tpe_host.view({world_size, -1})))
          .wait();
  return by_expert ? block_transpose(received, recv_host) : received;
}

// Its inverse: local_out [R, ..] (e, s) -> block transpose of recv^T -> (s, e) -> all-to-all back -> [N, ..].
at::Tensor combine_rows(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                        const at::Tensor& local_out, const at::Tensor& tpe_host, const at::Tensor& recv_host,
                        bool by_expert) {
  const int64_t world_size = group->getSize();
  const at::Tensor by_source = by_expert ? block_transpose(local_out, recv_host.t().contiguous()) : local_out;
  return start_all_to_all(op, group, false, by_source, row_sums(tpe_host.view({world_size, -1})),
                          row_sums(recv_host))
      .wait();
}

at::Tensor exchange_counts(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                           const at::Tensor& tokens_per_expert, int64_t local) {
  const int64_t world_size = group->getSize();
  // [E] as p runs of L -> [p, L]: row s = what rank s sends this rank.
  return start_all_to_all(op, group, false, tokens_per_expert, std::vector<int64_t>(world_size, local),
                          std::vector<int64_t>(world_size, local))
      .wait()
      .view({world_size, local});
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch_kernel(const at::Tensor& tokens,
                                                                   const at::Tensor& tokens_per_expert,
                                                                   c10::string_view group_name, bool by_expert) {
  constexpr const char* op = "torch_tp::moe_dispatch";
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, tokens, tokens_per_expert, world_size);
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, tokens.size(0), "tokens.size(0)");
  const at::Tensor recv_counts = exchange_counts(op, group, tokens_per_expert, local);
  const at::Tensor recv_host = recv_counts.to(at::kCPU).contiguous();
  at::Tensor local_tokens = dispatch_rows(op, group, tokens, tpe_host, recv_host, by_expert);
  return {std::move(local_tokens), recv_counts.sum(0), recv_counts};
}

at::Tensor dispatch_rows_kernel(const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                                const at::Tensor& recv_counts, c10::string_view group_name, bool by_expert) {
  constexpr const char* op = "torch_tp::_moe_dispatch_rows";
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, tokens, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, tokens.size(0), "tokens.size(0)");
  const at::Tensor recv_host = recv_counts.to(at::kCPU).contiguous();
  return dispatch_rows(op, group, tokens, tpe_host, recv_host, by_expert);
}

at::Tensor moe_combine_kernel(const at::Tensor& local_out, const at::Tensor& recv_counts,
                              const at::Tensor& tokens_per_expert, c10::string_view group_name, bool by_expert) {
  constexpr const char* op = "torch_tp::moe_combine";
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  check_defined(op, "local_out", local_out);
  check_dtype(op, "local_out", local_out, /*allow_bool=*/true);
  TORCH_CHECK(local_out.dim() >= 1, op, ": local_out must have at least one dimension (rows), got a scalar");
  check_counts(op, "tokens_per_expert", tokens_per_expert, 1);
  const int64_t local = local_experts(op, tokens_per_expert.size(0), world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, local_out.size(0), "local_out.size(0)");
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, 0, nullptr);
  return combine_rows(op, group, local_out, tpe_host, recv_host, by_expert);
}

// --------------------------------------------------------------- autograd

// NOTE [no gradient, no Function] (collectives_autograd.cpp): without a
// gradient to record, the call goes straight below autograd.
template <typename Below, typename Apply>
auto redispatch_or_apply(const at::Tensor& x, const Below& below, const Apply& apply) {
  if (!needs_autograd(x)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return below();
  }
  return apply();
}

// Backward: the reverse all-to-all (splits swapped).
struct AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::SymIntArrayRef output_splits,
                            c10::SymIntArrayRef input_splits, const std::string& group_name) {
    ctx->saved_data["output_splits"] = c10::IValue(output_splits);
    ctx->saved_data["input_splits"] = c10::IValue(input_splits);
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return all_to_all_single(x, output_splits, input_splits, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto output_splits = ctx->saved_data["output_splits"].toSymIntVector();
    const auto input_splits = ctx->saved_data["input_splits"].toSymIntVector();
    return {all_to_all_single(grads[0], input_splits, output_splits, ctx->saved_data["group_name"].toStringRef()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_to_all_single_autograd(const at::Tensor& x, c10::SymIntArrayRef output_splits,
                                      c10::SymIntArrayRef input_splits, c10::string_view group_name) {
  return redispatch_or_apply(
      x, [&] { return all_to_all_single(x, output_splits, input_splits, group_name); },
      [&] { return AllToAllFunction::apply(x, output_splits, input_splits, std::string(group_name)); });
}

// Backward of either dispatch movement: moe_combine of the gradient.
struct DispatchFunction : public torch::autograd::Function<DispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                               const std::string& group_name, bool by_expert) {
    at::Tensor local_tokens, local_tpe, recv_counts;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(local_tokens, local_tpe, recv_counts) = moe_dispatch(tokens, tokens_per_expert, group_name, by_expert);
    }
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["by_expert"] = by_expert;
    ctx->save_for_backward({tokens_per_expert, recv_counts});
    ctx->mark_non_differentiable({local_tpe, recv_counts});
    ctx->set_materialize_grads(false);  // the counts have no gradient: no zeros for them
    return {local_tokens, local_tpe, recv_counts};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_tokens;
    if (grads[0].defined()) {
      grad_tokens = moe_combine(grads[0], saved[1], saved[0], ctx->saved_data["group_name"].toStringRef(),
                                ctx->saved_data["by_expert"].toBool());
    }
    return {grad_tokens, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch_autograd(const at::Tensor& tokens,
                                                                     const at::Tensor& tokens_per_expert,
                                                                     c10::string_view group_name, bool by_expert) {
  if (!needs_autograd(tokens)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_dispatch(tokens, tokens_per_expert, group_name, by_expert);
  }
  auto out = DispatchFunction::apply(tokens, tokens_per_expert, std::string(group_name), by_expert);
  return {out[0], out[1], out[2]};
}

struct DispatchRowsFunction : public torch::autograd::Function<DispatchRowsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                            const at::Tensor& recv_counts, const std::string& group_name, bool by_expert) {
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["by_expert"] = by_expert;
    ctx->save_for_backward({tokens_per_expert, recv_counts});
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_dispatch_rows(tokens, tokens_per_expert, recv_counts, group_name, by_expert);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_tokens;
    if (grads[0].defined()) {
      grad_tokens = moe_combine(grads[0], saved[1], saved[0], ctx->saved_data["group_name"].toStringRef(),
                                ctx->saved_data["by_expert"].toBool());
    }
    return {grad_tokens, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dispatch_rows_autograd(const at::Tensor& tokens, const at::Tensor& tokens_per_expert,
                                  const at::Tensor& recv_counts, c10::string_view group_name, bool by_expert) {
  return redispatch_or_apply(
      tokens, [&] { return moe_dispatch_rows(tokens, tokens_per_expert, recv_counts, group_name, by_expert); },
      [&] {
        return DispatchRowsFunction::apply(tokens, tokens_per_expert, recv_counts, std::string(group_name),
                                           by_expert);
      });
}

// Backward: the dispatch movement of the gradient, with the counts already known.
struct CombineFunction : public torch::autograd::Function<CombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local_out, const at::Tensor& recv_counts,
                            const at::Tensor& tokens_per_expert, const std::string& group_name, bool by_expert) {
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["by_expert"] = by_expert;
    ctx->save_for_backward({tokens_per_expert, recv_counts});
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_combine(local_out, recv_counts, tokens_per_expert, group_name, by_expert);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_out;
    if (grads[0].defined()) {
      grad_out = moe_dispatch_rows(grads[0], saved[0], saved[1], ctx->saved_data["group_name"].toStringRef(),
                                   ctx->saved_data["by_expert"].toBool());
    }
    return {grad_out, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor moe_combine_autograd(const at::Tensor& local_out, const at::Tensor& recv_counts,
                                const at::Tensor& tokens_per_expert, c10::string_view group_name, bool by_expert) {
  return redispatch_or_apply(
      local_out, [&] { return moe_combine(local_out, recv_counts, tokens_per_expert, group_name, by_expert); },
      [&] {
        return CombineFunction::apply(local_out, recv_counts, tokens_per_expert, std::string(group_name),
                                      by_expert);
      });
}

// --------------------------------------------------------------- top-k routing (HF's AllToAllEP)

// top_k_index [T, K] of any integer dtype -> the flat ids [T*K] int64, every
// one checked in [0, num_experts) before anything is communicated (the check
// reads the ids on the host: a host sync on CUDA, which the dispatch needs
// for its counts anyway).
at::Tensor expert_ids_kernel(const at::Tensor& top_k_index, int64_t num_experts) {
  constexpr const char* op = "torch_tp::moe_token_dispatch";
  // A copy even when top_k_index is already flat int64: an op's output must not alias its input.
  const at::Tensor flat = top_k_index.reshape({-1}).to(at::kLong, /*non_blocking=*/false, /*copy=*/true);
  if (flat.numel() > 0) {
    const auto [lo, hi] = at::aminmax(flat);
    const int64_t low = lo.item<int64_t>();
    const int64_t high = hi.item<int64_t>();
    TORCH_CHECK_INDEX(low >= 0 && high < num_experts, op, ": top_k_index holds expert id ",
                      low < 0 ? low : high, ", outside [0, num_experts=", num_experts, ")");
  }
  return flat;
}

at::Tensor expert_ids_meta(const at::Tensor& top_k_index, int64_t /*num_experts*/) {
  return at::empty_symint({top_k_index.sym_numel()}, top_k_index.options().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_token_dispatch_composite(
    const at::Tensor& hidden, const at::Tensor& top_k_index, int64_t num_experts, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::moe_token_dispatch";
  check_defined(op, "hidden", hidden);
  check_defined(op, "top_k_index", top_k_index);
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [T, H], got shape ", hidden.sym_sizes());
  TORCH_CHECK(top_k_index.dim() == 2, op, ": top_k_index must be [T, K], got shape ", top_k_index.sym_sizes());
  TORCH_CHECK(at::isIntegralType(top_k_index.scalar_type(), /*includeBool=*/false), op,
              ": top_k_index must have an integer dtype, got ", top_k_index.scalar_type());
  TORCH_SYM_CHECK(hidden.sym_size(0).sym_eq(top_k_index.sym_size(0)), op, ": hidden has T=", hidden.sym_size(0),
                  " rows but top_k_index has ", top_k_index.sym_size(0));
  // top-k picks K distinct experts per token: K > E is a router bug, not a routing.
  TORCH_SYM_CHECK(top_k_index.sym_size(1).sym_le(num_experts), op, ": top_k_index has K=",
                  top_k_index.sym_size(1), " experts per token, more than the num_experts=", num_experts);
  local_experts(op, num_experts, resolve_group(op, group_name)->getSize());
  static const auto ids_op = find_op<at::Tensor(const at::Tensor&, int64_t)>("torch_tp::_moe_expert_ids");
  const at::Tensor flat = ids_op.call(top_k_index, num_experts);
  // (token, slot) pairs sorted by expert, stably: row i is pair order[i].
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor tokens_per_expert =
      at::zeros({num_experts}, flat.options()).index_add(0, flat, at::ones_like(flat));
  // The gather of the slots' rows and the dispatch, with the rows left by
  // source (NOTE [token rows by source rank]), as one op (moe_slot_exchange.cpp).
  static const auto dispatch_op =
      find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t,
                                                             const at::Tensor&, c10::string_view)>(
          "torch_tp::_moe_slot_dispatch");
  auto [local_tokens, local_tpe, recv_counts] =
      dispatch_op.call(hidden, order, top_k_index.size(1), tokens_per_expert, group_name);
  at::Tensor local_expert_ids = at::repeat_interleave_symint(
      at::arange(local_tpe.size(0), flat.options()).repeat({recv_counts.size(0)}), recv_counts.reshape({-1}), 0,
      local_tokens.sym_size(0));
  return {local_tokens, local_expert_ids, order, tokens_per_expert, recv_counts};
}

// moe_combine -> [T*K, H'] in sorted order -> each token's K rows summed,
// weighted: out[order[i] // K] += w[order[i]] * row i.
at::Tensor moe_token_combine_composite(const at::Tensor& local_out, const at::Tensor& top_k_weights,
                                       const at::Tensor& order, const at::Tensor& tokens_per_expert,
                                       const at::Tensor& recv_counts, c10::string_view group_name) {
  constexpr const char* op = "torch_tp::moe_token_combine";
  check_defined(op, "top_k_weights", top_k_weights);
  TORCH_CHECK(at::isFloatingType(top_k_weights.scalar_type()), op,
              ": top_k_weights must have a floating dtype, got ", top_k_weights.scalar_type());
  check_defined(op, "local_out", local_out);
  // moe_combine and the weighted sum, as one op (moe_slot_exchange.cpp).
  static const auto combine_op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, c10::string_view)>("torch_tp::_moe_slot_combine");
  return combine_op.call(local_out, top_k_weights.to(local_out.scalar_type()), order, tokens_per_expert, recv_counts,
                         group_name);
}

void impl_device_kernels(torch::Library& m) {
  m.impl("all_to_all_single", all_to_all_single_kernel);
  m.impl("moe_dispatch", moe_dispatch_kernel);
  m.impl("_moe_dispatch_rows", dispatch_rows_kernel);
  m.impl("moe_combine", moe_combine_kernel);
  m.impl("_moe_expert_ids", expert_ids_kernel);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  impl_device_kernels(m);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  impl_device_kernels(m);
}

TORCH_LIBRARY_IMPL(torch_tp, Meta, m) {
  m.impl("all_to_all_single", all_to_all_single_meta);
  m.impl("_moe_expert_ids", expert_ids_meta);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("all_to_all_single", all_to_all_single_autograd);
  m.impl("moe_dispatch", moe_dispatch_autograd);
  m.impl("_moe_dispatch_rows", dispatch_rows_autograd);
  m.impl("moe_combine", moe_combine_autograd);
}

TORCH_LIBRARY_IMPL(torch_tp, CompositeImplicitAutograd, m) {
  m.impl("moe_token_dispatch", moe_token_dispatch_composite);
  m.impl("moe_token_combine", moe_token_combine_composite);
}

} // namespace torch_tp
