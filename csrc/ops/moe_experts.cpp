// The SiLU-gated experts of transformers' MoE layout as one op, on rows
// already grouped by expert (what expert parallelism hands a rank):
//
//   moe_gated_experts(rows [N, H], counts, gate_up_proj [L, 2I, H], down_proj [L, H, I]) -> [N, H]
//   out[row of expert e] = down_e (silu(gate_e x) * up_e x),   [gate_e | up_e] = gate_up_proj[e]
//
// counts [B, L] int64 (or [L], B = 1) gives the row-major (run b, expert e)
// blocks of rows: moe_token_dispatch's rows by source rank, each source's run
// by local expert, with its recv_counts.
//
// NOTE [one GEMM per expert]
// transformers' experts module takes top-k routing, so on these rows it sorts
// them by expert again, gathers, weights by ones and scatters back, and on the
// CPU its grouped_mm (torch._grouped_mm) and the backward of its
// chunk(2) of gate_up cost more than the GEMMs they wrap. Here the rows are
// put in (e, b) order once (one gather, none when B or L is 1), each expert
// runs one at::mm per projection on its n_e rows (per (b, e) block GEMMs would
// have half the rows at EP 2, and a GEMM that short runs measurably slower),
// the gradients of the weights are written straight into [L, ...] tensors of
// the parameters' layout, and the gate and up gradients into one [N, 2I]
// buffer, with no concatenation. The activation is ATen's silu and mul, as
// the module's own: the same roundings in every dtype. The backward keeps
// what autograd keeps of the module's own forward: the projection gate_up_out
// [N, 2I], silu_gate = silu(gate) and gated = silu_gate * up [N, I].

#include <torch_tp/ops.h>

#include "ops/common.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

namespace torch_tp {
namespace {

constexpr const char* kOp = "torch_tp::moe_gated_experts";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Dims and dtypes, checkable on Meta tensors too.
void check_args(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up,
                const at::Tensor& down) {
  check_defined(kOp, "rows", rows);
  check_defined(kOp, "counts", counts);
  check_defined(kOp, "gate_up_proj", gate_up);
  check_defined(kOp, "down_proj", down);
  TORCH_CHECK(rows.dim() == 2, kOp, ": rows must be [N, H], got shape ", rows.sym_sizes());
  TORCH_CHECK(counts.scalar_type() == at::kLong && (counts.dim() == 1 || counts.dim() == 2), kOp,
              ": counts must be int64 [L] or [B, L], got ", counts.scalar_type(), " of shape ", counts.sym_sizes());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, kOp,
              ": gate_up_proj must be [L, 2I, H] and down_proj [L, H, I], got ",
              gate_up.sym_sizes(), " and ", down.sym_sizes());
  TORCH_CHECK(at::isFloatingType(rows.scalar_type()) && gate_up.scalar_type() == rows.scalar_type() &&
                  down.scalar_type() == rows.scalar_type(),
              kOp, ": rows, gate_up_proj and down_proj must share one floating dtype, got ", rows.scalar_type(), ", ",
              gate_up.scalar_type(), " and ", down.scalar_type());
  TORCH_CHECK(gate_up.device() == rows.device() && down.device() == rows.device(), kOp,
              ": rows, gate_up_proj and down_proj must be on one device, got ", rows.device(), ", ", gate_up.device(),
              " and ", down.device());
  const auto experts = gate_up.sym_size(0);
  const auto hidden = rows.sym_size(1);
  const auto inner = down.sym_size(2);
  TORCH_SYM_CHECK(down.sym_size(0).sym_eq(experts).sym_and(down.sym_size(1).sym_eq(hidden))
                      .sym_and(gate_up.sym_size(2).sym_eq(hidden))
                      .sym_and(gate_up.sym_size(1).sym_eq(inner * 2))
                      .sym_and(counts.sym_size(-1).sym_eq(experts)),
                  kOp, ": rows ", rows.sym_sizes(), ", counts ", counts.sym_sizes(), ", gate_up_proj ",
                  gate_up.sym_sizes(), " and down_proj ", down.sym_sizes(),
                  " are not [N, H], [B, L], [L, 2I, H] and [L, H, I]");
}

// Where each expert's rows lie once they are in (e, b) order.
struct ExpertRows {
  std::vector<int64_t> start;  // [L + 1]: expert e's rows are [start[e], start[e + 1])
  at::Tensor order;            // sorted row j is rows[order[j]]; undefined when rows are in that order already

  int64_t count(int64_t e) const {
    return start[e + 1] - start[e];
  }
};

ExpertRows expert_rows(const at::Tensor& rows, const at::Tensor& counts) {
  const at::Tensor c = counts.to(at::kCPU).contiguous().view({counts.dim() == 1 ? 1 : counts.size(0), -1});
  const int64_t runs = c.size(0);
  const int64_t experts = c.size(1);
  const int64_t* n = c.const_data_ptr<int64_t>();
  ExpertRows layout;
  layout.start.assign(experts + 1, 0);
  int64_t total = 0;
  for (const auto k : c10::irange(runs * experts)) {
    TORCH_CHECK(n[k] >= 0, kOp, ": counts holds a negative count ", n[k]);
    layout.start[k % experts + 1] += n[k];
    total += n[k];
  }
  TORCH_CHECK(total == rows.size(0), kOp, ": counts sums to ", total, " but rows.size(0)=", rows.size(0));
  for (const auto e : c10::irange(experts)) {
    layout.start[e + 1] += layout.start[e];
  }
  if (runs > 1 && experts > 1) {
    std::vector<int64_t> block_start(runs * experts);  // of block (b, e) in rows
    for (int64_t k = 0, at = 0; k < runs * experts; ++k) {
      block_start[k] = at;
      at += n[k];
    }
    std::vector<int64_t> order;
    order.reserve(total);
    for (const auto e : c10::irange(experts)) {
      for (const auto b : c10::irange(runs)) {
        for (const auto i : c10::irange(n[b * experts + e])) {
          order.push_back(block_start[b * experts + e] + i);
        }
      }
    }
    layout.order = at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(rows.device());
  }
  return layout;
}

at::Tensor to_expert_order(const at::Tensor& t, const ExpertRows& layout) {
  return layout.order.defined() ? t.index_select(0, layout.order) : t.contiguous();
}

at::Tensor from_expert_order(const at::Tensor& t, const ExpertRows& layout) {
  return layout.order.defined() ? at::empty_like(t).index_copy_(0, layout.order, t) : t;
}

// out[e's rows] = a[e's rows] @ w[e]^T (transposed: a[e's rows] @ w[e]).
at::Tensor per_expert_mm(const at::Tensor& a, const at::Tensor& w, const ExpertRows& layout, bool transposed) {
  at::Tensor out = at::empty({a.size(0), w.size(transposed ? 2 : 1)}, a.options());
  for (const auto e : c10::irange(w.size(0))) {
    if (layout.count(e) > 0) {
      const at::Tensor we = w.select(0, e);
      at::Tensor rows_out = out.narrow(0, layout.start[e], layout.count(e));
      at::mm_out(rows_out, a.narrow(0, layout.start[e], layout.count(e)), transposed ? we : we.t());
    }
  }
  return out;
}

// grad_w[e] = g[e's rows]^T @ a[e's rows]: [L, out, in], zero for an expert without rows.
at::Tensor per_expert_weight_grad(const at::Tensor& g, const at::Tensor& a, const ExpertRows& layout,
                                  const at::Tensor& weight) {
  at::Tensor grad = at::empty(weight.sizes(), weight.options());
  for (const auto e : c10::irange(weight.size(0))) {
    if (layout.count(e) == 0) {
      grad.select(0, e).zero_();
    } else {
      at::Tensor grad_e = grad.select(0, e);
      at::mm_out(grad_e, g.narrow(0, layout.start[e], layout.count(e)).t(),
                 a.narrow(0, layout.start[e], layout.count(e)));
    }
  }
  return grad;
}

// -> (out [N, H] in rows' order; gate_up_out [N, 2I], silu_gate and gated [N, I] in expert order).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_kernel(const at::Tensor& rows,
                                                                          const at::Tensor& counts,
                                                                          const at::Tensor& gate_up_proj,
                                                                          const at::Tensor& down_proj) {
  check_args(rows, counts, gate_up_proj, down_proj);
  const ExpertRows layout = expert_rows(rows, counts);
  const int64_t inner = down_proj.size(2);
  at::Tensor gate_up_out = per_expert_mm(to_expert_order(rows, layout), gate_up_proj.contiguous(), layout, false);
  at::Tensor silu_gate = at::silu(gate_up_out.narrow(1, 0, inner));
  at::Tensor gated = silu_gate * gate_up_out.narrow(1, inner, inner);
  at::Tensor out = from_expert_order(per_expert_mm(gated, down_proj.contiguous(), layout, false), layout);
  return {out, gate_up_out, silu_gate, gated};
}

at::Tensor gated_experts_kernel(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
                                const at::Tensor& down_proj) {
  return std::get<0>(forward_kernel(rows, counts, gate_up_proj, down_proj));
}

// Gradients of rows, gate_up_proj and down_proj where output_mask says.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
    const at::Tensor& down_proj, const at::Tensor& gate_up_out, const at::Tensor& silu_gate,
    const at::Tensor& gated, std::array<bool, 3> output_mask) {
  check_args(rows, counts, gate_up_proj, down_proj);
  TORCH_CHECK(grad_out.sizes().equals(rows.sizes()) && grad_out.scalar_type() == rows.scalar_type(), kOp,
              ": the output gradient has shape ", grad_out.sizes(), " and dtype ", grad_out.scalar_type(),
              "; expected ", rows.sizes(), " of ", rows.scalar_type());
  const ExpertRows layout = expert_rows(rows, counts);
  const int64_t inner = down_proj.size(2);
  const at::Tensor gate_up_w = gate_up_proj.contiguous();
  const at::Tensor down_w = down_proj.contiguous();
  const at::Tensor dy = to_expert_order(grad_out, layout);
  at::Tensor grad_down = output_mask[2] ? per_expert_weight_grad(dy, gated, layout, down_w) : at::Tensor();
  at::Tensor grad_gate_up, grad_rows;
  if (output_mask[0] || output_mask[1]) {
    const at::Tensor grad_gated = per_expert_mm(dy, down_w, layout, true);
    const at::Tensor gate = gate_up_out.narrow(1, 0, inner);
    const at::Tensor up = gate_up_out.narrow(1, inner, inner);
    at::Tensor grad_gate_up_out = at::empty_like(gate_up_out);
    at::Tensor grad_gate = grad_gate_up_out.narrow(1, 0, inner);
    at::silu_backward_out(grad_gate, grad_gated * up, gate);
    at::Tensor grad_up = grad_gate_up_out.narrow(1, inner, inner);
    at::mul_out(grad_up, grad_gated, silu_gate);
    if (output_mask[1]) {
      grad_gate_up = per_expert_weight_grad(grad_gate_up_out, to_expert_order(rows, layout), layout, gate_up_w);
    }
    if (output_mask[0]) {
      grad_rows = from_expert_order(per_expert_mm(grad_gate_up_out, gate_up_w, layout, true), layout);
    }
  }
  return {grad_rows, grad_gate_up, grad_down};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_meta(const at::Tensor& rows,
                                                                        const at::Tensor& counts,
                                                                        const at::Tensor& gate_up_proj,
                                                                        const at::Tensor& down_proj) {
  check_args(rows, counts, gate_up_proj, down_proj);
  const auto n = rows.sym_size(0);
  return {at::empty_symint({n, down_proj.sym_size(1)}, rows.options()),
          at::empty_symint({n, gate_up_proj.sym_size(1)}, rows.options()),
          at::empty_symint({n, down_proj.sym_size(2)}, rows.options()),
          at::empty_symint({n, down_proj.sym_size(2)}, rows.options())};
}

at::Tensor gated_experts_meta(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
                              const at::Tensor& down_proj) {
  return std::get<0>(forward_meta(rows, counts, gate_up_proj, down_proj));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& /*grad_out*/, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
    const at::Tensor& down_proj, const at::Tensor& /*gate_up_out*/, const at::Tensor& /*silu_gate*/,
    const at::Tensor& /*gated*/, std::array<bool, 3> output_mask) {
  check_args(rows, counts, gate_up_proj, down_proj);
  return {output_mask[0] ? at::empty_like(rows) : at::Tensor(),
          output_mask[1] ? at::empty_like(gate_up_proj) : at::Tensor(),
          output_mask[2] ? at::empty_like(down_proj) : at::Tensor()};
}

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, std::array<bool, 3>);

// Backward: _moe_gated_experts_backward on what _moe_gated_experts_forward kept.
struct GatedExpertsFunction : public torch::autograd::Function<GatedExpertsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& counts,
                            const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
    static const auto op = find_op<ForwardSignature>("torch_tp::_moe_gated_experts_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, gate_up_out, silu_gate, gated] = op.call(rows, counts, gate_up_proj, down_proj);
    ctx->save_for_backward({rows, counts, gate_up_proj, down_proj, gate_up_out, silu_gate, gated});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    static const auto op = find_op<BackwardSignature>("torch_tp::_moe_gated_experts_backward");
    const auto saved = ctx->get_saved_variables();
    auto [grad_rows, grad_gate_up, grad_down] =
        op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
                {ctx->needs_input_grad(0), ctx->needs_input_grad(2), ctx->needs_input_grad(3)});
    return {grad_rows, at::Tensor(), grad_gate_up, grad_down};
  }
};

at::Tensor gated_experts_autograd(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& gate_up_proj,
                                  const at::Tensor& down_proj) {
  if (!needs_autograd(rows) && !needs_autograd(gate_up_proj) && !needs_autograd(down_proj)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_gated_experts(rows, counts, gate_up_proj, down_proj);
  }
  return GatedExpertsFunction::apply(rows, counts, gate_up_proj, down_proj);
}

} // namespace

// ATen calls only, so the kernels serve both devices; ExpertParallel runs transformers' experts through the
// op on the CPU alone (NOTE [transformers' experts as one op] in torch_tp/parallel/moe.py).
TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  m.impl("moe_gated_experts", gated_experts_kernel);
  m.impl("_moe_gated_experts_forward", forward_kernel);
  m.impl("_moe_gated_experts_backward", backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("moe_gated_experts", gated_experts_kernel);
  m.impl("_moe_gated_experts_forward", forward_kernel);
  m.impl("_moe_gated_experts_backward", backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, Meta, m) {
  m.impl("moe_gated_experts", gated_experts_meta);
  m.impl("_moe_gated_experts_forward", forward_meta);
  m.impl("_moe_gated_experts_backward", backward_meta);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("moe_gated_experts", gated_experts_autograd);
  m.impl("_moe_gated_experts_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_moe_gated_experts_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
