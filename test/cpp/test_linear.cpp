// The sharded layers through their public C++ API (torch_tp::column_parallel_linear,
// row_parallel_linear, vocab_parallel_embedding, column_parallel_embedding),
// which call the dispatcher, so the Autograd (or CompositeImplicitAutograd)
// kernels run and backward goes through the ops' own backward collectives.
// Ranks are threads over the in-process backend of thread_backend.h.
//
// Every rank builds the same full (unsharded) tensors from fixed seeds, takes
// its torch.chunk shards, runs the sharded layers, and compares against the
// unsharded computation with plain ATen ops and autograd, computed in its own
// thread. Shapes are chosen so that the shards are uneven for 3 ranks (and,
// for the sequence, empty for one of 4): see NOTE [torch.chunk shards] in
// csrc/ops/comm.h.
//
// NOTE [float64 tolerance]
// The sharded and unsharded computations add the same products in different
// orders: the row layer's GEMM over the hidden dim is split into per-rank
// partial sums that the all-reduce then adds up, its bias is added after the
// reduction rather than inside addmm, and the GELU is evaluated on
// pre-activations that may differ in their last bit. So the results agree to
// rounding only. Each element is a sum of at most 20 products, and the
// gradients chain three such sums, so the difference is a few float64 ulps
// (eps = 1.1e-16) of the terms' magnitude: around 1e-14 relative at most.
// close() allows 1e-10 of the tensor's largest magnitude, four orders of
// magnitude above that, while any sharding mistake (a wrong or shifted shard, a
// missing or doubled reduction, the bias added on every rank) is an O(1)
// relative change. The bound is relative to the whole tensor's scale, not
// elementwise: an element near zero by cancellation carries the rounding error
// of its terms, not of itself. The embeddings' forward values involve no
// arithmetic besides adding exact zeros, so they are compared exactly.

#include "test_util.h"
#include "thread_backend.h"

#include <torch_tp/ops.h>

#include "ops/gemm_cpu.h"
#include "ops/gemv_cpu.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using torch_tp::testing::equal_exactly;
using torch_tp::testing::run_ranks;
using torch_tp::testing::throws_with;

constexpr double kRelativeTolerance = 1e-10;  // NOTE [float64 tolerance]

// Standard normal float64 values from their own generator: the same on every
// rank (thread) that asks for the same seed.
at::Tensor seeded_normal(at::IntArrayRef sizes, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, generator, at::TensorOptions().dtype(at::kDouble));
}

// Rank `rank`'s piece of t along `dim` as torch.chunk(t, world_size, dim) cuts
// it; ranks past the last piece (torch.chunk may return fewer) get an empty one.
at::Tensor chunk_piece(const at::Tensor& t, int64_t dim, int world_size, int rank) {
  const auto pieces = t.chunk(world_size, dim);
  if (static_cast<size_t>(rank) < pieces.size()) {
    return pieces[rank];
  }
  return t.narrow(dim, t.size(dim), 0);
}

// Same dtype and sizes, and max |actual - expected| <= 1e-10 * max |expected|.
::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected) {
  if (!actual.defined()) {
    return ::testing::AssertionFailure() << "undefined (no gradient?)";
  }
  if (actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype " << actual.scalar_type() << ", expected "
                                         << expected.scalar_type();
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "sizes " << actual.sizes() << ", expected " << expected.sizes();
  }
  if (expected.numel() == 0) {
    return ::testing::AssertionSuccess();
  }
  const double scale = expected.abs().max().item<double>();
  const double error = (actual - expected).abs().max().item<double>();
  if (std::isfinite(error) && error <= kRelativeTolerance * scale) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "max |actual - expected| = " << error << " > " << kRelativeTolerance
                                       << " * max |expected| = " << kRelativeTolerance * scale << "\nactual:\n"
                                       << actual << "\nexpected:\n"
                                       << expected;
}

class Linear : public ::testing::TestWithParam<int> {};
class Embedding : public ::testing::TestWithParam<int> {};

// ------------------------------------------------------------- column -> row MLP
// y = row(act(column(x, W1_r, b1_r)), W2_r, b2): Megatron's MLP block, against
// y = linear(act(linear(x, W1, b1)), W2, b2) on the full weights.

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 5;      // over 2 ranks: 3 + 2; over 4: 2 + 2 + 1 + 0
constexpr int64_t kHidden = 8;
constexpr int64_t kFfn = 20;     // over 3 ranks: 7 + 7 + 6

// The full tensors, identical on every rank. g is the upstream gradient:
// the loss is (y * g).sum().
struct FullMlp {
  at::Tensor x, w1, b1, w2, b2, g;
};

FullMlp make_full_mlp() {
  return {seeded_normal({kBatch, kSeq, kHidden}, 11),
          seeded_normal({kFfn, kHidden}, 12).div_(std::sqrt(static_cast<double>(kHidden))),
          seeded_normal({kFfn}, 13),
          seeded_normal({kHidden, kFfn}, 14).div_(std::sqrt(static_cast<double>(kFfn))),
          seeded_normal({kHidden}, 15),
          seeded_normal({kBatch, kSeq, kHidden}, 16)};
}

// The output and the gradients of the loss; the bias gradients stay undefined without biases.
struct MlpResult {
  at::Tensor y, x_grad, w1_grad, b1_grad, w2_grad, b2_grad;
};

MlpResult reference_mlp(const FullMlp& m, bool with_bias, bool gelu) {
  const at::Tensor x = m.x.clone().requires_grad_(true);
  const at::Tensor w1 = m.w1.clone().requires_grad_(true);
  const at::Tensor b1 = m.b1.clone().requires_grad_(true);
  const at::Tensor w2 = m.w2.clone().requires_grad_(true);
  const at::Tensor b2 = m.b2.clone().requires_grad_(true);
  at::Tensor h = at::linear(x, w1, with_bias ? std::optional<at::Tensor>(b1) : std::nullopt);
  if (gelu) {
    h = at::gelu(h, "tanh");
  }
  const at::Tensor y = at::linear(h, w2, with_bias ? std::optional<at::Tensor>(b2) : std::nullopt);
  (y * m.g).sum().backward();
  return {y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
}

struct MlpVariant {
  bool with_bias;
  const char* activation;  // "gelu_tanh" or "none"
  std::optional<int64_t> seq_dim;  // sequence parallelism along it, or replicated x
};

std::string describe(const MlpVariant& v) {
  return c10::str("bias=", v.with_bias, " activation=", v.activation, " seq_dim=",
                  v.seq_dim ? std::to_string(*v.seq_dim) : std::string("none"));
}

// Runs the sharded MLP on this rank and checks it against the reference.
void check_sharded_mlp(const MlpVariant& v, int world_size, int rank, const std::string& group) {
  SCOPED_TRACE(describe(v));
  const FullMlp m = make_full_mlp();
  const bool gelu = std::string(v.activation) == "gelu_tanh";
  const MlpResult ref = reference_mlp(m, v.with_bias, gelu);
  const int64_t seq = 1;  // the sequence dim of x, y and g, whatever v.seq_dim spells it

  // Replicated x, or this rank's piece of the sequence.
  const at::Tensor x = (v.seq_dim ? chunk_piece(m.x, seq, world_size, rank) : m.x).clone().requires_grad_(true);
  const at::Tensor w1 = chunk_piece(m.w1, 0, world_size, rank).clone().requires_grad_(true);
  const at::Tensor b1 = chunk_piece(m.b1, 0, world_size, rank).clone().requires_grad_(true);
  const at::Tensor w2 = chunk_piece(m.w2, 1, world_size, rank).clone().requires_grad_(true);
  const at::Tensor b2 = m.b2.clone().requires_grad_(true);
  const auto bias1 = v.with_bias ? std::optional<at::Tensor>(b1) : std::nullopt;
  const auto bias2 = v.with_bias ? std::optional<at::Tensor>(b2) : std::nullopt;

  const at::Tensor h = torch_tp::column_parallel_linear(x, w1, bias1, group, v.seq_dim,
                                                        v.seq_dim ? std::optional<int64_t>(kSeq) : std::nullopt,
                                                        v.activation);
  ASSERT_EQ(h.sizes(), at::IntArrayRef({kBatch, kSeq, w1.size(0)}));
  const at::Tensor y = torch_tp::row_parallel_linear(h, w2, bias2, group, v.seq_dim);
  ASSERT_TRUE(y.requires_grad());

  const at::Tensor g = v.seq_dim ? chunk_piece(m.g, seq, world_size, rank) : m.g;
  EXPECT_TRUE(close(y.detach(), v.seq_dim ? chunk_piece(ref.y, seq, world_size, rank) : ref.y));
  (y * g).sum().backward();

  EXPECT_TRUE(close(x.grad(), v.seq_dim ? chunk_piece(ref.x_grad, seq, world_size, rank) : ref.x_grad)) << "x.grad";
  // Every weight gradient is complete on its rank (NOTE [no partial gradients]
  // in linear.cpp), under sequence parallelism too.
  EXPECT_TRUE(close(w1.grad(), chunk_piece(ref.w1_grad, 0, world_size, rank))) << "W1_r.grad";
  EXPECT_TRUE(close(w2.grad(), chunk_piece(ref.w2_grad, 1, world_size, rank))) << "W2_r.grad";
  if (v.with_bias) {
    EXPECT_TRUE(close(b1.grad(), chunk_piece(ref.b1_grad, 0, world_size, rank))) << "b1_r.grad";
    EXPECT_TRUE(close(b2.grad(), ref.b2_grad)) << "b2.grad";
  } else {
    EXPECT_FALSE(b1.grad().defined());
    EXPECT_FALSE(b2.grad().defined());
  }
}

TEST_P(Linear, ColumnThenRowMatchesUnshardedMlp) {
  const int world_size = GetParam();
  run_ranks(world_size, [&](int rank, const std::string& group) {
    check_sharded_mlp({true, "gelu_tanh", std::nullopt}, world_size, rank, group);
    check_sharded_mlp({false, "none", std::nullopt}, world_size, rank, group);
  });
}

// x sharded along the sequence (torch.chunk pieces: uneven for 2 and 3 ranks,
// and rank 3 of 4 holds none); column gathers it, row reduce-scatters y.
TEST_P(Linear, SequenceParallelColumnThenRowMatchesUnshardedMlp) {
  const int world_size = GetParam();
  run_ranks(world_size, [&](int rank, const std::string& group) {
    check_sharded_mlp({true, "gelu_tanh", 1}, world_size, rank, group);
    check_sharded_mlp({true, "gelu_tanh", -2}, world_size, rank, group);
    check_sharded_mlp({false, "none", 1}, world_size, rank, group);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Linear, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return c10::str("w", info.param); });

// ------------------------------------------------------------------ embeddings
// A table of 11 rows (over 3 ranks: 4 + 4 + 3; over 4: 3 + 3 + 3 + 2) of dim 7
// (over 3 ranks: 3 + 3 + 1), against at::embedding on the full table.

constexpr int64_t kVocab = 11;
constexpr int64_t kDim = 7;

// [2, 5]: repeated ids, ids on every rank's rows, ids 4 and 10 (the padding
// rows tried below) twice each.
at::Tensor embedding_ids(at::ScalarType dtype) {
  return at::tensor({0, 4, 10, 7, 4, 3, 8, 1, 10, 3}, at::TensorOptions().dtype(at::kLong)).view({2, 5}).to(dtype);
}

// Global padding ids: none, one that is local row 0 of rank 1 for 3 ranks (so
// it coincides with the local index the vocab-parallel op gives ids it does
// not own), and -1 (row 10, the last rank's).
const std::vector<std::optional<int64_t>> kPaddings{std::nullopt, 4, -1};

struct EmbeddingResult {
  at::Tensor out, weight_grad;
};

EmbeddingResult reference_embedding(const at::Tensor& table, const at::Tensor& ids, std::optional<int64_t> padding,
                                    const at::Tensor& g) {
  const at::Tensor weight = table.clone().requires_grad_(true);
  // at::embedding takes a non-negative padding_idx, or -1 for none.
  const int64_t padding_idx = padding ? (*padding < 0 ? *padding + table.size(0) : *padding) : -1;
  const at::Tensor out = at::embedding(weight, ids.to(at::kLong), padding_idx);
  (out * g).sum().backward();
  return {out.detach(), weight.grad()};
}

std::string describe_padding(std::optional<int64_t> padding) {
  return padding ? c10::str("padding_idx=", *padding) : std::string("padding_idx=None");
}

TEST_P(Embedding, VocabParallelMatchesFullTable) {
  const int world_size = GetParam();
  const at::Tensor table = seeded_normal({kVocab, kDim}, 21);
  const at::Tensor g_full = seeded_normal({2, 5, kDim}, 22);
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const auto padding : kPaddings) {
      for (const auto dtype : {at::kLong, at::kInt}) {
        for (const auto scatter_dim : {std::optional<int64_t>(), std::optional<int64_t>(1)}) {
          SCOPED_TRACE(c10::str(describe_padding(padding), " ids ", dtype, " scatter_dim=",
                                scatter_dim ? std::to_string(*scatter_dim) : std::string("None")));
          const at::Tensor ids = embedding_ids(dtype);
          const EmbeddingResult ref = reference_embedding(table, ids, padding, g_full);
          const at::Tensor weight = chunk_piece(table, 0, world_size, rank).clone().requires_grad_(true);
          const at::Tensor out =
              torch_tp::vocab_parallel_embedding(ids, weight, group, kVocab, padding, scatter_dim);
          // Replicated, or this rank's piece of the sequence (dim 1 of ids).
          const at::Tensor g = scatter_dim ? chunk_piece(g_full, 1, world_size, rank) : g_full;
          EXPECT_TRUE(equal_exactly(out.detach(), scatter_dim ? chunk_piece(ref.out, 1, world_size, rank) : ref.out));
          (out * g).sum().backward();
          const at::Tensor expected_grad = chunk_piece(ref.weight_grad, 0, world_size, rank);
          EXPECT_TRUE(close(weight.grad(), expected_grad));
          if (padding) {
            // The padding row gets no gradient though its id occurs twice.
            const int64_t row = *padding < 0 ? *padding + kVocab : *padding;
            const int64_t start = std::min<int64_t>(rank * ((kVocab + world_size - 1) / world_size), kVocab);
            ASSERT_TRUE(equal_exactly(ref.weight_grad[row], at::zeros({kDim}, at::kDouble)));
            if (row >= start && row < start + weight.size(0)) {
              EXPECT_TRUE(equal_exactly(weight.grad()[row - start], at::zeros({kDim}, at::kDouble)));
            }
          }
        }
      }
    }
  });
}

// 5 rows over 4 ranks: 2 + 2 + 1 + 0, so rank 3 holds no rows and contributes
// zeros. Its output must still take part in autograd like every other rank's:
// under sequence parallelism the backward of the reduce-scatter is an
// all-gather, which every rank must join. The loss goes through a replicated
// parameter after the embedding, as in a model, so every rank's loss needs a
// backward whether or not its embedding output requires grad.
TEST(EmbeddingEdgeCases, VocabParallelWithARankThatHoldsNoRows) {
  constexpr int world_size = 4;
  constexpr int64_t vocab = 5;
  const at::Tensor table = seeded_normal({vocab, kDim}, 23);
  const at::Tensor ids = at::tensor({4, 0, 2, 2, 3, 1, 0, 4}, at::TensorOptions().dtype(at::kLong)).view({2, 4});
  const at::Tensor g_full = seeded_normal({2, 4, kDim}, 24);
  const EmbeddingResult ref = reference_embedding(table, ids, std::nullopt, g_full);
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const auto scatter_dim : {std::optional<int64_t>(), std::optional<int64_t>(1)}) {
      SCOPED_TRACE(c10::str("scatter_dim=", scatter_dim ? std::to_string(*scatter_dim) : std::string("None")));
      const at::Tensor weight = chunk_piece(table, 0, world_size, rank).clone().requires_grad_(true);
      ASSERT_EQ(weight.size(0), rank == 3 ? 0 : (rank == 2 ? 1 : 2));
      const at::Tensor out = torch_tp::vocab_parallel_embedding(ids, weight, group, vocab, std::nullopt, scatter_dim);
      EXPECT_TRUE(out.requires_grad()) << "the output of a table that requires grad must require grad on every rank";
      const at::Tensor g = scatter_dim ? chunk_piece(g_full, 1, world_size, rank) : g_full;
      EXPECT_TRUE(equal_exactly(out.detach(), scatter_dim ? chunk_piece(ref.out, 1, world_size, rank) : ref.out));
      const at::Tensor scale = at::ones({kDim}, at::kDouble).requires_grad_(true);
      (out * scale * g).sum().backward();
      if (rank == 3) {
        // Nothing was looked up in the empty table: no gradient, or an empty one.
        EXPECT_TRUE(!weight.grad().defined() || weight.grad().numel() == 0);
      } else {
        EXPECT_TRUE(close(weight.grad(), chunk_piece(ref.weight_grad, 0, world_size, rank)));
      }
    }
  });
}

TEST_P(Embedding, ColumnParallelMatchesFullTable) {
  const int world_size = GetParam();
  const at::Tensor table = seeded_normal({kVocab, kDim}, 31);
  const at::Tensor g_full = seeded_normal({2, 5, kDim}, 32);
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const auto padding : kPaddings) {
      for (const bool sequence_parallel : {false, true}) {
        SCOPED_TRACE(c10::str(describe_padding(padding), " sequence_parallel=", sequence_parallel));
        const at::Tensor all_ids = embedding_ids(at::kLong);
        const EmbeddingResult ref = reference_embedding(table, all_ids, padding, g_full);
        const at::Tensor weight = chunk_piece(table, 1, world_size, rank).clone().requires_grad_(true);
        // With sequence parallelism each rank holds a piece of the ids (3 + 2 over 2 ranks), gathered first.
        const at::Tensor ids = sequence_parallel ? chunk_piece(all_ids, 1, world_size, rank).contiguous() : all_ids;
        const at::Tensor out = sequence_parallel
            ? torch_tp::column_parallel_embedding(ids, weight, group, padding, 1, all_ids.size(1))
            : torch_tp::column_parallel_embedding(ids, weight, group, padding);
        EXPECT_TRUE(equal_exactly(out.detach(), chunk_piece(ref.out, 2, world_size, rank)));
        (out * chunk_piece(g_full, 2, world_size, rank)).sum().backward();
        EXPECT_TRUE(close(weight.grad(), chunk_piece(ref.weight_grad, 1, world_size, rank)));
        if (padding) {
          const int64_t row = *padding < 0 ? *padding + kVocab : *padding;
          EXPECT_TRUE(equal_exactly(weight.grad()[row], at::zeros({weight.size(1)}, at::kDouble)));
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Embedding, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return c10::str("w", info.param); });

// -------------------------------------------------------------------- errors
// Every rank makes the same bad call, each failing before any collective, so no
// rank is left waiting; after them all, one good call shows the ranks are
// still in step. The expected fragments are the TORCH_CHECK messages of
// linear.cpp, embedding.cpp and comm.cpp: the op, the argument and its value.

// NOTE [few-row GEMV on the CPU]: every instruction-set variant this CPU runs
// (AVX-512 BF16, AVX2) against ATen's linear in float64, for every row count
// the kernel takes, K and N tails (K = 56 and 48: the row-by-row loop's single
// vectors after its 4-vector steps), with and without bias. The kernel sums in
// float32 in its own order: each result is within 2 (K + 8) 2^-24 of
// max_j sum_k |x_k w_jk| + |b_j| of the float64 value (at most K / 8 + 8
// roundings per term: a lane's sum, the lanes' sum, the tail, the bias), plus,
// for a half-precision output, its rounding to nearest: half an ulp, 2^-8 of
// max |y| in bfloat16 (8 significant bits), 2^-11 in float16 (11).
TEST(SmallBatchGemv, EveryVariantThisCpuRunsMatchesLinear) {
  const std::vector<torch_tp::GemvIsa> isas = torch_tp::supported_gemv_isas();
  if (isas.empty()) {
    GTEST_SKIP() << "no GEMV variant runs on this CPU";
  }
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{100, 37}, {64, 16}, {512, 40}, {33, 1}, {1, 5},
                                                           {70, 9},   {1024, 13}, {56, 7},  {48, 3}};
  uint64_t seed = 0;
  for (const torch_tp::GemvIsa isa : isas) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const auto& [K, N] : shapes) {
        const at::Tensor w = seeded_normal({N, K}, ++seed).to(dtype);
        const at::Tensor b = seeded_normal({N}, ++seed).to(dtype);
        for (int64_t M = 1; M <= torch_tp::kSmallBatchRows; ++M) {
          const at::Tensor x = seeded_normal({M, K}, ++seed).to(dtype);
          for (const bool with_bias : {true, false}) {
            const std::optional<at::Tensor> bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
            const std::optional<at::Tensor> y = torch_tp::small_batch_linear_cpu_with(isa, x, w, bias);
            ASSERT_TRUE(y.has_value()) << torch_tp::gemv_isa_name(isa);
            const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble), bd = b.to(at::kDouble);
            const at::Tensor expected = with_bias ? at::linear(xd, wd, bd) : at::linear(xd, wd);
            const at::Tensor terms = at::linear(xd.abs(), wd.abs()) + (with_bias ? bd.abs() : at::zeros_like(bd));
            double bound = 2.0 * static_cast<double>(K + 8) * std::ldexp(1.0, -24) * terms.max().item<double>();
            if (dtype != at::kFloat) {
              bound += std::ldexp(1.0, dtype == at::kBFloat16 ? -8 : -11) * expected.abs().max().item<double>();
            }
            const double error = (y->to(at::kDouble) - expected).abs().max().item<double>();
            EXPECT_LE(error, bound) << torch_tp::gemv_isa_name(isa) << " " << dtype << " M=" << M << " K=" << K
                                    << " N=" << N << " bias=" << with_bias;
          }
        }
      }
    }
  }
}

// NOTE [half-precision GEMMs through float32 panels]: on a CPU without a native
// bfloat16 / float16 GEMM, local_mm computes the product in float32 and rounds
// each entry once. So every entry is within half an ulp of the float64 product
// of the same half-precision inputs (2^-8 of it in bfloat16, 2^-11 in float16),
// plus the float32 sum's own error, 2 (K + 8) 2^-24 sum_k |a_ik b_kj| (+ |bias_j|)
// as in the GEMV's bound above (ATen's GEMMs meet it too). The bound is per
// entry: a lost or doubled panel column, a shifted panel, a bias added twice or
// a second rounding breaks it. The layouts are the linear ops' GEMMs: x @ W^T
// (forward, with and without bias), grad @ W (grad_x) and grad^T @ x
// (grad_weight); K = 2048 and N = 600 give several panels of ~2 MiB. Three rows
// are the fewest the panels take against a row-major W; two stay ATen's.
TEST(HalfPrecisionGemm, EachEntryIsTheFloat32ProductRoundedOnce) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    if (!torch_tp::half_gemm_through_float32(dtype)) {
      continue;  // ATen's own GEMM (oneDNN) runs this dtype here
    }
    const double half_ulp = std::ldexp(1.0, dtype == at::kBFloat16 ? -8 : -11);
    constexpr int64_t M = 24, K = 2048, N = 600;
    const at::Tensor x = seeded_normal({M, K}, 1).to(dtype);
    const at::Tensor w = seeded_normal({N, K}, 2).to(dtype);
    const at::Tensor grad = seeded_normal({M, N}, 3).to(dtype);
    const at::Tensor bias = seeded_normal({N}, 4).to(dtype);
    struct Case {
      const char* what;
      at::Tensor a, b;
      std::optional<at::Tensor> bias;
    };
    const std::vector<Case> cases = {{"x @ W^T", x, w.t(), std::nullopt},
                                     {"x @ W^T + b", x, w.t(), bias},
                                     {"grad @ W", grad, w, std::nullopt},
                                     {"grad^T @ x", grad.t(), x, std::nullopt},
                                     {"3 rows @ W^T", x.narrow(0, 0, 3), w.t(), std::nullopt},
                                     {"2 rows @ W^T (ATen's dot products)", x.narrow(0, 0, 2), w.t(), bias}};
    for (const Case& c : cases) {
      const at::Tensor y = torch_tp::local_mm(c.a, c.b, c.bias);
      ASSERT_EQ(y.scalar_type(), dtype) << c.what;
      const at::Tensor ad = c.a.to(at::kDouble), bd = c.b.to(at::kDouble);
      at::Tensor expected = ad.mm(bd), terms = ad.abs().mm(bd.abs());
      if (c.bias) {
        expected = expected + c.bias->to(at::kDouble);
        terms = terms + c.bias->to(at::kDouble).abs();
      }
      const int64_t k = c.a.size(1);
      const at::Tensor bound =
          expected.abs() * half_ulp + terms * (2.0 * static_cast<double>(k + 8) * std::ldexp(1.0, -24));
      const at::Tensor excess = (y.to(at::kDouble) - expected).abs() - bound;
      EXPECT_LE(excess.max().item<double>(), 0.0) << dtype << " " << c.what << ": "
                                                  << (excess > 0).sum().item<int64_t>() << " entries off";
    }
  }
}

TEST(LinearErrors, ColumnParallelLinearMessagesNameTheOpTheArgumentAndTheValue) {
  run_ranks(2, [](int rank, const std::string& group) {
    constexpr const char* op = "torch_tp::column_parallel_linear";
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor x = at::ones({2, 3, 4}, f64);
    const at::Tensor w = at::ones({5, 4}, f64);
    const at::Tensor b = at::ones({5}, f64);

    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, at::ones({5, 3}, f64), b, group); },
                            {op, "x.size(-1)=4", "weight.size(1)=3"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, at::ones({6}, f64), group); },
                            {op, "bias must have shape [5]", "got [6]"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b, group, 3); },
                            {op, "gather_dim=3", "out of range for x of 3 dimensions"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b, group, -4); },
                            {op, "gather_dim=-4", "out of range for x of 3 dimensions"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b, group, 2); },
                            {op, "gather_dim=2", "is the feature dimension"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b, group, -1); },
                            {op, "gather_dim=-1", "is the feature dimension"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w.to(at::kFloat), b, group); },
                            {op, "weight has dtype Float", "x has dtype Double"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b.to(at::kFloat), group); },
                            {op, "bias has dtype Float", "x has dtype Double"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x.to(at::kLong), w, b, group); },
                            {op, "x has dtype Long"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(x, w, b, group, std::nullopt, std::nullopt, "relu"); },
                            {op, "activation='relu'", "not supported"}));
    // 4 rows along gather_dim 1 are neither rank's torch.chunk piece of full_size=5 (3 and 2).
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_linear(at::ones({2, 4, 4}, f64), w, b, group, 1, 5); },
                            {op, "x.size(1)=4", "full_size=5", c10::str("has ", rank == 0 ? 3 : 2, " rows")}));

    const at::Tensor y = torch_tp::column_parallel_linear(x, w, b, group);
    EXPECT_TRUE(equal_exactly(torch_tp::all_reduce(y, "sum", group), at::full({2, 3, 5}, 10.0, f64)));
  });
}

TEST(LinearErrors, RowParallelLinearMessagesNameTheOpTheArgumentAndTheValue) {
  run_ranks(2, [](int /*rank*/, const std::string& group) {
    constexpr const char* op = "torch_tp::row_parallel_linear";
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor x = at::ones({2, 3, 4}, f64);
    const at::Tensor w = at::ones({5, 4}, f64);
    const at::Tensor b = at::ones({5}, f64);

    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, at::ones({5, 3}, f64), b, group); },
                            {op, "x.size(-1)=4", "weight.size(1)=3"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, at::ones({4}, f64), group); },
                            {op, "bias must have shape [5]", "got [4]"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, b, group, 3); },
                            {op, "scatter_dim=3", "out of range for x of 3 dimensions"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, b, group, -4); },
                            {op, "scatter_dim=-4", "out of range for x of 3 dimensions"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, b, group, 2); },
                            {op, "scatter_dim=2", "is the feature dimension"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, b, group, -1); },
                            {op, "scatter_dim=-1", "is the feature dimension"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w.to(at::kFloat), b, group); },
                            {op, "weight has dtype Float", "x has dtype Double"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::row_parallel_linear(x, w, b.to(at::kFloat), group); },
                            {op, "bias has dtype Float", "x has dtype Double"}));

    // Each rank's partial sum is 4 per element; 8 after the all-reduce, plus the bias once.
    EXPECT_TRUE(equal_exactly(torch_tp::row_parallel_linear(x, w, b, group), at::full({2, 3, 5}, 9.0, f64)));
  });
}

TEST(EmbeddingErrors, MessagesNameTheOpTheArgumentAndTheValue) {
  run_ranks(2, [](int rank, const std::string& group) {
    constexpr const char* vocab_op = "torch_tp::vocab_parallel_embedding";
    constexpr const char* column_op = "torch_tp::column_parallel_embedding";
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor ids = at::zeros({2, 3}, at::kLong);
    const int64_t rows = rank == 0 ? 6 : 5;  // torch.chunk(11, 2)
    const at::Tensor w = at::ones({rows, 4}, f64);

    // The full table where the shard belongs.
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids, at::ones({11, 4}, f64), group, 11); },
                            {vocab_op, "weight.size(0)=11",
                             c10::str("rank ", rank, "'s torch.chunk piece of vocab_size=11 over 2 ranks has ", rows,
                                      " rows")}));
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids, w, group, 11, 11); },
                            {vocab_op, "padding_idx=11", "out of range for 11 embeddings"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids, w, group, 11, -12); },
                            {vocab_op, "padding_idx=-12", "out of range for 11 embeddings"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids.to(at::kFloat), w, group, 11); },
                            {vocab_op, "ids has dtype Float", "expected int64 or int32"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids, w, group, 11, std::nullopt, 2); },
                            {vocab_op, "scatter_dim=2", "is the embedding dimension"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::vocab_parallel_embedding(ids, w, group, 11, std::nullopt, 3); },
                            {vocab_op, "scatter_dim=3", "out of range"}));

    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_embedding(ids, at::ones({11, 2}, f64), group, 11); },
                            {column_op, "padding_idx=11", "out of range for 11 embeddings"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_embedding(ids.to(at::kFloat), w, group); },
                            {column_op, "ids has dtype Float", "expected int64 or int32"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::column_parallel_embedding(ids, w, group, std::nullopt, 2); },
                            {column_op, "gather_dim=2", "out of range for ids of 2 dimensions"}));

    // Id 0 is rank 0's: the all-reduced lookup is its row of ones on both ranks.
    EXPECT_TRUE(equal_exactly(torch_tp::vocab_parallel_embedding(ids, w, group, 11), at::ones({2, 3, 4}, f64)));
  });
}

} // namespace
