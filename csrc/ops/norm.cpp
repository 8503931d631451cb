// torch_tp::rms_norm: aten::rms_norm's numbers in one pass over the rows
// forward and two backward, on the CPU. SequenceParallel runs an nn.RMSNorm
// through it (torch_tp/parallel/style.py).
//
// NOTE [fused RMSNorm on the CPU]
// On the CPU torch's rms_norm is a composition: upcast, pow, mean, add, rsqrt,
// mul, mul, downcast forward, and about twice as many ops backward, each
// dispatched, allocated and passed over memory on its own. At the example
// model's sequence-parallel shard ([4, 32, 256] fp32) that per-op cost is
// most of the norm's time, forward and backward; this op takes a fraction of
// it (autograd's own cost included), which shortens the example's TP step.
// Here a row x [N] (N =
// prod(normalized_shape)), in opmath (float for bfloat16, double for double),
// as torch's fused formula for an input and weight of one dtype:
//   rstd = 1 / sqrt(mean_j x_j^2 + eps)    eps None: opmath's epsilon, as torch
//   y_j  = round(x_j * rstd * w_j)         one rounding to the input's dtype
// and backward, with dy [N], xhat_j = x_j * rstd and g_j = dy_j * w_j:
//   dx_j = rstd * (g_j - xhat_j * mean_k(g_k * xhat_k))
//   dw_j = sum over rows of dy_j * xhat_j  (summed in opmath, rounded once)
// These are the gradients autograd takes through torch's composition; only
// the order of the sums differs (a few ulps of float32). Anything else (another
// device, an input and weight of different dtypes, a forward-mode tangent)
// goes to at::rms_norm itself, so the op is torch's rms_norm wherever it does
// not fuse, float16 included (its conversions did not vectorise here, and the
// fused forward was slower than torch's). The row loops are compiled per
// instruction set and the widest the CPU runs is taken (NOTE [instruction-set
// variants of the row loops] in cpu_isa.h): with AVX-512, forward and
// backward of that shard run faster than the SSE2 build's, and more so at
// longer sequences.

#include "ops/common.h"
#include "ops/norm.h"
#include "ops/row_io.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <c10/util/accumulate.h>

#include <cmath>
#include <limits>
#include <vector>

namespace torch_tp {
namespace {

// float16 is left to torch: c10's float16 conversions are bit arithmetic that
// does not vectorise here, and made the fused forward slower than torch's
// composition (NOTE [fused RMSNorm on the CPU]).
bool is_fused_dtype(c10::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16;
}

} // namespace

int64_t check_rms_norm_args(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, bool fused_kernels) {
  check_defined(op, "input", input);
  const int64_t dims = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(dims >= 1, op, ": normalized_shape must name at least one dimension, got ", normalized_shape);
  bool trailing = input.dim() >= dims;
  for (int64_t i = 0; trailing && i < dims; ++i) {
    trailing = input.sym_size(input.dim() - dims + i) == normalized_shape[i];
  }
  TORCH_CHECK(trailing, op, ": normalized_shape=", normalized_shape,
              " must be the trailing sizes of input, whose shape is ", input.sym_sizes());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype), op, ": input has dtype ", dtype, "; expected a floating-point dtype");
  TORCH_CHECK(!fused_kernels || is_fused_dtype(dtype), op,
              ": the fused kernels take float32, float64 and bfloat16, not ", dtype);
  if (weight.defined()) {
    TORCH_CHECK(weight.sym_sizes().equals(c10::fromIntArrayRefSlow(normalized_shape)), op, ": weight has shape ",
                weight.sym_sizes(), "; expected normalized_shape=", normalized_shape);
    TORCH_CHECK(!fused_kernels || weight.scalar_type() == dtype, op, ": weight has dtype ",
                weight.scalar_type(), " but input has ", dtype);
    TORCH_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
                input.device());
  }
  return c10::multiply_integers(normalized_shape);
}

namespace {

constexpr const char* kOp = "torch_tp::rms_norm";

// Whether the fused kernels compute this call (NOTE [fused RMSNorm on the CPU]).
bool fuses(const at::Tensor& input, const std::optional<at::Tensor>& weight) {
  const bool weight_ok = !weight.has_value() || !weight->defined() ||
                         (weight->device().is_cpu() && weight->scalar_type() == input.scalar_type() &&
                          weight->layout() == at::kStrided && !weight->_fw_grad(/*level=*/0).defined());
  return input.device().is_cpu() && input.layout() == at::kStrided && is_fused_dtype(input.scalar_type()) &&
         !input._fw_grad(/*level=*/0).defined() && weight_ok;
}

// sum_j a_j * b_j in opmath_t, b read through Io. The simd reduction lets the
// compiler keep one partial sum per vector lane (a fixed order for a given
// build and instruction set).
template <typename IO, typename A>
typename IO::opmath_t sum_of_products(const A* a, const typename IO::stored* b, int64_t n) {
  typename IO::opmath_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    sum += static_cast<typename IO::opmath_t>(a[j]) * IO::load(b[j]);
  }
  return sum;
}

// The row loops, run per chunk of rows through isa_entry (NOTE [instruction-set
// variants of the row loops] in cpu_isa.h): scalar_t's stored type T, its opmath_t.
template <typename scalar_t>
struct NormRows {
  using IO = Io<scalar_t>;
  using T = typename IO::stored;
  using opmath_t = typename IO::opmath_t;

  // Rows [begin, end) of x [rows, n] -> y (x's dtype), rstd [rows] (opmath); w may be null.
  struct Forward {
    static void run(const T* x, const T* w, T* y, opmath_t* rstd, int64_t begin, int64_t end, int64_t n,
                    opmath_t eps) {
      std::vector<opmath_t> xf(static_cast<size_t>(n));  // the row in opmath
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = x + r * n;
        T* yr = y + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          xf[j] = IO::load(xr[j]);
        }
        const opmath_t mean_square = sum_of_products<IO>(xf.data(), xr, n) / static_cast<opmath_t>(n);
        const opmath_t inv = opmath_t(1) / std::sqrt(mean_square + eps);
        rstd[r] = inv;
        if (w != nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            yr[j] = IO::store(xf[j] * inv * IO::load(w[j]));
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            yr[j] = IO::store(xf[j] * inv);
          }
        }
      }
    }
  };

  // Rows [begin, end): dx where dx != nullptr; dy_j * xhat_j added into dw_acc [n] (one
  // thread's partial sums) where dw_acc != nullptr; w may be null.
  struct Backward {
    static void run(const T* dy, const T* x, const T* w, const opmath_t* rstd, T* dx, opmath_t* dw_acc,
                    int64_t begin, int64_t end, int64_t n) {
      std::vector<opmath_t> g(dx != nullptr ? static_cast<size_t>(n) : 0);  // dy * w for one row
      for (int64_t r = begin; r < end; ++r) {
        const T* dyr = dy + r * n;
        const T* xr = x + r * n;
        const opmath_t inv = rstd[r];
        if (dw_acc != nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            dw_acc[j] += IO::load(dyr[j]) * (IO::load(xr[j]) * inv);
          }
        }
        if (dx == nullptr) {
          continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          g[j] = w != nullptr ? IO::load(dyr[j]) * IO::load(w[j]) : IO::load(dyr[j]);
        }
        // mean_k(g_k * xhat_k) = rstd * mean_k(g_k * x_k)
        const opmath_t mean_gx = sum_of_products<IO>(g.data(), xr, n) * inv / static_cast<opmath_t>(n);
        const opmath_t scale = inv * mean_gx;  // xhat_j * mean_k(g_k * xhat_k) = x_j * scale
        T* dxr = dx + r * n;
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) {
          dxr[k] = IO::store(inv * (g[k] - IO::load(xr[k]) * scale));
        }
      }
    }
  };
};

// x [rows, n] -> y (x's dtype), rstd [rows] (opmath), with `isa`'s loop.
template <typename scalar_t, typename T = typename NormRows<scalar_t>::T,
          typename opmath_t = typename NormRows<scalar_t>::opmath_t>
void rms_norm_forward_rows(CpuIsa isa, const T* x, const T* w, T* y, opmath_t* rstd, int64_t rows, int64_t n,
                           opmath_t eps) {
  const auto loop = isa_entry<typename NormRows<scalar_t>::Forward>(isa);
  at::parallel_for(0, rows, row_grain(n),
                   [&](int64_t begin, int64_t end) { loop(x, w, y, rstd, begin, end, n, eps); });
}

// dx [rows, n] where dx != nullptr; dw [n] where dw != nullptr (w must then be given).
template <typename scalar_t, typename T = typename NormRows<scalar_t>::T,
          typename opmath_t = typename NormRows<scalar_t>::opmath_t>
void rms_norm_backward_rows(CpuIsa isa, const T* dy, const T* x, const T* w, const opmath_t* rstd, T* dx, T* dw,
                            int64_t rows, int64_t n) {
  const auto loop = isa_entry<typename NormRows<scalar_t>::Backward>(isa);
  // dw's partial sums: one row of n per thread, summed after the loop.
  std::vector<opmath_t> dw_partial(dw != nullptr ? static_cast<size_t>(at::get_num_threads() * n) : 0, opmath_t(0));
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    opmath_t* dw_acc = dw != nullptr ? dw_partial.data() + at::get_thread_num() * n : nullptr;
    loop(dy, x, w, rstd, dx, dw_acc, begin, end, n);
  });
  if (dw != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      opmath_t sum = 0;
      for (int64_t t = 0; t < at::get_num_threads(); ++t) {
        sum += dw_partial[t * n + j];
      }
      dw[j] = Io<scalar_t>::store(sum);
    }
  }
}

} // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_with(CpuIsa isa, const at::Tensor& input,
                                                         at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight_opt,
                                                         std::optional<double> eps) {
  const at::Tensor weight = weight_opt.value_or(at::Tensor());
  const int64_t n = check_rms_norm_args(kOp, input, normalized_shape, weight, /*fused_kernels=*/true);
  TORCH_CHECK(input.device().is_cpu(), kOp, ": the fused kernels run on the CPU, got input on ", input.device());
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.defined() ? weight.contiguous() : weight;
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "torch_tp::rms_norm", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t eps_value = eps ? static_cast<opmath_t>(*eps) : std::numeric_limits<opmath_t>::epsilon();
    rms_norm_forward_rows<scalar_t>(isa, stored_data<scalar_t>(x), stored_data<scalar_t>(w),
                                    mutable_stored_data<scalar_t>(out), rstd.mutable_data_ptr<opmath_t>(), rows, n,
                                    eps_value);
  });
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_with(CpuIsa isa, const at::Tensor& grad_out,
                                                          const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight_opt,
                                                          const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                                          std::array<bool, 2> output_mask) {
  constexpr const char* op = "torch_tp::rms_norm backward";
  const at::Tensor weight = weight_opt.value_or(at::Tensor());
  const int64_t n = check_rms_norm_args(op, input, normalized_shape, weight, /*fused_kernels=*/true);
  TORCH_CHECK(input.device().is_cpu(), op, ": the fused kernels run on the CPU, got input on ", input.device());
  TORCH_CHECK(grad_out.sizes().equals(input.sizes()) && grad_out.scalar_type() == input.scalar_type(), op,
              ": grad_out has shape ", grad_out.sizes(), " and dtype ", grad_out.scalar_type(), "; expected ",
              input.sizes(), " and ", input.scalar_type());
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == rows && rstd.scalar_type() == at::toOpMathType(input.scalar_type()),
              op, ": rstd has shape ", rstd.sizes(), " and dtype ", rstd.scalar_type(), "; expected [", rows,
              "] of ", at::toOpMathType(input.scalar_type()));
  const bool want_weight = output_mask[1] && weight.defined();
  const at::Tensor x = input.contiguous();
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor w = weight.defined() ? weight.contiguous() : weight;
  const at::Tensor r = rstd.contiguous();
  const auto empty = [&] { return at::empty({0}, x.options()); };
  at::Tensor grad_input = output_mask[0] ? at::empty_like(x, at::MemoryFormat::Contiguous) : empty();
  at::Tensor grad_weight = want_weight ? at::empty_like(w, at::MemoryFormat::Contiguous) : empty();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "torch_tp::rms_norm backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    rms_norm_backward_rows<scalar_t>(isa, stored_data<scalar_t>(dy), stored_data<scalar_t>(x),
                                     stored_data<scalar_t>(w), r.const_data_ptr<opmath_t>(),
                                     output_mask[0] ? mutable_stored_data<scalar_t>(grad_input) : nullptr,
                                     want_weight ? mutable_stored_data<scalar_t>(grad_weight) : nullptr, rows, n);
  });
  return {grad_input, grad_weight};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                        const std::optional<at::Tensor>& weight,
                                                        std::optional<double> eps) {
  return rms_norm_forward_with(widest_cpu_isa(), input, normalized_shape, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight,
                                                         const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                                         std::array<bool, 2> output_mask) {
  return rms_norm_backward_with(widest_cpu_isa(), grad_out, input, weight, rstd, normalized_shape, output_mask);
}

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                            const std::optional<at::Tensor>&, std::optional<double>);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const std::optional<at::Tensor>&, const at::Tensor&,
                                                             at::IntArrayRef, std::array<bool, 2>);

std::optional<double> optional_double(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<double>(value.toDouble());
}

// The gradients of aten::rms_norm at (input, weight) for grad_out, with their graph (create_graph).
variable_list double_backward_grads(const at::Tensor& grad_out, const at::Tensor& input,
                                    const std::optional<at::Tensor>& weight, at::IntArrayRef normalized_shape,
                                    std::optional<double> eps, std::array<bool, 2> output_mask) {
  const at::Tensor out = at::rms_norm(input, normalized_shape, weight, eps);
  variable_list inputs;
  if (output_mask[0]) {
    inputs.push_back(input);
  }
  if (output_mask[1]) {
    inputs.push_back(*weight);
  }
  const variable_list grads = torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/true,
                                                    /*create_graph=*/true, /*allow_unused=*/true);
  return {output_mask[0] ? grads[0] : at::Tensor(), output_mask[1] ? grads.back() : at::Tensor(), at::Tensor(),
          at::Tensor()};
}

// Inputs: input, weight (an edge of the node only when given); the rest are not tensors.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            std::vector<int64_t> normalized_shape, std::optional<double> eps) {
    static const auto forward_op = find_op<ForwardSignature>("torch_tp::_rms_norm_forward");
    at::Tensor out, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, rstd) = forward_op.call(input, normalized_shape, weight, eps);
    }
    ctx->save_for_backward({input, weight.value_or(at::Tensor()), rstd});
    ctx->saved_data["normalized_shape"] = normalized_shape;
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op = find_op<BackwardSignature>("torch_tp::_rms_norm_backward");
    if (!grads[0].defined()) {
      return variable_list(4);
    }
    const auto saved = ctx->get_saved_variables();
    const auto normalized_shape = ctx->saved_data["normalized_shape"].toIntVector();
    const std::optional<at::Tensor> weight = saved[1].defined() ? std::optional<at::Tensor>(saved[1]) : std::nullopt;
    const std::array<bool, 2> output_mask = {ctx->needs_input_grad(0), saved[1].defined() && ctx->needs_input_grad(1)};
    if (at::GradMode::is_enabled()) {
      // create_graph: gradients that are differentiable again, from torch's own
      // rms_norm recomputed on the saved input (the rare path; the kernels'
      // gradients are not themselves differentiable).
      return double_backward_grads(grads[0], saved[0], weight, normalized_shape,
                                   optional_double(ctx->saved_data["eps"]), output_mask);
    }
    auto [grad_input, grad_weight] = backward_op.call(grads[0], saved[0], weight, saved[2], normalized_shape,
                                                      output_mask);
    return {output_mask[0] ? grad_input : at::Tensor(), output_mask[1] ? grad_weight : at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor rms_norm_composite(const at::Tensor& input, at::IntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  if (!fuses(input, weight)) {
    // The shapes, dtypes and devices torch's rms_norm takes, checked naming this
    // op (a weight of another dtype is torch's case); the fused path's kernels
    // check their own arguments.
    check_rms_norm_args(kOp, input, normalized_shape, weight.value_or(at::Tensor()), /*fused_kernels=*/false);
    return at::rms_norm(input, normalized_shape, weight, eps);
  }
  const at::Tensor w = weight.value_or(at::Tensor());
  if (!needs_autograd(input) && !(w.defined() && needs_autograd(w))) {
    static const auto forward_op = find_op<ForwardSignature>("torch_tp::_rms_norm_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    return std::get<0>(forward_op.call(input, normalized_shape, weight, eps));
  }
  return RmsNormFunction::apply(input, weight, normalized_shape.vec(), eps);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", rms_norm_composite);
}

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  m.impl("_rms_norm_forward", rms_norm_forward_cpu);
  m.impl("_rms_norm_backward", rms_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  // The pieces are not differentiable themselves; the public op is (NOTE
  // [fused RMSNorm on the CPU]). As the linear ops' pieces (linear.cpp).
  m.impl("_rms_norm_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_rms_norm_backward", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
