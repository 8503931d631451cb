// HF's AllToAllEP pair (moe_token_dispatch / moe_token_combine, moe.cpp) as
// two differentiable ops, each an exchange with the pass over the (token,
// slot) rows that feeds or drains it (moe_slots.cpp has the passes):
//   _moe_slot_dispatch(hidden, order, K, tokens_per_expert)
//       = moe_dispatch(_moe_slot_rows(hidden, order, K), tokens_per_expert, by_expert=False)
//       backward: _moe_slot_dispatch_backward(grad, order, T, ..)
//               = _moe_slot_sum(moe_combine(grad, ..), order, ones [T, K])
//   _moe_slot_combine(local_out, w, order, ..) -> (out, combined)
//       combined = moe_combine(local_out, ..) [T*K, H'], out = _moe_slot_sum(combined, order, w)
//       backward: _moe_slot_combine_backward(grad_out, combined, ..)
//               = (_moe_dispatch_rows(w[order] * grad_out[order / K]), <grad_out[order / K], combined>)
// `combined` is an output so that the backward's dots have it under
// torch.compile too (a tensor made inside a kernel and saved would not be in
// the traced graph).
//
// NOTE [slot rows through the backend's buffers]
// Three of those passes only make an all-to-all's send buffer or drain its
// receive buffer: the gather of dispatch's T*K rows, the scaled gather of
// the combine backward's (which reads each grad_out row the weights' dots
// need), and the dispatch backward's unit-weight sum of what comes back.
// Where the exchange runs by pieces (NOTE [all-to-all by pieces] in
// <torch_tp/direct_collectives.h>: the torch_tp backend on one node, gloo by
// messages, NOTE [all-to-all by pieces in messages] in comm_pieces.cpp) and
// the rows are CPU float32, float64 or bfloat16, each pass runs inside the
// exchange, on each block of a piece as it goes into the backend's shared
// buffer or a message, or comes out of one: no T*K-row tensor is written or
// read for it, and no such buffer is allocated (at T*K*H*4 = 32 MiB, a fresh
// buffer's page faults cost as much as the pass); the dots are taken from
// the same reads. The rows that are a tensor as they are (the received rows,
// the rows' gradient) are gloo's messages themselves.
// The gathers write the same bytes as _moe_slot_rows and
// _moe_slot_sum_backward. The sum adds each token's K rows in the order they
// arrive (by source rank's block, each by expert; on gloo, message by message
// across the ranks) into a zeroed accumulator
// of the rows' math type (float for bfloat16, rounded once at the end), and a
// row that a block boundary splits adds its dot in two parts, where
// _moe_slot_sum and _moe_slot_sum_backward sum in slot order and in one part:
// the same terms in another order. The combine's own weighted sum stays
// _moe_slot_sum after the exchange: `combined` is kept for the backward
// anyway, and summing on arrival instead needs the zeroed accumulator and K
// scattered read-modify-writes per token, which cost what reading `combined`
// once more does. Everywhere else the compositions above run.

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/cpu_isa.h"
#include "ops/moe_layout.h"
#include "ops/row_io.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace torch_tp {
namespace {

constexpr const char* kDispatch = "torch_tp::moe_token_dispatch";
constexpr const char* kCombine = "torch_tp::moe_token_combine";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The passes of moe_slots.cpp, called below autograd.
at::Tensor slot_rows(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("torch_tp::_moe_slot_rows");
  return op.call(hidden, order, top_k);
}

at::Tensor slot_sum(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& weights) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("torch_tp::_moe_slot_sum");
  return op.call(rows, order, weights);
}

std::tuple<at::Tensor, at::Tensor> slot_sum_backward(const at::Tensor& grad_out, const at::Tensor& rows,
                                                     const at::Tensor& order, const at::Tensor& weights,
                                                     std::array<bool, 2> output_mask) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, std::array<bool, 2>)>(
      "torch_tp::_moe_slot_sum_backward");
  return op.call(grad_out, rows, order, weights, output_mask);
}

// hidden [T, H] (or a gradient of its shape) and order [T*K] int64.
void check_slot_args(const char* op, const char* arg, const at::Tensor& hidden, const at::Tensor& order) {
  check_defined(op, arg, hidden);
  check_defined(op, "order", order);
  check_dtype(op, arg, hidden, /*allow_bool=*/false);
  TORCH_CHECK(hidden.dim() == 2, op, ": ", arg, " must be [T, H], got shape ", hidden.sym_sizes());
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong, op,
              ": order must be 1-D int64 (moe_token_dispatch's), got ", order.scalar_type(), " of shape ",
              order.sym_sizes());
}

// Where the pieces path runs (NOTE [slot rows through the backend's buffers]).
bool in_pieces(const at::Tensor& rows) {
  const auto dtype = rows.scalar_type();
  return rows.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16);
}

// Every entry of order in [0, n): the pieces read rows through it unchecked.
void check_order_range(const char* op, const at::Tensor& order, int64_t n) {
  const int64_t* o = order.const_data_ptr<int64_t>();
  for (const auto i : c10::irange(order.numel())) {
    TORCH_CHECK_INDEX(o[i] >= 0 && o[i] < n, op, ": order entry ", i, " is ", o[i], ", outside [0, T*K=", n, ")");
  }
}

std::vector<int64_t> run_starts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size(), 0);
  for (size_t r = 1; r < sizes.size(); ++r) {
    starts[r] = starts[r - 1] + sizes[r - 1];
  }
  return starts;
}

// The element loops of the pieces, compiled per ISA (cpu_isa.h).
template <typename scalar_t>
struct PieceLoops {
  using IO = Io<scalar_t>;
  using T = typename IO::stored;
  using opmath_t = typename IO::opmath_t;
  struct Scale {  // to[j] = w * from[j], rounded as _moe_slot_sum_backward rounds
    static void run(T* to, const T* from, opmath_t w, int64_t n) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        to[j] = IO::store(w * IO::load(from[j]));
      }
    }
  };
  struct ScaleDot {  // Scale, and *acc += <from, with> (the weight's gradient) from the same reads
    static void run(T* to, const T* from, const T* with, opmath_t w, opmath_t* acc, int64_t n) {
      opmath_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < n; ++j) {
        const opmath_t f = IO::load(from[j]);
        to[j] = IO::store(w * f);
        dot += f * IO::load(with[j]);
      }
      *acc += dot;
    }
  };
  struct Add {  // acc[j] += from[j]
    static void run(opmath_t* acc, const T* from, int64_t n) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        acc[j] += IO::load(from[j]);
      }
    }
  };
};

// One exchange of slot rows [*, H] (NOTE [slot rows through the backend's
// buffers]). Sent: piece r is rows [send_start[r], + send_rows[r]) of either
// a contiguous tensor, or the gather row i = w[order[i]] * src[order[i] / K]
// (w null: unit), optionally adding <src[order[i] / K], with[i]> to
// dots[order[i]] on the way. Received: piece r lands at rows recv_start[r] of
// a contiguous tensor, or each of its rows i (in sorted slot order) is added
// to sum[order[i] / K].
template <typename scalar_t>
class SlotPieces final : public AllToAllPieces {
  using Loops = PieceLoops<scalar_t>;
  using T = typename Loops::T;
  using opmath_t = typename Loops::opmath_t;

 public:
  SlotPieces(int64_t h, std::vector<int64_t> send_start, std::vector<int64_t> recv_start, const int64_t* order,
             int64_t top_k)
      : h_(h),
        row_bytes_(static_cast<size_t>(h) * sizeof(T)),
        send_start_(std::move(send_start)),
        recv_start_(std::move(recv_start)),
        order_(order),
        top_k_(top_k),
        scale_(isa_entry<typename Loops::Scale>(widest_cpu_isa())),
        scale_dot_(isa_entry<typename Loops::ScaleDot>(widest_cpu_isa())),
        add_(isa_entry<typename Loops::Add>(widest_cpu_isa())) {}

  // rows contiguous, sent as they are.
  void send_rows_of(const at::Tensor& rows) {
    send_rows_ = rows;
    send_plain_ = reinterpret_cast<const char*>(rows.const_data_ptr());
  }
  void send_gather_of(const at::Tensor& src, const at::Tensor& weights) {
    gather_src_ = stored_data<scalar_t>(src);
    gather_w_ = weights.defined() ? stored_data<scalar_t>(weights) : nullptr;
  }
  // With a weighted gather: `with` [rows, H] contiguous, dots [T*K] of opmath_t, zeroed.
  void send_dots_with(const at::Tensor& with, const at::Tensor& dots) {
    dot_with_ = stored_data<scalar_t>(with);
    dots_ = dots.mutable_data_ptr<opmath_t>();
  }
  // rows contiguous, received into as they are.
  void receive_into(const at::Tensor& rows) {
    recv_rows_ = rows;
    recv_plain_ = static_cast<char*>(rows.mutable_data_ptr());
  }
  // acc [T, H] of opmath_t, zeroed.
  void receive_sum_into(const at::Tensor& acc) {
    recv_sum_ = acc.mutable_data_ptr<opmath_t>();
  }

  at::Tensor sent_piece(int64_t rank, size_t len) override {
    return piece_bytes(send_rows_, send_start_[rank], len);
  }
  at::Tensor received_piece(int64_t rank, size_t len) override {
    return piece_bytes(recv_rows_, recv_start_[rank], len);
  }

  void pack(int64_t rank, size_t offset, size_t len, void* dst) override {
    const size_t at = static_cast<size_t>(send_start_[rank]) * row_bytes_ + offset;
    if (send_plain_ != nullptr) {
      std::memcpy(dst, send_plain_ + at, len);
      return;
    }
    for_each_row(at, len, [&](int64_t i, size_t within, size_t n, size_t done) {
      const int64_t slot = order_[i];
      const T* from = gather_src_ + (slot / top_k_) * h_ + within / sizeof(T);
      T* to = reinterpret_cast<T*>(static_cast<char*>(dst) + done);
      const auto count = static_cast<int64_t>(n / sizeof(T));
      if (gather_w_ == nullptr) {
        std::memcpy(to, from, n);
      } else if (dots_ == nullptr) {
        scale_(to, from, Io<scalar_t>::load(gather_w_[slot]), count);
      } else {  // a row split over two calls adds its dot in two parts
        scale_dot_(to, from, dot_with_ + i * h_ + within / sizeof(T), Io<scalar_t>::load(gather_w_[slot]),
                   dots_ + slot, count);
      }
    });
  }

  void unpack(int64_t rank, size_t offset, size_t len, const void* src) override {
    const size_t at = static_cast<size_t>(recv_start_[rank]) * row_bytes_ + offset;
    if (recv_plain_ != nullptr) {
      std::memcpy(recv_plain_ + at, src, len);
      return;
    }
    for_each_row(at, len, [&](int64_t i, size_t within, size_t n, size_t done) {
      opmath_t* acc = recv_sum_ + (order_[i] / top_k_) * h_ + within / sizeof(T);
      add_(acc, reinterpret_cast<const T*>(static_cast<const char*>(src) + done), static_cast<int64_t>(n / sizeof(T)));
    });
  }

 private:
  // Bytes [0, len) of the piece from row `start` of contiguous rows, as uint8; undefined for no rows.
  at::Tensor piece_bytes(const at::Tensor& rows, int64_t start, size_t len) const {
    if (!rows.defined()) {
      return {};
    }
    return rows.view({-1}).view(at::kByte).narrow(0, start * static_cast<int64_t>(row_bytes_), static_cast<int64_t>(len));
  }

  // Bytes [at, at + len) of the rows, as f(row, byte offset within it, bytes, bytes done before).
  template <typename F>
  void for_each_row(size_t at, size_t len, F&& f) const {
    for (size_t done = 0; done < len;) {
      const size_t pos = at + done;
      const size_t within = pos % row_bytes_;
      const size_t n = std::min(len - done, row_bytes_ - within);
      f(static_cast<int64_t>(pos / row_bytes_), within, n, done);
      done += n;
    }
  }

  int64_t h_;
  size_t row_bytes_;
  std::vector<int64_t> send_start_, recv_start_;
  const int64_t* order_;
  int64_t top_k_;
  void (*scale_)(T*, const T*, opmath_t, int64_t);
  void (*scale_dot_)(T*, const T*, const T*, opmath_t, opmath_t*, int64_t);
  void (*add_)(opmath_t*, const T*, int64_t);
  at::Tensor send_rows_, recv_rows_;  // the sides that are tensors' rows as they are
  const char* send_plain_ = nullptr;
  const T* gather_src_ = nullptr;
  const T* gather_w_ = nullptr;
  const T* dot_with_ = nullptr;
  opmath_t* dots_ = nullptr;
  char* recv_plain_ = nullptr;
  opmath_t* recv_sum_ = nullptr;
};

// The split sizes of the slot rows: `sorted` [p] (the sender's T*K rows by
// owner), `received` [p] (the rows from each rank).
struct SlotSplits {
  std::vector<int64_t> sorted, received;
};

SlotSplits slot_splits(const at::Tensor& tpe_host, const at::Tensor& recv_host, int64_t world_size) {
  return {row_sums(tpe_host.view({world_size, -1})), row_sums(recv_host)};
}

// --------------------------------------------------------------- kernels

std::tuple<at::Tensor, at::Tensor, at::Tensor> slot_dispatch_kernel(const at::Tensor& hidden, const at::Tensor& order,
                                                                    int64_t top_k, const at::Tensor& tokens_per_expert,
                                                                    c10::string_view group_name) {
  constexpr const char* op = kDispatch;
  check_slot_args(op, "hidden", hidden, order);
  TORCH_CHECK(top_k >= 1 && order.size(0) == hidden.size(0) * top_k, op, ": order has ", order.size(0),
              " entries but hidden has T=", hidden.size(0), " rows of top_k=", top_k, " slots");
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, hidden, tokens_per_expert, world_size);
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  const at::Tensor recv_counts = exchange_counts(op, group, tokens_per_expert, local);
  const at::Tensor recv_host = recv_counts.to(at::kCPU).contiguous();
  const SlotSplits splits = slot_splits(tpe_host, recv_host, world_size);
  at::Tensor local_tokens;
  if (in_pieces(hidden)) {
    const at::Tensor h = hidden.contiguous();
    const at::Tensor o = order.contiguous();
    check_order_range(op, o, o.numel());
    at::Tensor received = at::empty({c10::sum_integers(splits.received), h.size(1)}, h.options());
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), op, [&] {
      SlotPieces<scalar_t> pieces(h.size(1), run_starts(splits.sorted), run_starts(splits.received),
                                  o.const_data_ptr<int64_t>(), top_k);
      pieces.send_gather_of(h, at::Tensor());
      pieces.receive_into(received);
      if (all_to_all_pieces(op, group, h, splits.sorted, splits.received, pieces)) {
        local_tokens = received;
      }
    });
  }
  if (!local_tokens.defined()) {
    local_tokens = dispatch_rows(op, group, slot_rows(hidden, order, top_k), tpe_host, recv_host, false);
  }
  return {local_tokens, recv_counts.sum(0), recv_counts};
}

at::Tensor slot_dispatch_backward_kernel(const at::Tensor& grad, const at::Tensor& order, c10::SymInt tokens,
                                         const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                                         c10::string_view group_name) {
  constexpr const char* op = kDispatch;
  check_slot_args(op, "grad_local_tokens", grad, order);
  const int64_t t = tokens.expect_int();
  TORCH_CHECK(t >= 0 && (t == 0 ? order.size(0) == 0 : order.size(0) % t == 0), op, ": order has ", order.size(0),
              " entries, not a multiple of T=", t);
  const int64_t top_k = t == 0 ? 1 : order.size(0) / t;
  const auto group = resolve_group(op, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, grad, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, grad.size(0), "the rows' gradient size(0)");
  const SlotSplits splits = slot_splits(tpe_host, recv_host, world_size);
  if (in_pieces(grad)) {
    const at::Tensor g = grad.contiguous();
    const at::Tensor o = order.contiguous();
    check_order_range(op, o, o.numel());
    const auto math = at::toOpMathType(g.scalar_type());
    at::Tensor sum = at::zeros({t, g.size(1)}, g.options().dtype(math));
    bool done = false;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), op, [&] {
      // Back the way dispatch came: this rank's received rows to their senders.
      SlotPieces<scalar_t> pieces(g.size(1), run_starts(splits.received), run_starts(splits.sorted),
                                  o.const_data_ptr<int64_t>(), top_k);
      pieces.send_rows_of(g);
      pieces.receive_sum_into(sum);
      done = all_to_all_pieces(op, group, g, splits.received, splits.sorted, pieces);
    });
    if (done) {
      return math == g.scalar_type() ? sum : sum.to(g.scalar_type());
    }
  }
  const at::Tensor combined = combine_rows(op, group, grad, tpe_host, recv_host, false);
  return slot_sum(combined, order, at::ones({t, top_k}, combined.options()));
}

// local_out [R, H'] and top_k_weights [T, K] of its dtype; returns the group.
c10::intrusive_ptr<c10d::ProcessGroup> check_combine_args(const at::Tensor& local_out, const at::Tensor& weights,
                                                          const at::Tensor& order, c10::string_view group_name) {
  constexpr const char* op = kCombine;
  check_slot_args(op, "local_out", local_out, order);
  check_defined(op, "top_k_weights", weights);
  TORCH_CHECK(weights.dim() == 2, op, ": top_k_weights must be [T, K], got shape ", weights.sym_sizes());
  TORCH_CHECK(weights.scalar_type() == local_out.scalar_type(), op, ": top_k_weights (", weights.scalar_type(),
              ") must have local_out's dtype (", local_out.scalar_type(), ")");
  TORCH_SYM_CHECK(order.sym_size(0).sym_eq(weights.sym_numel()), op, ": top_k_weights has shape ",
                  weights.sym_sizes(), " (T*K=", weights.sym_numel(), ") but order has ", order.sym_size(0),
                  " entries (moe_token_dispatch's T*K)");
  return resolve_group(op, group_name);
}

std::tuple<at::Tensor, at::Tensor> slot_combine_kernel(const at::Tensor& local_out, const at::Tensor& weights,
                                                       const at::Tensor& order, const at::Tensor& tokens_per_expert,
                                                       const at::Tensor& recv_counts, c10::string_view group_name) {
  constexpr const char* op = kCombine;
  const auto group = check_combine_args(local_out, weights, order, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, local_out, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, local_out.size(0), "local_out.size(0)");
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  at::Tensor combined = combine_rows(op, group, local_out, tpe_host, recv_host, false);
  at::Tensor out = slot_sum(combined, order, weights);
  return {std::move(out), std::move(combined)};
}

std::tuple<at::Tensor, at::Tensor> slot_combine_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& combined, const at::Tensor& order, const at::Tensor& weights,
    const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts, c10::string_view group_name,
    c10::SymInt local_rows, bool weights_grad) {
  constexpr const char* op = kCombine;
  const auto group = check_combine_args(combined, weights, order, group_name);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == weights.size(0) && grad_out.size(1) == combined.size(1) &&
                  grad_out.scalar_type() == combined.scalar_type(),
              op, ": the output gradient has shape ", grad_out.sizes(), " and dtype ", grad_out.scalar_type(),
              "; expected [", weights.size(0), ", ", combined.size(1), "] of ", combined.scalar_type());
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, combined, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, local_rows.expect_int(), "local_out.size(0)");
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  const SlotSplits splits = slot_splits(tpe_host, recv_host, world_size);
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor w = weights.contiguous();
  at::Tensor grad_local, grad_w;
  if (in_pieces(g)) {
    const at::Tensor o = order.contiguous();
    const at::Tensor c = combined.contiguous();
    check_order_range(op, o, o.numel());
    TORCH_CHECK(c.size(0) == o.numel(), op, ": ", c.size(0), " combined rows but order has ", o.numel(), " entries");
    at::Tensor received = at::empty({c10::sum_integers(splits.received), g.size(1)}, g.options());
    at::Tensor dots = weights_grad ? at::zeros({w.numel()}, w.options().dtype(at::toOpMathType(w.scalar_type())))
                                   : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), op, [&] {
      SlotPieces<scalar_t> pieces(g.size(1), run_starts(splits.sorted), run_starts(splits.received),
                                  o.const_data_ptr<int64_t>(), w.size(1));
      pieces.send_gather_of(g, w);
      if (weights_grad) {
        pieces.send_dots_with(c, dots);
      }
      pieces.receive_into(received);
      if (all_to_all_pieces(op, group, g, splits.sorted, splits.received, pieces)) {
        grad_local = received;
      }
    });
    if (grad_local.defined() && weights_grad) {
      grad_w = dots.view(w.sizes()).to(w.scalar_type());
    }
  }
  if (!grad_local.defined()) {
    auto [grad_rows, grad_weights] = slot_sum_backward(g, combined, order, w, {true, weights_grad});
    grad_local = dispatch_rows(op, group, grad_rows, tpe_host, recv_host, false);
    grad_w = grad_weights;
  }
  return {grad_local, grad_w};
}

// --------------------------------------------------------------- Meta (no data-dependent size but dispatch's)

at::Tensor slot_dispatch_backward_meta(const at::Tensor& grad, const at::Tensor& order, c10::SymInt tokens,
                                       const at::Tensor& /*tokens_per_expert*/, const at::Tensor& /*recv_counts*/,
                                       c10::string_view /*group_name*/) {
  check_slot_args(kDispatch, "grad_local_tokens", grad, order);
  return at::empty_symint({std::move(tokens), grad.sym_size(1)}, grad.options());
}

std::tuple<at::Tensor, at::Tensor> slot_combine_meta(const at::Tensor& local_out, const at::Tensor& weights,
                                                     const at::Tensor& order, const at::Tensor& /*tokens_per_expert*/,
                                                     const at::Tensor& /*recv_counts*/, c10::string_view group_name) {
  check_combine_args(local_out, weights, order, group_name);
  return {at::empty_symint({weights.sym_size(0), local_out.sym_size(1)}, local_out.options()),
          at::empty_symint({order.sym_size(0), local_out.sym_size(1)}, local_out.options())};
}

std::tuple<at::Tensor, at::Tensor> slot_combine_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& combined, const at::Tensor& order, const at::Tensor& weights,
    const at::Tensor& /*tokens_per_expert*/, const at::Tensor& /*recv_counts*/, c10::string_view group_name,
    c10::SymInt local_rows, bool weights_grad) {
  check_combine_args(combined, weights, order, group_name);
  return {at::empty_symint({std::move(local_rows), combined.sym_size(1)}, grad_out.options()),
          weights_grad ? at::empty_like(weights) : at::Tensor()};
}

// --------------------------------------------------------------- autograd

using DispatchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using DispatchSignature = DispatchOut(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                      c10::string_view);
using CombineOut = std::tuple<at::Tensor, at::Tensor>;
using CombineSignature = CombineOut(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, c10::string_view);

DispatchOut slot_dispatch(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k,
                          const at::Tensor& tokens_per_expert, c10::string_view group_name) {
  static const auto op = find_op<DispatchSignature>("torch_tp::_moe_slot_dispatch");
  return op.call(hidden, order, top_k, tokens_per_expert, group_name);
}

CombineOut slot_combine(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
                        const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                        c10::string_view group_name) {
  static const auto op = find_op<CombineSignature>("torch_tp::_moe_slot_combine");
  return op.call(local_out, weights, order, tokens_per_expert, recv_counts, group_name);
}

// Backward: _moe_slot_dispatch_backward of the rows' gradient.
struct SlotDispatchFunction : public torch::autograd::Function<SlotDispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& order,
                               int64_t top_k, const at::Tensor& tokens_per_expert, const std::string& group_name) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [local_tokens, local_tpe, recv_counts] = slot_dispatch(hidden, order, top_k, tokens_per_expert, group_name);
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["tokens"] = hidden.sym_size(0);
    ctx->save_for_backward({order, tokens_per_expert, recv_counts});
    ctx->mark_non_differentiable({local_tpe, recv_counts});
    ctx->set_materialize_grads(false);  // the counts have no gradient: no zeros for them
    return {local_tokens, local_tpe, recv_counts};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, const at::Tensor&,
                                              const at::Tensor&, c10::string_view)>("torch_tp::_moe_slot_dispatch_backward");
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_hidden;
    if (grads[0].defined()) {
      grad_hidden = op.call(grads[0].contiguous(), saved[0], ctx->saved_data["tokens"].toSymInt(), saved[1], saved[2],
                            ctx->saved_data["group_name"].toStringRef());
    }
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

DispatchOut slot_dispatch_autograd(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k,
                                   const at::Tensor& tokens_per_expert, c10::string_view group_name) {
  if (!needs_autograd(hidden)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return slot_dispatch(hidden, order, top_k, tokens_per_expert, group_name);
  }
  auto out = SlotDispatchFunction::apply(hidden, order, top_k, tokens_per_expert, std::string(group_name));
  return {out[0], out[1], out[2]};
}

// Backward: _moe_slot_combine_backward, from the saved `combined`.
struct SlotCombineFunction : public torch::autograd::Function<SlotCombineFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& local_out, const at::Tensor& weights,
                               const at::Tensor& order, const at::Tensor& tokens_per_expert,
                               const at::Tensor& recv_counts, const std::string& group_name) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, combined] = slot_combine(local_out, weights, order, tokens_per_expert, recv_counts, group_name);
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["local_rows"] = local_out.sym_size(0);
    ctx->save_for_backward({combined, order, weights, tokens_per_expert, recv_counts});
    ctx->mark_non_differentiable({combined});
    // `combined` has no gradient; materialized, it would be a zeroed [T*K, H'].
    ctx->set_materialize_grads(false);
    return {out, combined};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        find_op<CombineOut(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, c10::string_view, c10::SymInt, bool)>(
            "torch_tp::_moe_slot_combine_backward");
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    auto [grad_local, grad_w] =
        op.call(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4],
                ctx->saved_data["group_name"].toStringRef(), ctx->saved_data["local_rows"].toSymInt(),
                ctx->needs_input_grad(1));
    return {grad_local, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

CombineOut slot_combine_autograd(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
                                 const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                                 c10::string_view group_name) {
  if (!needs_autograd(local_out) && !needs_autograd(weights)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return slot_combine(local_out, weights, order, tokens_per_expert, recv_counts, group_name);
  }
  auto out = SlotCombineFunction::apply(local_out, weights, order, tokens_per_expert, recv_counts,
                                        std::string(group_name));
  return {out[0], out[1]};
}

void impl_device_kernels(torch::Library& m) {
  m.impl("_moe_slot_dispatch", slot_dispatch_kernel);
  m.impl("_moe_slot_dispatch_backward", slot_dispatch_backward_kernel);
  m.impl("_moe_slot_combine", slot_combine_kernel);
  m.impl("_moe_slot_combine_backward", slot_combine_backward_kernel);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  impl_device_kernels(m);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  impl_device_kernels(m);
}

// _moe_slot_dispatch's fake kernel is in torch_tp/ops.py (its rows are a data-dependent size).
TORCH_LIBRARY_IMPL(torch_tp, Meta, m) {
  m.impl("_moe_slot_dispatch_backward", slot_dispatch_backward_meta);
  m.impl("_moe_slot_combine", slot_combine_meta);
  m.impl("_moe_slot_combine_backward", slot_combine_backward_meta);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("_moe_slot_dispatch", slot_dispatch_autograd);
  m.impl("_moe_slot_combine", slot_combine_autograd);
  m.impl("_moe_slot_dispatch_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_moe_slot_combine_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
