// HF's AllToAllEP pair (moe_token_dispatch / moe_token_combine, moe.cpp) as
// two differentiable ops, each an exchange with the passes over the (token,
// slot) rows that feed or drain it (moe_slots.cpp has the passes):
//   _moe_slot_dispatch(hidden, order, K, tokens_per_expert)
//       = moe_dispatch(_moe_slot_rows(hidden, order, K), tokens_per_expert, by_expert=False)
//       backward: _moe_slot_dispatch_backward(grad, order, T, ..)
//               = _moe_slot_sum(moe_combine(grad, ..), order, ones [T, K])
//   _moe_slot_combine(local_out, w, order, ..) [R, H'] -> out [T, H']
//       = _moe_slot_sum(moe_combine(local_out, ..), order, w)
//       backward: _moe_slot_combine_backward(grad_out, local_out, ..), where
//       g = _moe_dispatch_rows(_moe_slot_rows(grad_out, order, K)) [R, H'] is
//       each expert row's token gradient and w_r = _moe_dispatch_rows(w[order]) [R]
//       its weight: grad_local_out = w_r * g, and the weights' gradient
//       <g, local_out> [R] goes back the way the rows came (moe_combine) to
//       grad_w[order[i]].
// The weights' dots are taken where the expert rows are, against local_out,
// and their R values come back in a small exchange (w_r goes out in
// another): so the combine keeps no [T*K, H'] copy of the rows it received,
// and its forward folds them into the weighted sum as they arrive.
//
// NOTE [slot rows through the backend's buffers]
// Five of those passes only make an all-to-all's send buffer or drain its
// receive buffer: the gathers of dispatch's T*K rows and of the combine
// backward's grad_out rows, the sums of what arrives (the combine's weighted
// by w, the dispatch backward's with unit weights), and the combine
// backward's scaling by w_r with the dots against local_out. Where the
// exchange runs by pieces (NOTE [all-to-all by pieces] in
// <torch_tp/direct_collectives.h>: the torch_tp backend on one node, gloo by
// messages, NOTE [all-to-all by pieces in messages] in comm_pieces.cpp) and
// the rows are CPU float32, float64 or bfloat16, each pass runs inside the
// exchange, on each block of a piece as it goes into the backend's shared
// buffer or a message, or comes out of one: no T*K-row tensor is written or
// read for it, and no such buffer is allocated (at T*K*H*4 = 32 MiB, a fresh
// buffer's page faults cost as much as the pass). The rows that are a tensor
// as they are (local_out, the dispatched rows, their gradient) are gloo's
// messages themselves, and so are the combine backward's received rows: gloo
// receives them into grad_local_out as they are, and the scaling with the
// dots is one pass after (finish_scaled), since an exchange that packs and
// unpacks messages on both sides costs more there than that pass. The
// values that go with the rows (w_r, the dots) go the same way, one value
// per row (exchange_values). The gathers and the scaling write the same bytes as
// _moe_slot_rows and w_r * g. The sums add each token's K rows in the order
// they arrive (by source rank's block, each by expert; on gloo, message by
// message across the ranks) into a zeroed accumulator of the rows' math type
// (float for bfloat16, rounded once at the end), and a row that a block
// boundary splits adds its dot in two parts, where _moe_slot_sum sums in slot
// order and a dot is one sum: the same terms in another order. Everywhere
// else the compositions above run.

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
  struct Scale {  // to[j] = w * from[j]
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
  struct AddScaled {  // acc[j] += w * from[j]
    static void run(opmath_t* acc, const T* from, opmath_t w, int64_t n) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        acc[j] += w * IO::load(from[j]);
      }
    }
  };
};

// One exchange of slot rows [*, H] (NOTE [slot rows through the backend's
// buffers]). Sent: piece r is rows [send_start[r], + send_rows[r]) of either
// a contiguous tensor, or the gather row i = src[order[i] / K]. Received:
// piece r's rows land at rows recv_start[r] of a contiguous tensor, or each
// of its rows i (in sorted slot order) is added to sum[order[i] / K], weighted
// by w[order[i]] where weights are given, or each of its rows i is written
// scaled, to[i] = scale[i] * row, optionally adding <row, with[i]> to dots[i].
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
        add_(isa_entry<typename Loops::Add>(widest_cpu_isa())),
        add_scaled_(isa_entry<typename Loops::AddScaled>(widest_cpu_isa())) {}

  // rows contiguous, sent as they are.
  void send_rows_of(const at::Tensor& rows) {
    send_rows_ = rows;
    send_plain_ = reinterpret_cast<const char*>(rows.const_data_ptr());
  }
  // src [T, H] contiguous.
  void send_gather_of(const at::Tensor& src) {
    gather_src_ = stored_data<scalar_t>(src);
  }
  // rows contiguous, received into as they are.
  void receive_into(const at::Tensor& rows) {
    recv_rows_ = rows;
    recv_plain_ = static_cast<char*>(rows.mutable_data_ptr());
  }
  // acc [T, H] of opmath_t, zeroed; weights [T, K] contiguous, or undefined for unit weights.
  void receive_sum_into(const at::Tensor& acc, const at::Tensor& weights) {
    recv_sum_ = acc.mutable_data_ptr<opmath_t>();
    sum_w_ = weights.defined() ? stored_data<scalar_t>(weights) : nullptr;
  }
  // to [R, H] contiguous, scale [R]; with [R, H] contiguous and dots [R] of opmath_t, zeroed, or both undefined.
  // A backend that moves tensors receives into `to` as it is; finish_scaled() then scales it in place.
  void receive_scaled_into(const at::Tensor& to, const at::Tensor& scale, const at::Tensor& with,
                           const at::Tensor& dots) {
    recv_rows_ = to;
    recv_scaled_ = mutable_stored_data<scalar_t>(to);
    recv_scale_ = stored_data<scalar_t>(scale);
    if (with.defined()) {
      dot_with_ = stored_data<scalar_t>(with);
      dots_ = dots.mutable_data_ptr<opmath_t>();
    }
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
      std::memcpy(static_cast<char*>(dst) + done,
                  reinterpret_cast<const char*>(gather_src_ + (order_[i] / top_k_) * h_) + within, n);
    });
  }

  // After a receive_scaled_into exchange of `rows` rows: where they were received as they are (no unpack),
  // scale them in place and take their dots now.
  void finish_scaled(int64_t rows) {
    if (unpacked_bytes_ > 0) {
      TORCH_INTERNAL_ASSERT(unpacked_bytes_ == static_cast<size_t>(rows) * row_bytes_, kCombine,
                            ": the backend unpacked only part of the rows");
      return;
    }
    for (const auto i : c10::irange(rows)) {
      scale_row(i, 0, recv_scaled_ + i * h_, h_);
    }
  }

  void unpack(int64_t rank, size_t offset, size_t len, const void* src) override {
    const size_t at = static_cast<size_t>(recv_start_[rank]) * row_bytes_ + offset;
    if (recv_plain_ != nullptr) {
      std::memcpy(recv_plain_ + at, src, len);
      return;
    }
    for_each_row(at, len, [&](int64_t i, size_t within, size_t n, size_t done) {
      const T* from = reinterpret_cast<const T*>(static_cast<const char*>(src) + done);
      const auto count = static_cast<int64_t>(n / sizeof(T));
      const size_t col = within / sizeof(T);
      if (recv_scaled_ != nullptr) {
        scale_row(i, col, from, count);
        unpacked_bytes_ += n;
        return;
      }
      const int64_t slot = order_[i];
      opmath_t* acc = recv_sum_ + (slot / top_k_) * h_ + col;
      if (sum_w_ == nullptr) {
        add_(acc, from, count);
      } else {
        add_scaled_(acc, from, Io<scalar_t>::load(sum_w_[slot]), count);
      }
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

  // Columns [col, col + count) of received row i from `from` (which may be that row itself):
  // to[i] = scale[i] * from, dots[i] += <from, with[i]>. A row split over two calls adds its dot in two parts.
  void scale_row(int64_t i, size_t col, const T* from, int64_t count) {
    const opmath_t w = Io<scalar_t>::load(recv_scale_[i]);
    if (dots_ == nullptr) {
      scale_(recv_scaled_ + i * h_ + col, from, w, count);
    } else {
      scale_dot_(recv_scaled_ + i * h_ + col, from, dot_with_ + i * h_ + col, w, dots_ + i, count);
    }
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
  void (*add_scaled_)(opmath_t*, const T*, opmath_t, int64_t);
  at::Tensor send_rows_, recv_rows_;  // the sides that are tensors' rows as they are
  const char* send_plain_ = nullptr;
  const T* gather_src_ = nullptr;
  char* recv_plain_ = nullptr;
  opmath_t* recv_sum_ = nullptr;
  const T* sum_w_ = nullptr;
  T* recv_scaled_ = nullptr;
  const T* recv_scale_ = nullptr;
  const T* dot_with_ = nullptr;
  opmath_t* dots_ = nullptr;
  size_t unpacked_bytes_ = 0;
};

// The split sizes of the slot rows: `sorted` [p] (the sender's T*K rows by
// owner), `received` [p] (the rows from each rank).
struct SlotSplits {
  std::vector<int64_t> sorted, received;
};

SlotSplits slot_splits(const at::Tensor& tpe_host, const at::Tensor& recv_host, int64_t world_size) {
  return {row_sums(tpe_host.view({world_size, -1})), row_sums(recv_host)};
}

// The combine backward's 1-D tensors of values, one per slot row, sent as the
// rows are: `send` [p] of them to each rank, `recv` [p] from each. By pieces
// where the rows go by pieces, so that a failing peer is reported as for the
// rows (comm_pieces.cpp names it on gloo); else start_all_to_all.
at::Tensor exchange_values(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& values,
                           const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  if (in_pieces(values)) {
    const at::Tensor v = values.contiguous();
    at::Tensor got = at::empty({c10::sum_integers(recv)}, v.options());
    bool done = false;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, v.scalar_type(), kCombine, [&] {
      SlotPieces<scalar_t> pieces(1, run_starts(send), run_starts(recv), nullptr, 1);
      pieces.send_rows_of(v);
      pieces.receive_into(got);
      done = all_to_all_pieces(kCombine, group, v.view({-1, 1}), send, recv, pieces);
    });
    if (done) {
      return got;
    }
  }
  return start_all_to_all(kCombine, group, false, values, recv, send).wait();
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
      pieces.send_gather_of(h);
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
      pieces.receive_sum_into(sum, at::Tensor());
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

at::Tensor slot_combine_kernel(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
                               const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                               c10::string_view group_name) {
  constexpr const char* op = kCombine;
  const auto group = check_combine_args(local_out, weights, order, group_name);
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, local_out, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, local_out.size(0), "local_out.size(0)");
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  if (in_pieces(local_out)) {
    const SlotSplits splits = slot_splits(tpe_host, recv_host, world_size);
    const at::Tensor rows = local_out.contiguous();
    const at::Tensor o = order.contiguous();
    const at::Tensor w = weights.contiguous();
    check_order_range(op, o, o.numel());
    const auto math = at::toOpMathType(rows.scalar_type());
    at::Tensor sum = at::zeros({w.size(0), rows.size(1)}, rows.options().dtype(math));
    bool done = false;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, rows.scalar_type(), op, [&] {
      // Back the way dispatch came, each arriving row added to its token's sum.
      SlotPieces<scalar_t> pieces(rows.size(1), run_starts(splits.received), run_starts(splits.sorted),
                                  o.const_data_ptr<int64_t>(), w.size(1));
      pieces.send_rows_of(rows);
      pieces.receive_sum_into(sum, w);
      done = all_to_all_pieces(op, group, rows, splits.received, splits.sorted, pieces);
    });
    if (done) {
      return math == rows.scalar_type() ? sum : sum.to(rows.scalar_type());
    }
  }
  return slot_sum(combine_rows(op, group, local_out, tpe_host, recv_host, false), order, weights);
}

std::tuple<at::Tensor, at::Tensor> slot_combine_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& local_out, const at::Tensor& order, const at::Tensor& weights,
    const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts, c10::string_view group_name,
    bool weights_grad) {
  constexpr const char* op = kCombine;
  const auto group = check_combine_args(local_out, weights, order, group_name);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == weights.size(0) && grad_out.size(1) == local_out.size(1) &&
                  grad_out.scalar_type() == local_out.scalar_type(),
              op, ": the output gradient has shape ", grad_out.sizes(), " and dtype ", grad_out.scalar_type(),
              "; expected [", weights.size(0), ", ", local_out.size(1), "] of ", local_out.scalar_type());
  const int64_t world_size = group->getSize();
  const int64_t local = check_dispatch_args(op, local_out, tokens_per_expert, world_size);
  check_recv_counts(op, recv_counts, world_size, local);
  const at::Tensor recv_host = host_counts(op, "recv_counts", recv_counts, local_out.size(0), "local_out.size(0)");
  const at::Tensor tpe_host = host_counts(op, "tokens_per_expert", tokens_per_expert, order.size(0), "T*K");
  const SlotSplits splits = slot_splits(tpe_host, recv_host, world_size);
  const int64_t top_k = weights.size(1);
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor o = order.contiguous();
  // w_r [R]: each expert row's weight, sent the way its token row went.
  const at::Tensor w_rows = exchange_values(group, weights.reshape({-1}).index_select(0, o), splits.sorted,
                                            splits.received);
  at::Tensor grad_local, dots;  // dots [R]: <g, local_out> per expert row
  if (in_pieces(g)) {
    const at::Tensor lo = local_out.contiguous();
    check_order_range(op, o, o.numel());
    at::Tensor scaled = at::empty_like(lo, at::MemoryFormat::Contiguous);
    at::Tensor row_dots = weights_grad ? at::zeros({lo.size(0)}, lo.options().dtype(at::toOpMathType(lo.scalar_type())))
                                       : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), op, [&] {
      SlotPieces<scalar_t> pieces(g.size(1), run_starts(splits.sorted), run_starts(splits.received),
                                  o.const_data_ptr<int64_t>(), top_k);
      pieces.send_gather_of(g);
      pieces.receive_scaled_into(scaled, w_rows, weights_grad ? lo : at::Tensor(), row_dots);
      if (all_to_all_pieces(op, group, g, splits.sorted, splits.received, pieces)) {
        pieces.finish_scaled(lo.size(0));
        grad_local = scaled;
        dots = row_dots;
      }
    });
  }
  if (!grad_local.defined()) {
    const at::Tensor g_rows = dispatch_rows(op, group, slot_rows(g, o, top_k), tpe_host, recv_host, false);
    grad_local = g_rows * w_rows.unsqueeze(1);
    if (weights_grad) {
      dots = (g_rows * local_out).sum(1);
    }
  }
  at::Tensor grad_w;
  if (weights_grad) {
    // The dots back to the tokens' ranks, in sorted slot order, then to [T, K].
    const at::Tensor sorted_dots = exchange_values(group, dots, splits.received, splits.sorted);
    grad_w = at::empty({o.numel()}, sorted_dots.options())
                 .index_copy_(0, o, sorted_dots)
                 .view(weights.sizes())
                 .to(weights.scalar_type());
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

at::Tensor slot_combine_meta(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
                             const at::Tensor& /*tokens_per_expert*/, const at::Tensor& /*recv_counts*/,
                             c10::string_view group_name) {
  check_combine_args(local_out, weights, order, group_name);
  return at::empty_symint({weights.sym_size(0), local_out.sym_size(1)}, local_out.options());
}

std::tuple<at::Tensor, at::Tensor> slot_combine_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& local_out, const at::Tensor& order, const at::Tensor& weights,
    const at::Tensor& /*tokens_per_expert*/, const at::Tensor& /*recv_counts*/, c10::string_view group_name,
    bool weights_grad) {
  check_combine_args(local_out, weights, order, group_name);
  return {at::empty_like(local_out, grad_out.options()), weights_grad ? at::empty_like(weights) : at::Tensor()};
}

// --------------------------------------------------------------- autograd

using DispatchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using DispatchSignature = DispatchOut(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                      c10::string_view);
using CombineSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, c10::string_view);

DispatchOut slot_dispatch(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k,
                          const at::Tensor& tokens_per_expert, c10::string_view group_name) {
  static const auto op = find_op<DispatchSignature>("torch_tp::_moe_slot_dispatch");
  return op.call(hidden, order, top_k, tokens_per_expert, group_name);
}

at::Tensor slot_combine(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
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

// Backward: _moe_slot_combine_backward, against the saved local_out.
struct SlotCombineFunction : public torch::autograd::Function<SlotCombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local_out, const at::Tensor& weights,
                            const at::Tensor& order, const at::Tensor& tokens_per_expert,
                            const at::Tensor& recv_counts, const std::string& group_name) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["group_name"] = group_name;
    ctx->save_for_backward({local_out, order, weights, tokens_per_expert, recv_counts});
    return slot_combine(local_out, weights, order, tokens_per_expert, recv_counts, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   c10::string_view, bool)>("torch_tp::_moe_slot_combine_backward");
    const auto saved = ctx->get_saved_variables();
    auto [grad_local, grad_w] = op.call(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4],
                                        ctx->saved_data["group_name"].toStringRef(), ctx->needs_input_grad(1));
    return {grad_local, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor slot_combine_autograd(const at::Tensor& local_out, const at::Tensor& weights, const at::Tensor& order,
                                 const at::Tensor& tokens_per_expert, const at::Tensor& recv_counts,
                                 c10::string_view group_name) {
  if (!needs_autograd(local_out) && !needs_autograd(weights)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return slot_combine(local_out, weights, order, tokens_per_expert, recv_counts, group_name);
  }
  return SlotCombineFunction::apply(local_out, weights, order, tokens_per_expert, recv_counts,
                                    std::string(group_name));
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
