// The fused CPU kernels of torch_tp::rms_norm, in every instruction-set
// variant this CPU runs (NOTE [instruction-set variants of the row loops] in
// csrc/ops/cpu_isa.h), against the formulas of NOTE [fused RMSNorm on the
// CPU] evaluated in float64 on the same (rounded) inputs: rstd, the output,
// and both gradients. The op against torch's rms_norm and its autograd is
// test/test_norm.py's.
//
// Rows of lengths with and without a vector-width tail (1, 7, 16, 33, 256,
// 1000), with and without a weight, and an input with no rows. Tolerances,
// relative to the largest magnitude of the compared row (or of dw; for dx,
// of the terms its formula subtracts, Reference::grad_input_scale): float32
// 1e-5 (sums of up to 1000 products whose order differs per variant, a few
// roundings each), float64 1e-12, bfloat16 2^-7 (the stored result's one
// rounding, 2^-8, and float32 arithmetic before it).

#include "ops/norm.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using torch_tp::CpuIsa;

constexpr double kEps = 1e-5;

double tolerance_of(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? 1.0 / 128 : dtype == at::kFloat ? 1e-5 : 1e-12;
}

// |actual - expected| <= tolerance * scale per row of [rows, n] (a 1-D tensor is one row); scale
// [rows, 1], by default each row's largest |expected|.
void expect_rows_close(const at::Tensor& actual, const at::Tensor& expected, double tolerance, const std::string& what,
                       at::Tensor scale = at::Tensor()) {
  const at::Tensor a = actual.to(at::kDouble).reshape({-1, expected.size(-1)});
  const at::Tensor e = expected.reshape({-1, expected.size(-1)});
  ASSERT_EQ(a.sizes(), e.sizes()) << what;
  if (!scale.defined()) {
    scale = e.abs().amax(1, /*keepdim=*/true);
  }
  scale = scale.clamp_min(1e-30);
  const at::Tensor error = ((a - e).abs() / scale).max();
  EXPECT_LE(error.item<double>(), tolerance) << what;
}

struct Reference {
  // grad_input_scale [rows, 1]: rstd * max |dy * w| of the row, the size of the two terms dx's
  // formula subtracts. Where they nearly cancel (a row of one element: xhat = +-1) dx is far
  // smaller than either, and its rounding errors are relative to them, not to dx.
  at::Tensor rstd, out, grad_input, grad_weight, grad_input_scale;
};

// NOTE [fused RMSNorm on the CPU]'s formulas in float64 on x [rows, n], w [n] (or undefined), dy.
Reference reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy) {
  const at::Tensor xd = x.to(at::kDouble), dyd = dy.to(at::kDouble);
  const at::Tensor wd = w.defined() ? w.to(at::kDouble) : at::ones({x.size(-1)}, at::kDouble);
  const at::Tensor rstd = (xd.pow(2).mean(-1) + kEps).rsqrt();
  const at::Tensor xhat = xd * rstd.unsqueeze(-1);
  const at::Tensor g = dyd * wd;
  const at::Tensor grad_input = rstd.unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true));
  const at::Tensor grad_input_scale = rstd.unsqueeze(-1) * g.abs().amax(-1, /*keepdim=*/true);
  return {rstd, xhat * wd, grad_input, (dyd * xhat).sum(0), grad_input_scale};
}

TEST(RmsNormKernels, EveryVariantMatchesFloat64) {
  for (const CpuIsa isa : torch_tp::supported_cpu_isas()) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
      for (const int64_t n : {1, 7, 16, 33, 256, 1000}) {
        for (const bool with_weight : {true, false}) {
          const std::string what = std::string(torch_tp::cpu_isa_name(isa)) + " " + c10::toString(dtype) +
                                   " n=" + std::to_string(n) + (with_weight ? " weight" : " no weight");
          at::manual_seed(n);
          const at::Tensor x = (at::randn({5, n}, at::kDouble) * 3).to(dtype);
          const at::Tensor w = with_weight ? at::randn({n}, at::kDouble).to(dtype) : at::Tensor();
          const at::Tensor dy = at::randn({5, n}, at::kDouble).to(dtype);
          const std::optional<at::Tensor> weight = with_weight ? std::optional<at::Tensor>(w) : std::nullopt;
          const Reference want = reference(x, w, dy);
          const double tolerance = tolerance_of(dtype);

          const auto [out, rstd] = torch_tp::rms_norm_forward_with(isa, x, {n}, weight, kEps);
          EXPECT_EQ(out.scalar_type(), dtype) << what;
          expect_rows_close(rstd.unsqueeze(0), want.rstd.unsqueeze(0), dtype == at::kDouble ? 1e-12 : 1e-6,
                            what + " rstd");
          expect_rows_close(out, want.out, tolerance, what + " output");

          const auto [grad_input, grad_weight] =
              torch_tp::rms_norm_backward_with(isa, dy, x, weight, rstd, {n}, {true, with_weight});
          expect_rows_close(grad_input, want.grad_input, tolerance, what + " grad_input", want.grad_input_scale);
          if (with_weight) {
            expect_rows_close(grad_weight.unsqueeze(0), want.grad_weight.unsqueeze(0), tolerance,
                              what + " grad_weight");
          } else {
            EXPECT_EQ(grad_weight.numel(), 0) << what;
          }
        }
      }
    }
  }
}

TEST(RmsNormKernels, NoRows) {
  for (const CpuIsa isa : torch_tp::supported_cpu_isas()) {
    const at::Tensor x = at::empty({0, 8});
    const at::Tensor w = at::ones({8});
    const auto [out, rstd] = torch_tp::rms_norm_forward_with(isa, x, {8}, w, kEps);
    EXPECT_EQ(out.sizes(), x.sizes()) << torch_tp::cpu_isa_name(isa);
    EXPECT_EQ(rstd.numel(), 0) << torch_tp::cpu_isa_name(isa);
    const auto [grad_input, grad_weight] = torch_tp::rms_norm_backward_with(isa, x, x, w, rstd, {8}, {true, true});
    EXPECT_EQ(grad_input.sizes(), x.sizes()) << torch_tp::cpu_isa_name(isa);
    // No rows: the weight's gradient is a sum of nothing.
    EXPECT_TRUE(grad_weight.equal(at::zeros({8}))) << torch_tp::cpu_isa_name(isa);
  }
}

} // namespace
