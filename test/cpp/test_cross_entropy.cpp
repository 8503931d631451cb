// The fused CPU loops of torch_tp::vocab_parallel_cross_entropy, in every
// instruction-set variant this CPU runs (NOTE [exp in the row loops] in
// csrc/ops/cross_entropy.cpp), against the same quantities computed in
// float64 by ATen: each row's max, sum of exp and target logit, and the
// logits' gradient. The op's values over ranks are test/test_loss_parallel.py's.
//
// Rows: lengths with and without a vector-width tail, one longer than the
// sum's float block (kSumBlock, 1024), a rank holding no classes (n = 0);
// masked classes (-inf), a whole row of them, one +inf, one nan, and logits
// spread so widely that most exps underflow. Tolerances, relative: the
// float32 sum of exp 2e-6 (each exp within 2 ulp, the float block sums of at
// most 256 terms in [0, 1]); the float32 gradient 1e-6 of its row's largest
// magnitude (an exp, a product, a rounding); bfloat16 2^-8 (one rounding of
// the stored gradient); max and target logit exactly.

#include "ops/cross_entropy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using torch_tp::CpuIsa;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A [rows, n] float64 batch of logits with the special rows above, n > 0.
at::Tensor logits_of(int64_t n) {
  at::manual_seed(n);
  at::Tensor x = at::randn({6, n}, at::kDouble) * 4;
  x[1].narrow(0, 0, (n + 1) / 2).fill_(-kInf);  // masked classes
  x[2].fill_(-kInf);                             // a row of them
  x[3][n / 2] = kInf;
  x[4][n - 1] = std::nan("");
  x[5] *= 100;  // exps far below FLT_MIN
  return x;
}

// (m_r, S_r = sum exp(x - shift), x_t or 0) in float64 as the NOTE defines them.
at::Tensor reference_statistics(const at::Tensor& x, const at::Tensor& target, int64_t class_start) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::zeros({3, rows}, at::kDouble);
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor row = x[r];
    const double m = n == 0 ? -kInf : (row.isnan().any().item<bool>() ? std::nan("") : row.max().item<double>());
    const double shift = std::isinf(m) ? 0.0 : m;
    out[0][r] = m;
    out[1][r] = n == 0 ? 0.0 : (row - shift).exp().sum().item<double>();
    const int64_t local = target[r].item<int64_t>() - class_start;
    out[2][r] = local >= 0 && local < n ? row[local].item<double>() : 0.0;
  }
  return out;
}

// |actual - expected| <= tolerance * |expected| elementwise (nan and inf where expected has them).
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tolerance, const std::string& what) {
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  ASSERT_EQ(a.sizes(), e.sizes()) << what;
  for (int64_t i = 0; i < e.numel(); ++i) {
    const double av = a.view(-1)[i].item<double>(), ev = e.view(-1)[i].item<double>();
    if (std::isnan(ev) || std::isinf(ev)) {
      EXPECT_TRUE(std::isnan(ev) ? std::isnan(av) : av == ev) << what << " element " << i << ": " << av << " vs " << ev;
    } else {
      EXPECT_LE(std::abs(av - ev), tolerance * std::abs(ev)) << what << " element " << i << ": " << av << " vs " << ev;
    }
  }
}

TEST(CrossEntropyRows, EveryInstructionSetGivesTheStatisticsOfFloat64) {
  for (const CpuIsa isa : torch_tp::supported_cpu_isas()) {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t n : {1, 15, 16, 17, 100, 1000, 2500}) {
        const std::string what = std::string(torch_tp::cpu_isa_name(isa)) + " " +
                                 c10::toString(dtype) + " n=" + std::to_string(n);
        const at::Tensor x = logits_of(n).to(dtype);
        const int64_t class_start = 7;  // targets below it and past its classes are not here
        const at::Tensor target = at::tensor(std::vector<int64_t>{7 + n / 3, 3, 7, 7 + n - 1, 7 + n, 7});
        const at::Tensor got = torch_tp::cross_entropy_local_statistics_with(isa, x, target, class_start);
        const at::Tensor want = reference_statistics(x.to(at::kDouble), target, class_start);
        expect_close(got[0], want[0], 0.0, what + " max");
        expect_close(got[1], want[1], 2e-6, what + " sum of exp");
        expect_close(got[2], want[2], 0.0, what + " target logit");
      }
    }
  }
}

TEST(CrossEntropyRows, ARankWithoutClassesGivesAnEmptyShard) {
  for (const CpuIsa isa : torch_tp::supported_cpu_isas()) {
    const at::Tensor got =
        torch_tp::cross_entropy_local_statistics_with(isa, at::empty({3, 0}), at::zeros({3}, at::kLong), 0);
    expect_close(got, at::tensor({-kInf, -kInf, -kInf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0}).view({3, 3}), 0.0,
                 torch_tp::cpu_isa_name(isa));
  }
}

TEST(CrossEntropyRows, EveryInstructionSetGivesTheGradientOfFloat64) {
  for (const CpuIsa isa : torch_tp::supported_cpu_isas()) {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t n : {1, 15, 16, 17, 1000, 2500}) {
        const std::string what = std::string(torch_tp::cpu_isa_name(isa)) + " " +
                                 c10::toString(dtype) + " n=" + std::to_string(n);
        // Finite rows (the special values' gradients are nan or 0 by the same formula, shown above for the sums).
        at::manual_seed(n + 1);
        const at::Tensor x = (at::randn({4, n}, at::kDouble) * 4).to(dtype);
        const at::Tensor target = at::tensor(std::vector<int64_t>{n / 2, 0, n - 1, n + 3});
        const at::Tensor xd = x.to(at::kDouble);
        // A global max and sum of exp from "other ranks": the row's own max plus 1, and a sum above this
        // rank's; float32, as the op holds them, and the reference takes them as rounded.
        const at::Tensor max = (std::get<0>(xd.max(1)) + 1).to(at::kFloat);
        const at::Tensor sum_exp = ((xd - max.to(at::kDouble).unsqueeze(1)).exp().sum(1) * 1.5).to(at::kFloat);
        const at::Tensor scale = at::tensor({0.25f, -1.0f, 2.0f, 0.5f});
        const at::Tensor got = torch_tp::cross_entropy_logits_grad_with(isa, x, target, max, sum_exp, scale, 0);
        const at::Tensor scale_d = scale.to(at::kDouble);
        at::Tensor want = (xd - max.to(at::kDouble).unsqueeze(1)).exp() *
                          (scale_d / sum_exp.to(at::kDouble)).unsqueeze(1);
        for (int64_t r = 0; r < 4; ++r) {
          const int64_t t = target[r].item<int64_t>();
          if (t < n) {
            want[r][t] -= scale_d[r];
          }
        }
        ASSERT_EQ(got.scalar_type(), dtype) << what;
        const double tolerance = dtype == at::kFloat ? 1e-6 : 1.0 / (1 << 8);
        for (int64_t r = 0; r < 4; ++r) {
          const double row_scale = want[r].abs().max().item<double>();
          const double error = (got[r].to(at::kDouble) - want[r]).abs().max().item<double>();
          EXPECT_LE(error, tolerance * row_scale) << what << " row " << r;
        }
      }
    }
  }
}

} // namespace
