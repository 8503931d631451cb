// torch_tp::vocab_parallel_cross_entropy: F.cross_entropy of logits sharded
// on the class dim, one all-gather forward and no communication backward,
// fused on the CPU. loss_parallel (torch_tp/parallel/loss.py) runs
// F.cross_entropy on a class-sharded DTensor through it.
//
// NOTE [vocab-parallel cross entropy]
// Rank r holds x_r = x[.., s_r : s_r + n_r], its torch.chunk piece of the V
// classes (class dim last). With m = max_c x_c, S = sum_c exp(x_c - m):
//
//     loss = log S - (x_t - m)          t: the target class
//
// forward:  m_r = max x_r,  S_r = sum exp(x_r - m_r)   (-inf and 0 on a rank holding no classes)
//           all_gather([m_r, S_r, x_t if s_r <= t < s_r + n_r else 0])      [p, 3, rows], one call
//           m = max_r m_r,  S = sum_r S_r exp(m_r - m),  x_t = the sum over r (one rank holds it)
// backward: d loss / d x_r = softmax(x)_r - onehot(t)_r = exp(x_r - m) / S - onehot
//           with the global m and S saved from forward: no communication.
//
// One collective forward (Megatron's vocab-parallel cross entropy has three
// all-reduces: the max, the sum of exp, the target logit), none backward.
// Each rank sums against its own max and the sums are rescaled to the global
// one after the gather, so no max has to be agreed on first. The shifts are
// by exact maxima, as in torch's loss_parallel and the unsharded loss: a
// shift by a rounded log-sum-exp instead (|L| ~ 20 at V = 128K) costs the
// softmax an order of magnitude of accuracy. A row whose local max is +-inf
// (masked classes) is shifted by 0, so its sum is 0, not nan. Rows count with
// their weight w_t = weight[t] (1 without weight) and 0 when t ==
// ignore_index; "mean" divides by sum(w_t), as F.cross_entropy does (0/0, nan,
// when every target is ignored), and its gradient is 0 on rows of weight 0.
//
// NOTE [fused cross entropy on the CPU]
// At the example model's size (256 rows of 128 classes per rank, float32)
// the loss is all per-call cost: as ~90 ATen ops and two autograd Functions
// in Python it took 378 us forward and backward, against 60 us for the
// unsharded F.cross_entropy of [256, 256] (AMD EPYC, one thread). Here, for
// float32, float64 and bfloat16 on the CPU, each pass over the shard is a
// loop that converts and shifts a row into a buffer of opmath_t, one
// at::exp_ over the buffer (ATen's vectorised exp, the one the composition
// ran) and a loop that sums the row (in double) or writes its gradient; the
// arithmetic per row around them (row weights and the target check,
// combining the ranks' statistics, the reduction) is plain loops. The
// buffer holds a chunk of ~1 MiB of rows (kChunkElements), so it stays in
// cache and the logits are read from memory once per pass however large
// the vocabulary. Other devices and float16 run the same formulas as a
// composition of ATen ops (the *_composite functions).

#include "ops/cross_entropy.h"

#include "ops/comm.h"
#include "ops/common.h"
#include "ops/row_io.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace torch_tp {

CrossEntropyArgs check_cross_entropy_args(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                          c10::string_view group_name, int64_t num_classes,
                                          const std::optional<at::Tensor>& weight, c10::string_view reduction) {
  check_defined(op, "logits", logits);
  check_defined(op, "target", target);
  CrossEntropyArgs args;
  if (reduction == "none") {
    args.reduction = LossReduction::None;
  } else if (reduction == "mean") {
    args.reduction = LossReduction::Mean;
  } else if (reduction == "sum") {
    args.reduction = LossReduction::Sum;
  } else {
    TORCH_CHECK(false, op, ": reduction='", reduction, "' is not one of 'none', 'mean', 'sum'");
  }
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have a class dim (the last), got a 0-d tensor");
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), op, ": logits has dtype ", logits.scalar_type(),
              "; expected a floating-point dtype");
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target has dtype ", target.scalar_type(),
              "; expected int64 class indices");
  TORCH_CHECK(target.device() == logits.device(), op, ": target is on ", target.device(), " but logits is on ",
              logits.device());
  const auto row_sizes = logits.sym_sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK(target.sym_sizes().equals(row_sizes), op, ": target has shape ", target.sym_sizes(),
              "; expected logits' shape without its class dim, ", row_sizes);
  TORCH_CHECK(num_classes >= 1, op, ": num_classes=", num_classes, " must be at least 1");
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->dim() == 1 && weight->sym_size(0) == num_classes, op, ": weight has shape ",
                weight->sym_sizes(), "; expected [num_classes] = [", num_classes, "]");
    TORCH_CHECK(at::isFloatingType(weight->scalar_type()), op, ": weight has dtype ", weight->scalar_type(),
                "; expected a floating-point dtype");
    TORCH_CHECK(weight->device() == logits.device(), op, ": weight is on ", weight->device(), " but logits is on ",
                logits.device());
  }
  args.group = resolve_group(op, group_name);
  const int64_t world_size = args.group->getSize();
  const int64_t rank = args.group->getRank();
  const auto piece = chunk_range<int64_t>(num_classes, world_size, rank);
  TORCH_CHECK(logits.sym_size(-1) == piece.length, op, ": logits holds ", logits.sym_size(-1), " classes on rank ",
              rank, " of ", world_size, ", but torch.chunk gives it ", piece.length, " of num_classes=", num_classes);
  args.class_start = piece.start;
  return args;
}

void check_cross_entropy_backward_args(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& max, const at::Tensor& sum_exp,
                                       const at::Tensor& row_weight, LossReduction reduction) {
  check_defined(op, "grad_loss", grad_loss);
  const bool loss_shape = reduction == LossReduction::None ? grad_loss.sym_sizes().equals(target.sym_sizes())
                                                           : grad_loss.dim() == 0;
  TORCH_CHECK(loss_shape, op, ": grad_loss has shape ", grad_loss.sym_sizes(), "; expected the loss's, ",
              reduction == LossReduction::None ? target.sym_sizes() : c10::SymIntArrayRef());
  const auto opmath = at::toOpMathType(logits.scalar_type());
  const auto check_per_row = [&](const char* arg, const at::Tensor& t) {
    check_defined(op, arg, t);
    TORCH_CHECK(t.sym_numel() == target.sym_numel() && t.scalar_type() == opmath, op, ": ", arg, " has shape ",
                t.sym_sizes(), " and dtype ", t.scalar_type(), "; expected one value per row (", target.sym_numel(),
                ") of ", opmath);
  };
  check_per_row("max", max);
  check_per_row("sum_exp", sum_exp);
  check_per_row("row_weight", row_weight);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "torch_tp::vocab_parallel_cross_entropy";
constexpr const char* kBackwardOp = "torch_tp::vocab_parallel_cross_entropy backward";

// Elements of the opmath buffer a pass fills at a time: ~1 MiB of float32 (NOTE
// [fused cross entropy on the CPU]); a row longer than this takes a chunk of its own.
constexpr int64_t kChunkElements = int64_t{1} << 18;

int64_t rows_per_chunk(int64_t classes) {
  return std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, classes));
}

int64_t row_grain(int64_t classes) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, classes));
}

// Whether the fused kernels compute this call (NOTE [fused cross entropy on the CPU]).
bool fuses(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  return logits.device().is_cpu() && logits.layout() == at::kStrided &&
         (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16);
}

std::string target_range_message(int64_t num_classes, int64_t ignore_index) {
  return c10::str(kOp, ": a target is outside [0, ", num_classes, ") and is not ignore_index=", ignore_index);
}

// ---------------------------------------------------------------- fused CPU kernels

// w [rows] in opmath: weight[t] (1 without weight), 0 where t == ignore_index;
// raises, naming the first offending row, for a target outside [0, num_classes).
template <typename opmath_t>
void row_weights_cpu(const int64_t* target, int64_t rows, const opmath_t* weight, int64_t num_classes,
                     int64_t ignore_index, opmath_t* w) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = target[r];
    if (t == ignore_index) {
      w[r] = 0;
      continue;
    }
    TORCH_CHECK(t >= 0 && t < num_classes, target_range_message(num_classes, ignore_index), ": target ", t,
                " in row ", r);
    w[r] = weight != nullptr ? weight[t] : opmath_t(1);
  }
}

// The passes over the shard: for each chunk of rows, fill(r, buffer_row) writes
// row r's n exponents, one at::exp_ takes their exp in place, and
// consume(r, buffer_row) reads them (NOTE [fused cross entropy on the CPU]).
template <typename opmath_t, typename Fill, typename Consume>
void for_each_chunk_of_exps(int64_t rows, int64_t n, const Fill& fill, const Consume& consume) {
  const int64_t step = rows_per_chunk(n);
  const auto dtype = c10::CppTypeToScalarType<opmath_t>::value;
  const at::Tensor buffer = at::empty({std::min(rows, step), n}, at::dtype(dtype));
  opmath_t* data = buffer.mutable_data_ptr<opmath_t>();
  for (int64_t begin = 0; begin < rows; begin += step) {
    const int64_t end = std::min(rows, begin + step);
    at::parallel_for(begin, end, row_grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        fill(r, data + (r - begin) * n);
      }
    });
    buffer.narrow(0, 0, end - begin).exp_();
    at::parallel_for(begin, end, row_grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        consume(r, static_cast<const opmath_t*>(data + (r - begin) * n));
      }
    });
  }
}

// (m_r, S_r, x_t or 0) of each row of x [rows, n], n > 0, into stats [3, rows].
template <typename scalar_t, typename IO = Io<scalar_t>, typename T = typename IO::stored,
          typename opmath_t = typename IO::opmath_t>
void local_statistics_cpu(const T* x, const int64_t* target, int64_t rows, int64_t n, int64_t class_start,
                          opmath_t* stats) {
  opmath_t* local_max = stats;
  opmath_t* local_sum = stats + rows;
  opmath_t* target_logit = stats + 2 * rows;
  const auto shift_row = [&](int64_t r, opmath_t* shifted) {
    const T* xr = x + r * n;
    opmath_t m = -std::numeric_limits<opmath_t>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < n; ++j) {
      const opmath_t v = IO::load(xr[j]);
      m = v > m ? v : m;
      nan |= v != v;
    }
    m = nan ? std::numeric_limits<opmath_t>::quiet_NaN() : m;
    local_max[r] = m;
    const opmath_t shift = std::isinf(m) ? opmath_t(0) : m;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      shifted[j] = IO::load(xr[j]) - shift;
    }
    const int64_t local = target[r] - class_start;
    target_logit[r] = local >= 0 && local < n ? IO::load(xr[local]) : opmath_t(0);
  };
  const auto sum_row = [&](int64_t r, const opmath_t* exps) {
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sum += exps[j];
    }
    local_sum[r] = static_cast<opmath_t>(sum);
  };
  for_each_chunk_of_exps<opmath_t>(rows, n, shift_row, sum_row);
}

// gathered [p, 3, rows] -> m, S [rows] and the weighted loss of each row [rows].
template <typename opmath_t>
void combine_cpu(const opmath_t* gathered, int64_t world_size, int64_t rows, const opmath_t* w, opmath_t* max,
                 opmath_t* sum_exp, opmath_t* loss) {
  for (int64_t i = 0; i < rows; ++i) {
    opmath_t m = gathered[i];
    for (int64_t r = 1; r < world_size; ++r) {
      const opmath_t v = gathered[r * 3 * rows + i];
      m = v > m || v != v ? v : m;  // a nan max stays
    }
    opmath_t s = 0;
    opmath_t target_logit = 0;
    for (int64_t r = 0; r < world_size; ++r) {
      const opmath_t* g = gathered + r * 3 * rows;
      // exp(0) is 1 exactly; exp(inf - inf) must stay nan, as in the composition.
      s += g[rows + i] * (g[i] == m && std::isfinite(m) ? opmath_t(1) : std::exp(g[i] - m));
      target_logit += g[2 * rows + i];
    }
    max[i] = m;
    sum_exp[i] = s;
    loss[i] = w[i] != 0 ? (std::log(s) - (target_logit - m)) * w[i] : opmath_t(0);
  }
}

// The loss of the rows reduced as `reduction` says, in the logits' dtype.
template <typename scalar_t, typename IO = Io<scalar_t>, typename opmath_t = typename IO::opmath_t>
at::Tensor reduce_cpu(const opmath_t* loss, const opmath_t* w, const at::Tensor& target, LossReduction reduction) {
  const int64_t rows = target.numel();
  const auto options = target.options().dtype(c10::CppTypeToScalarType<scalar_t>::value);
  if (reduction == LossReduction::None) {
    at::Tensor out = at::empty(target.sizes(), options);
    auto* o = mutable_stored_data<scalar_t>(out);
    for (int64_t i = 0; i < rows; ++i) {
      o[i] = IO::store(loss[i]);
    }
    return out;
  }
  double total = 0;
  double weight_total = 0;
  for (int64_t i = 0; i < rows; ++i) {
    total += loss[i];
    weight_total += w[i];
  }
  at::Tensor out = at::empty({}, options);
  const double value = reduction == LossReduction::Sum ? total : total / weight_total;
  *mutable_stored_data<scalar_t>(out) = IO::store(static_cast<opmath_t>(value));
  return out;
}

// d reduced / d loss_i, times w_i, of every row: [rows] in opmath.
template <typename opmath_t>
void row_grad_scale_cpu(const at::Tensor& grad_loss, const opmath_t* w, int64_t rows, LossReduction reduction,
                        opmath_t* scale) {
  const at::Tensor g = grad_loss.to(c10::CppTypeToScalarType<opmath_t>::value).contiguous();
  const opmath_t* gd = g.const_data_ptr<opmath_t>();
  if (reduction == LossReduction::None) {
    for (int64_t i = 0; i < rows; ++i) {
      scale[i] = gd[i] * w[i];
    }
    return;
  }
  opmath_t factor = gd[0];
  if (reduction == LossReduction::Mean) {
    double weight_total = 0;
    for (int64_t i = 0; i < rows; ++i) {
      weight_total += w[i];
    }
    factor /= static_cast<opmath_t>(weight_total);
  }
  for (int64_t i = 0; i < rows; ++i) {
    // A row of weight 0 gets 0, not 0 * inf, when every weight is 0 ("mean").
    scale[i] = w[i] != 0 ? factor * w[i] : opmath_t(0);
  }
}

// grad_x [rows, n] = exp(x - m) * scale / S, less scale at the target class on the rank holding it.
template <typename scalar_t, typename IO = Io<scalar_t>, typename T = typename IO::stored,
          typename opmath_t = typename IO::opmath_t>
void logits_grad_cpu(const T* x, const int64_t* target, const opmath_t* max, const opmath_t* sum_exp,
                     const opmath_t* scale, int64_t rows, int64_t n, int64_t class_start, T* grad) {
  const auto shift_row = [&](int64_t r, opmath_t* shifted) {
    const T* xr = x + r * n;
    const opmath_t m = max[r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      shifted[j] = IO::load(xr[j]) - m;
    }
  };
  const auto write_row = [&](int64_t r, const opmath_t* exps) {
    T* gr = grad + r * n;
    const opmath_t factor = scale[r] / sum_exp[r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      gr[j] = IO::store(exps[j] * factor);
    }
    const int64_t local = target[r] - class_start;
    if (local >= 0 && local < n) {
      gr[local] = IO::store(exps[local] * factor - scale[r]);
    }
  };
  for_each_chunk_of_exps<opmath_t>(rows, n, shift_row, write_row);
}

// ---------------------------------------------------------------- compositions (other devices, float16)

at::Tensor reduce_composite(const at::Tensor& loss, const at::Tensor& w, LossReduction reduction) {
  switch (reduction) {
    case LossReduction::None: return loss;
    case LossReduction::Sum: return loss.sum();
    case LossReduction::Mean: return loss.sum() / w.sum();
  }
  TORCH_INTERNAL_ASSERT(false, "unknown LossReduction");
}

// (index into this rank's classes, 0 where t is not here; whether t is here), for target [rows].
std::pair<at::Tensor, at::Tensor> local_target_composite(const at::Tensor& target, int64_t class_start, int64_t n) {
  const at::Tensor local = target - class_start;
  const at::Tensor here = local.ge(0).logical_and_(local.lt(n));
  return {at::where(here, local, 0), here};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_composite(
    const at::Tensor& logits, const at::Tensor& target, int64_t num_classes, const std::optional<at::Tensor>& weight,
    int64_t ignore_index, const CrossEntropyArgs& args) {
  const auto opmath = at::toOpMathType(logits.scalar_type());
  const int64_t n = logits.size(-1);
  const int64_t rows = target.numel();
  const at::Tensor x = logits.reshape({rows, n}).to(opmath);
  const at::Tensor t = target.reshape({rows});
  const at::Tensor valid = t.ne(ignore_index);
  // On CUDA a device-side assert, as ATen's nll_loss kernels raise: no host synchronisation.
  at::_assert_async(t.ge(0).logical_and_(t.lt(num_classes)).logical_or_(valid.logical_not()).all(),
                    target_range_message(num_classes, ignore_index));
  const at::Tensor w = weight.has_value() && weight->defined()
                           ? at::where(valid, weight->to(opmath).index_select(0, at::where(valid, t, 0)), 0)
                           : valid.to(opmath);
  at::Tensor local_max, local_sum, target_logit;
  if (n == 0) {  // a rank holding no classes
    local_max = at::full({rows}, -std::numeric_limits<double>::infinity(), x.options());
    local_sum = at::zeros({rows}, x.options());
    target_logit = at::zeros({rows}, x.options());
  } else {
    local_max = x.amax(1);
    const at::Tensor shift = at::where(local_max.isinf(), 0, local_max);
    local_sum = (x - shift.unsqueeze(1)).exp_().sum(1);
    const auto [index, here] = local_target_composite(t, args.class_start, n);
    target_logit = at::where(here, x.gather(1, index.unsqueeze(1)).squeeze(1), 0);
  }
  const at::Tensor stats = at::stack({local_max, local_sum, target_logit}).unsqueeze(0);
  const at::Tensor gathered = start_all_gather(kOp, args.group, /*async_op=*/false, stats, 0, std::nullopt).wait();
  const at::Tensor maxima = gathered.select(1, 0);
  const at::Tensor max = maxima.amax(0);
  const at::Tensor sum_exp = (gathered.select(1, 1) * (maxima - max).exp()).sum(0);
  const at::Tensor loss_rows = sum_exp.log() - (gathered.select(1, 2).sum(0) - max);
  const at::Tensor loss = at::where(w.ne(0), loss_rows * w, 0).view(target.sizes());
  return {reduce_composite(loss, w, args.reduction).to(logits.scalar_type()), max, sum_exp, w};
}

at::Tensor backward_composite(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                              const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& w,
                              const CrossEntropyArgs& args) {
  const int64_t n = logits.size(-1);
  const int64_t rows = target.numel();
  if (n == 0) {
    return at::empty(logits.sizes(), logits.options());
  }
  const at::Tensor g = grad_loss.to(w.scalar_type()).reshape({-1});
  const at::Tensor wr = w.reshape({rows});
  const at::Tensor scale = args.reduction == LossReduction::Mean ? at::where(wr.eq(0), 0, g * wr / wr.sum())
                                                                 : g * wr;
  const auto [index, here] = local_target_composite(target.reshape({rows}), args.class_start, n);
  at::Tensor grad = (logits.reshape({rows, n}).to(w.scalar_type()) - max.reshape({rows, 1})).exp_();
  grad.mul_((scale / sum_exp.reshape({rows})).unsqueeze(1));
  grad.scatter_add_(1, index.unsqueeze(1), at::where(here, -scale, 0).unsqueeze(1));
  return grad.to(logits.scalar_type()).view(logits.sizes());
}

// ---------------------------------------------------------------- the pieces' kernels

// (loss, max [rows], sum_exp [rows], row_weight [rows]): the loss reduced as
// `reduction` says in logits' dtype, and the rows' global m, S and w_t in opmath.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_kernel(
    const at::Tensor& logits, const at::Tensor& target, c10::string_view group_name, int64_t num_classes,
    const std::optional<at::Tensor>& weight, int64_t ignore_index, c10::string_view reduction) {
  const CrossEntropyArgs args = check_cross_entropy_args(kOp, logits, target, group_name, num_classes, weight,
                                                         reduction);
  if (!fuses(logits)) {
    return forward_composite(logits, target, num_classes, weight, ignore_index, args);
  }
  const int64_t n = logits.size(-1);
  const int64_t rows = target.numel();
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = target.contiguous();
  const auto opmath = at::toOpMathType(logits.scalar_type());
  const auto options = target.options().dtype(opmath);
  at::Tensor w = at::empty({rows}, options);
  at::Tensor stats = at::empty({1, 3, rows}, options);
  at::Tensor max = at::empty({rows}, options);
  at::Tensor sum_exp = at::empty({rows}, options);
  at::Tensor loss;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), kOp, [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const at::Tensor weight_opmath =
        weight.has_value() && weight->defined() ? weight->to(opmath).contiguous() : at::Tensor();
    row_weights_cpu<opmath_t>(t.const_data_ptr<int64_t>(), rows,
                              weight_opmath.defined() ? weight_opmath.const_data_ptr<opmath_t>() : nullptr,
                              num_classes, ignore_index, w.mutable_data_ptr<opmath_t>());
    opmath_t* s = stats.mutable_data_ptr<opmath_t>();
    if (n == 0) {  // a rank holding no classes
      std::fill(s, s + rows, -std::numeric_limits<opmath_t>::infinity());
      std::fill(s + rows, s + 3 * rows, opmath_t(0));
    } else {
      local_statistics_cpu<scalar_t>(stored_data<scalar_t>(x), t.const_data_ptr<int64_t>(), rows, n,
                                     args.class_start, s);
    }
    const at::Tensor gathered =
        start_all_gather(kOp, args.group, /*async_op=*/false, stats, 0, std::nullopt).wait().contiguous();
    at::Tensor loss_rows = at::empty({rows}, options);
    combine_cpu<opmath_t>(gathered.const_data_ptr<opmath_t>(), args.group->getSize(), rows,
                          w.const_data_ptr<opmath_t>(), max.mutable_data_ptr<opmath_t>(),
                          sum_exp.mutable_data_ptr<opmath_t>(), loss_rows.mutable_data_ptr<opmath_t>());
    loss = reduce_cpu<scalar_t>(loss_rows.const_data_ptr<opmath_t>(), w.const_data_ptr<opmath_t>(), t,
                                args.reduction);
  });
  return {loss, max, sum_exp, w};
}

// grad_logits, logits' shape and dtype.
at::Tensor cross_entropy_backward_kernel(const at::Tensor& grad_loss, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& max, const at::Tensor& sum_exp,
                                         const at::Tensor& row_weight, c10::string_view group_name,
                                         int64_t num_classes, c10::string_view reduction) {
  const CrossEntropyArgs args = check_cross_entropy_args(kBackwardOp, logits, target, group_name, num_classes,
                                                         std::nullopt, reduction);
  check_cross_entropy_backward_args(kBackwardOp, grad_loss, logits, target, max, sum_exp, row_weight, args.reduction);
  if (!fuses(logits)) {
    return backward_composite(grad_loss, logits, target, max, sum_exp, row_weight, args);
  }
  const int64_t n = logits.size(-1);
  const int64_t rows = target.numel();
  const at::Tensor x = logits.contiguous();
  at::Tensor grad = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (n == 0 || rows == 0) {
    return grad;
  }
  const at::Tensor t = target.contiguous();
  const at::Tensor m = max.contiguous();
  const at::Tensor s = sum_exp.contiguous();
  const at::Tensor w = row_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), kBackwardOp, [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    at::Tensor scale = at::empty({rows}, w.options());
    row_grad_scale_cpu<opmath_t>(grad_loss, w.const_data_ptr<opmath_t>(), rows, args.reduction,
                                 scale.mutable_data_ptr<opmath_t>());
    logits_grad_cpu<scalar_t>(stored_data<scalar_t>(x), t.const_data_ptr<int64_t>(), m.const_data_ptr<opmath_t>(),
                              s.const_data_ptr<opmath_t>(), scale.const_data_ptr<opmath_t>(), rows, n,
                              args.class_start, mutable_stored_data<scalar_t>(grad));
  });
  return grad;
}

// ---------------------------------------------------------------- autograd

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, const std::optional<at::Tensor>&, int64_t,
    c10::string_view);
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, c10::string_view, int64_t,
                                     c10::string_view);

// Inputs: logits, target, group_name, num_classes, weight, ignore_index,
// reduction; only logits is differentiable (the pieces are not: a gradient
// taken with create_graph=True fails when it is differentiated again).
struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            std::string group_name, int64_t num_classes, const std::optional<at::Tensor>& weight,
                            int64_t ignore_index, std::string reduction) {
    static const auto forward_op = find_op<ForwardSignature>("torch_tp::_vocab_parallel_cross_entropy_forward");
    at::Tensor loss, max, sum_exp, row_weight;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(loss, max, sum_exp, row_weight) =
          forward_op.call(logits, target, group_name, num_classes, weight, ignore_index, reduction);
    }
    ctx->save_for_backward({logits, target, max, sum_exp, row_weight});
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["num_classes"] = num_classes;
    ctx->saved_data["reduction"] = reduction;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op = find_op<BackwardSignature>("torch_tp::_vocab_parallel_cross_entropy_backward");
    variable_list out(7);
    if (!grads[0].defined()) {
      return out;
    }
    const auto saved = ctx->get_saved_variables();
    out[0] = backward_op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                              ctx->saved_data["group_name"].toStringRef(), ctx->saved_data["num_classes"].toInt(),
                              ctx->saved_data["reduction"].toStringRef());
    return out;
  }
};

at::Tensor vocab_parallel_cross_entropy_composite(const at::Tensor& logits, const at::Tensor& target,
                                                  c10::string_view group_name, int64_t num_classes,
                                                  const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                                  c10::string_view reduction) {
  check_defined(kOp, "logits", logits);
  const bool weight_grad = weight.has_value() && weight->defined() && needs_autograd(*weight);
  TORCH_CHECK(!weight_grad, kOp, ": weight requires grad, but the loss is not differentiable with respect to "
              "weight (F.cross_entropy refuses it too)");
  if (!needs_autograd(logits)) {
    static const auto forward_op = find_op<ForwardSignature>("torch_tp::_vocab_parallel_cross_entropy_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    return std::get<0>(forward_op.call(logits, target, group_name, num_classes, weight, ignore_index, reduction));
  }
  return CrossEntropyFunction::apply(logits, target, std::string(group_name), num_classes, weight, ignore_index,
                                     std::string(reduction));
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CompositeImplicitAutograd, m) {
  m.impl("vocab_parallel_cross_entropy", vocab_parallel_cross_entropy_composite);
}

// One kernel per piece for every device: the fused loops where they apply, the
// composition elsewhere (NOTE [fused cross entropy on the CPU]).
TORCH_LIBRARY_IMPL(torch_tp, CompositeExplicitAutograd, m) {
  m.impl("_vocab_parallel_cross_entropy_forward", cross_entropy_forward_kernel);
  m.impl("_vocab_parallel_cross_entropy_backward", cross_entropy_backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  // The pieces are not differentiable themselves; the public op is (as the
  // linear and norm ops' pieces).
  m.impl("_vocab_parallel_cross_entropy_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_vocab_parallel_cross_entropy_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
