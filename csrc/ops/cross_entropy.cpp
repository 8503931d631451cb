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
// in Python it took several times the unsharded F.cross_entropy of [256,
// 256] forward and backward; as this one op, its autograd and the all-gather
// included, it costs a fraction of that. At LLM
// vocabularies it is bound by passes over the logits. Here, for float32 and
// bfloat16 on the CPU, the forward reads each row twice (its max and target
// logit; the sum of exp(x - max)), the second time from cache, and the
// backward once, writing the gradient as it goes; the exp is computed inside
// the loop (NOTE [exp in the row loops]), so nothing else is written. The
// arithmetic per row around them (row weights and the target check,
// combining the ranks' statistics, the reduction) is plain loops, which at
// [512, 16000] float32 logits on one rank run forward and backward faster
// than chunks of at::exp_ and than the unsharded F.cross_entropy.
// float64, float16 and other devices run the same formulas as a composition
// of ATen ops (the *_composite functions).

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

// ---------------------------------------------------------------- the fused row loops, per instruction set

namespace {

// NOTE [exp in the row loops]
// The fused loops take exp of every logit (twice: forward for the sums,
// backward for the softmax) inside the loop that reads it, so that a row is
// read from memory once a pass and no intermediate is written. exp_of is
// Cody and Waite's reduction x = k ln 2 + r, |r| <= ln(2) / 2 (ln 2 split in
// two parts so k ln 2 is exact), and exp(r) by Cephes' degree-6 polynomial
// for float: on [-87.3, 0], the loops' range, within 0.98 ulp of the
// correctly rounded value (every 16th float there checked against double's
// exp), as ATen's own vectorised exps (which the unsharded F.cross_entropy
// runs) are within a few. It is branch-free arithmetic the compiler vectorises, so the loops are
// compiled once per instruction set (NOTE [instruction-set variants of the
// row loops] in cpu_isa.h).
// Below -87.34 exp is under FLT_MIN and returns 0 (softmax terms that small
// change no float sum they are in); from 88.38 up it is inf (2^128: exact
// only from log(FLT_MAX) = 88.72 up, but the loops call it on x - max <= 0,
// and only on a row holding +inf, whose sum is inf anyway, on more); nan stays nan.
[[gnu::always_inline]] inline float exp_of(float x) {
  constexpr float kLowest = -87.33654f;  // log(FLT_MIN)
  constexpr float kHighest = 88.72283f;  // log(FLT_MAX)
  const float finite = x == x ? std::min(std::max(x, kLowest), kHighest) : 0.0f;
  // k = round(x / ln 2) by the float32 rounding of adding and taking away 1.5 * 2^23.
  const float k = (finite * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (finite - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float exp_r = p * (r * r) + r + 1.0f;
  // 2^k from its exponent bits: k in [-126, 128], and 128 gives inf's bits.
  const float two_to_k = c10::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  const float y = exp_r * two_to_k;
  return x != x ? x : x < kLowest ? 0.0f : x > kHighest ? std::numeric_limits<float>::infinity() : y;
}

// The sum of a row's exps runs in float over blocks of kSumBlock terms (one
// partial sum per vector lane: at most 256 terms each, in [0, 1]) and in
// double over the blocks. (A double sum inside the vector loop vectorised
// only for AVX-512: the lanes would differ in width.)
constexpr int64_t kSumBlock = 1024;

// Rows [first, last) of x [rows, n]: stats [3, rows] gets each row's
// (m_r, S_r, x_t or 0) (NOTE [vocab-parallel cross entropy]).
template <typename scalar_t, typename IO = Io<scalar_t>, typename T = typename IO::stored>
struct StatisticsRows {
  static void run(const T* x, const int64_t* target, int64_t first, int64_t last, int64_t rows, int64_t n,
                  int64_t class_start, float* stats) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * n;
      float m = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t j = 0; j < n; ++j) {
        const float v = IO::load(xr[j]);
        m = v > m ? v : m;
        nan |= v != v;
      }
      m = nan ? std::numeric_limits<float>::quiet_NaN() : m;
      const float shift = std::isinf(m) ? 0.0f : m;
      double sum = 0;
      for (int64_t begin = 0; begin < n; begin += kSumBlock) {
        const int64_t end = std::min(n, begin + kSumBlock);
        float block_sum = 0;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = begin; j < end; ++j) {
          block_sum += exp_of(IO::load(xr[j]) - shift);
        }
        sum += block_sum;
      }
      const int64_t local = target[r] - class_start;
      stats[r] = m;
      stats[rows + r] = static_cast<float>(sum);
      stats[2 * rows + r] = local >= 0 && local < n ? IO::load(xr[local]) : 0.0f;
    }
  }
};

// Rows [first, last) of grad [rows, n] = exp(x - max) * scale / sum_exp, less
// scale at the target class where this rank holds it.
template <typename scalar_t, typename IO = Io<scalar_t>, typename T = typename IO::stored>
struct GradRows {
  static void run(const T* x, const int64_t* target, const float* max, const float* sum_exp, const float* scale,
                  int64_t first, int64_t last, int64_t n, int64_t class_start, T* grad) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * n;
      T* gr = grad + r * n;
      const float m = max[r];
      const float factor = scale[r] / sum_exp[r];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        gr[j] = IO::store(exp_of(IO::load(xr[j]) - m) * factor);
      }
      const int64_t local = target[r] - class_start;
      if (local >= 0 && local < n) {
        gr[local] = IO::store(exp_of(IO::load(xr[local]) - m) * factor - scale[r]);
      }
    }
  }
};

void check_fused_rows(const char* what, const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              what, ": logits must be a contiguous [rows, n] CPU float32 or bfloat16 tensor, got ", logits.sizes(),
              " of ", logits.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0) && target.is_contiguous() &&
                  target.scalar_type() == at::kLong,
              what, ": target must be a contiguous int64 [rows], got ", target.sizes(), " of ", target.scalar_type());
}

} // namespace

at::Tensor cross_entropy_local_statistics_with(CpuIsa isa, const at::Tensor& logits,
                                               const at::Tensor& target, int64_t class_start) {
  check_fused_rows("torch_tp::cross_entropy_local_statistics_with", logits, target);
  const int64_t rows = logits.size(0);
  const int64_t n = logits.size(1);
  at::Tensor stats = at::empty({3, rows}, target.options().dtype(at::kFloat));
  float* s = stats.mutable_data_ptr<float>();
  const int64_t* t = target.const_data_ptr<int64_t>();
  const auto run = [&](auto kernel, const auto* x) {
    at::parallel_for(0, rows, row_grain(n), [&](int64_t first, int64_t last) {
      kernel(x, t, first, last, rows, n, class_start, s);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(isa_entry<StatisticsRows<float>>(isa), stored_data<float>(logits));
  } else {
    run(isa_entry<StatisticsRows<c10::BFloat16>>(isa), stored_data<c10::BFloat16>(logits));
  }
  return stats;
}

at::Tensor cross_entropy_logits_grad_with(CpuIsa isa, const at::Tensor& logits, const at::Tensor& target,
                                          const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& scale,
                                          int64_t class_start) {
  check_fused_rows("torch_tp::cross_entropy_logits_grad_with", logits, target);
  const int64_t rows = logits.size(0);
  const int64_t n = logits.size(1);
  for (const at::Tensor* per_row : {&max, &sum_exp, &scale}) {
    TORCH_CHECK(per_row->dim() == 1 && per_row->size(0) == rows && per_row->is_contiguous() &&
                    per_row->scalar_type() == at::kFloat,
                "torch_tp::cross_entropy_logits_grad_with: max, sum_exp and scale must be contiguous float32 [",
                rows, "], got ", per_row->sizes(), " of ", per_row->scalar_type());
  }
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  const int64_t* t = target.const_data_ptr<int64_t>();
  const auto run = [&](auto kernel, const auto* x, auto* g) {
    at::parallel_for(0, rows, row_grain(n), [&](int64_t first, int64_t last) {
      kernel(x, t, max.const_data_ptr<float>(), sum_exp.const_data_ptr<float>(), scale.const_data_ptr<float>(),
             first, last, n, class_start, g);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(isa_entry<GradRows<float>>(isa), stored_data<float>(logits), mutable_stored_data<float>(grad));
  } else {
    run(isa_entry<GradRows<c10::BFloat16>>(isa), stored_data<c10::BFloat16>(logits),
        mutable_stored_data<c10::BFloat16>(grad));
  }
  return grad;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "torch_tp::vocab_parallel_cross_entropy";
constexpr const char* kBackwardOp = "torch_tp::vocab_parallel_cross_entropy backward";

// Whether the fused kernels compute this call (NOTE [fused cross entropy on the CPU]).
bool fuses(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  return logits.device().is_cpu() && logits.layout() == at::kStrided &&
         (dtype == at::kFloat || dtype == at::kBFloat16);
}

std::string target_range_message(int64_t num_classes, int64_t ignore_index) {
  return c10::str(kOp, ": a target is outside [0, ", num_classes, ") and is not ignore_index=", ignore_index);
}

// ---------------------------------------------------------------- fused CPU kernels

// w [rows]: weight[t] (1 without weight), 0 where t == ignore_index;
// raises, naming the first offending row, for a target outside [0, num_classes).
void row_weights_cpu(const int64_t* target, int64_t rows, const float* weight, int64_t num_classes,
                     int64_t ignore_index, float* w) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = target[r];
    if (t == ignore_index) {
      w[r] = 0;
      continue;
    }
    TORCH_CHECK(t >= 0 && t < num_classes, target_range_message(num_classes, ignore_index), ": target ", t,
                " in row ", r);
    w[r] = weight != nullptr ? weight[t] : 1.0f;
  }
}

// gathered [p, 3, rows] -> m, S [rows] and the weighted loss of each row [rows].
void combine_cpu(const float* gathered, int64_t world_size, int64_t rows, const float* w, float* max,
                 float* sum_exp, float* loss) {
  for (int64_t i = 0; i < rows; ++i) {
    float m = gathered[i];
    for (int64_t r = 1; r < world_size; ++r) {
      const float v = gathered[r * 3 * rows + i];
      m = v > m || v != v ? v : m;  // a nan max stays
    }
    float s = 0;
    float target_logit = 0;
    for (int64_t r = 0; r < world_size; ++r) {
      const float* g = gathered + r * 3 * rows;
      // exp(0) is 1 exactly; exp(inf - inf) must stay nan, as in the composition.
      s += g[rows + i] * (g[i] == m && std::isfinite(m) ? 1.0f : std::exp(g[i] - m));
      target_logit += g[2 * rows + i];
    }
    max[i] = m;
    sum_exp[i] = s;
    loss[i] = w[i] != 0 ? (std::log(s) - (target_logit - m)) * w[i] : 0.0f;
  }
}

// The loss of the rows reduced as `reduction` says, in the logits' dtype.
template <typename scalar_t, typename IO = Io<scalar_t>>
at::Tensor reduce_cpu(const float* loss, const float* w, const at::Tensor& target, LossReduction reduction) {
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
  *mutable_stored_data<scalar_t>(out) = IO::store(static_cast<float>(value));
  return out;
}

// d reduced / d loss_i, times w_i, of every row: [rows].
void row_grad_scale_cpu(const at::Tensor& grad_loss, const float* w, int64_t rows, LossReduction reduction,
                        float* scale) {
  const at::Tensor g = grad_loss.to(at::kFloat).contiguous();
  const float* gd = g.const_data_ptr<float>();
  if (reduction == LossReduction::None) {
    for (int64_t i = 0; i < rows; ++i) {
      scale[i] = gd[i] * w[i];
    }
    return;
  }
  float factor = gd[0];
  if (reduction == LossReduction::Mean) {
    double weight_total = 0;
    for (int64_t i = 0; i < rows; ++i) {
      weight_total += w[i];
    }
    factor /= static_cast<float>(weight_total);
  }
  for (int64_t i = 0; i < rows; ++i) {
    // A row of weight 0 gets 0, not 0 * inf, when every weight is 0 ("mean").
    scale[i] = w[i] != 0 ? factor * w[i] : 0.0f;
  }
}

// ---------------------------------------------------------------- compositions (float64, float16, other devices)

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
// `reduction` says in logits' dtype, and the rows' global m, S and w_t in opmath
// (float32 on the fused path).
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
  const at::Tensor x = logits.reshape({rows, n}).contiguous();
  const at::Tensor t = target.reshape({rows}).contiguous();
  const auto options = target.options().dtype(at::kFloat);
  const at::Tensor weight_float =
      weight.has_value() && weight->defined() ? weight->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor w = at::empty({rows}, options);
  row_weights_cpu(t.const_data_ptr<int64_t>(), rows,
                  weight_float.defined() ? weight_float.const_data_ptr<float>() : nullptr, num_classes, ignore_index,
                  w.mutable_data_ptr<float>());
  const at::Tensor stats = cross_entropy_local_statistics_with(widest_cpu_isa(), x, t, args.class_start);
  const at::Tensor gathered =
      start_all_gather(kOp, args.group, /*async_op=*/false, stats.unsqueeze(0), 0, std::nullopt).wait().contiguous();
  at::Tensor max = at::empty({rows}, options);
  at::Tensor sum_exp = at::empty({rows}, options);
  at::Tensor loss_rows = at::empty({rows}, options);
  combine_cpu(gathered.const_data_ptr<float>(), args.group->getSize(), rows, w.const_data_ptr<float>(),
              max.mutable_data_ptr<float>(), sum_exp.mutable_data_ptr<float>(), loss_rows.mutable_data_ptr<float>());
  const auto reduce = logits.scalar_type() == at::kFloat ? reduce_cpu<float> : reduce_cpu<c10::BFloat16>;
  const at::Tensor loss = reduce(loss_rows.const_data_ptr<float>(), w.const_data_ptr<float>(), target,
                                 args.reduction);
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
  const at::Tensor w = row_weight.reshape({rows}).contiguous();
  at::Tensor scale = at::empty({rows}, w.options());
  row_grad_scale_cpu(grad_loss, w.const_data_ptr<float>(), rows, args.reduction, scale.mutable_data_ptr<float>());
  return cross_entropy_logits_grad_with(widest_cpu_isa(), logits.reshape({rows, n}).contiguous(),
                                        target.reshape({rows}).contiguous(), max.reshape({rows}).contiguous(),
                                        sum_exp.reshape({rows}).contiguous(), scale, args.class_start)
      .view(logits.sizes());
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
