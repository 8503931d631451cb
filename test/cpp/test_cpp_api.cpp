// The C++ API a LibTorch program uses without Python: torch_tp::new_group
// (the shared-memory backend from a c10d Store, registered by name) and the
// torch_tp::nn modules, with ranks as threads of this process over one
// HashStore (all on one node; c10d's registry in thread-isolation mode, as in
// thread_backend.h, so every rank registers its own group under one name).
//
// An MLP with a vocab-parallel embedding, a column- and a row-parallel linear
// at 3 ranks (uneven shards: 10 vocabulary rows are 4, 4, 2; 11 hidden units
// 4, 4, 3) must give the unsharded torch::nn layers' output and, for each
// shard, that shard of the unsharded gradients: replicated, and with sequence
// parallelism (the embedding reduce-scatters the sequence, the column layer
// gathers it, the row layer scatters it again); with the GELU applied between
// the layers, and fused into the column layer (activation "gelu_tanh").
//
// Tolerance: float64, and the sharded layers add the same products in another
// order (per-rank partial sums, then the reduction), so results agree to a few
// ulps of the terms (~1e-15 here); kTolerance is far above that and far below
// any sharding mistake, which is an O(1) change.

#include "test_util.h"

#include <torch_tp/backend.h>
#include <torch_tp/nn.h>
#include <torch_tp/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <dirent.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using torch_tp::testing::contains;
using torch_tp::testing::throws_with;

constexpr double kTolerance = 1e-12;
constexpr int kWorldSize = 3;
constexpr int64_t kVocab = 10, kDim = 6, kHidden = 11, kSeq = 5, kBatch = 2;

::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected) {
  if (!actual.defined()) {
    return ::testing::AssertionFailure() << "undefined (no gradient?)";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "sizes " << actual.sizes() << ", expected " << expected.sizes();
  }
  if (!at::allclose(actual, expected, /*rtol=*/0, /*atol=*/kTolerance)) {
    return ::testing::AssertionFailure() << "max |difference| " << (actual - expected).abs().max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

// The unsharded layers, identical for every rank (made once, read by all threads).
struct FullModel {
  torch::nn::Embedding embedding{kVocab, kDim};
  torch::nn::Linear up{kDim, kHidden};
  torch::nn::Linear down{kHidden, kDim};
  FullModel() {
    embedding->to(at::kDouble);
    up->to(at::kDouble);
    down->to(at::kDouble);
  }
  // GELU (tanh approximation where the sharded model fuses it into the column layer).
  at::Tensor forward(const at::Tensor& ids, bool fused_gelu) {
    auto gelu = torch::nn::functional::GELUFuncOptions().approximate(fused_gelu ? "tanh" : "none");
    return down(torch::nn::functional::gelu(up(embedding(ids)), gelu));
  }
};

// Runs body(rank) on kWorldSize threads, each with its own torch_tp group
// "api" over one HashStore; rethrows the first rank's exception.
void run_ranks(const std::function<void(int rank)>& body) {
  c10d::set_thread_isolation_mode(true);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::exception_ptr> errors(kWorldSize);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorldSize; ++rank) {
    threads.emplace_back([&, rank] {
      SCOPED_TRACE("rank " + std::to_string(rank));
      try {
        torch_tp::GroupOptions options;
        options.timeout = std::chrono::seconds(30);
        const auto group = torch_tp::new_group(store, rank, kWorldSize, "api", options);
        EXPECT_EQ(group->getGroupName(), "api");
        EXPECT_EQ(group->getRank(), rank);
        body(rank);
        torch_tp::destroy_group("api");
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  for (const auto& error : errors) {
    if (error) {
      std::rethrow_exception(error);
    }
  }
}

int shm_segments() {
  int count = 0;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(dir)) {
      count += contains(entry->d_name, "torch_tp_") ? 1 : 0;
    }
    closedir(dir);
  }
  return count;
}

void check_model(bool sequence_parallel, bool fused_gelu) {
  at::manual_seed(0);
  FullModel full;
  const at::Tensor ids = at::randint(0, kVocab, {kBatch, kSeq});
  const at::Tensor y = full.forward(ids, fused_gelu);
  y.pow(2).sum().backward();

  run_ranks([&](int rank) {
    using torch_tp::nn::shard;
    std::optional<int64_t> seq_dim = sequence_parallel ? std::optional<int64_t>(1) : std::nullopt;
    torch_tp::nn::VocabParallelEmbedding embedding(full.embedding, "api", /*scatter_dim=*/seq_dim);
    torch_tp::nn::ColumnParallelLinear up(full.up, "api", /*gather_dim=*/seq_dim,
                                          /*activation=*/fused_gelu ? "gelu_tanh" : "none");
    torch_tp::nn::RowParallelLinear down(full.down, "api", /*scatter_dim=*/seq_dim);
    EXPECT_EQ(up->weight.size(0), rank < 2 ? 4 : 3);
    EXPECT_EQ(embedding->weight.size(0), rank < 2 ? 4 : 2);
    std::ostringstream printed;
    printed << *up << " " << *down;
    EXPECT_TRUE(contains(printed.str(), c10::str("torch_tp::nn::ColumnParallelLinear(weight=[", up->weight.size(0),
                                                 ", 6], bias=1", fused_gelu ? ", activation=gelu_tanh" : "",
                                                 ", group=api")))
        << printed.str();
    EXPECT_TRUE(contains(printed.str(), sequence_parallel ? "scatter_dim=1)" : "group=api)")) << printed.str();

    const std::optional<int64_t> full_size = sequence_parallel ? std::optional<int64_t>(kSeq) : std::nullopt;
    const at::Tensor hidden = up(embedding(ids), full_size);
    const at::Tensor out = down(fused_gelu ? hidden : torch::nn::functional::gelu(hidden));
    out.pow(2).sum().backward();

    // With sequence parallelism each rank holds its piece of the sequence
    // (5 tokens: 2, 2, 1) and backpropagates that piece's loss; the pieces'
    // losses add up to the full one, and the ops' backward collectives make
    // every sharded gradient the full loss's.
    EXPECT_TRUE(close(out.detach(), sequence_parallel ? shard(y.detach(), 1, "api") : y.detach())) << "output";
    EXPECT_TRUE(close(embedding->weight.grad(), shard(full.embedding->weight.grad(), 0, "api"))) << "embedding";
    EXPECT_TRUE(close(up->weight.grad(), shard(full.up->weight.grad(), 0, "api"))) << "up.weight";
    EXPECT_TRUE(close(up->bias.grad(), shard(full.up->bias.grad(), 0, "api"))) << "up.bias";
    EXPECT_TRUE(close(down->weight.grad(), shard(full.down->weight.grad(), 1, "api"))) << "down.weight";
    if (!sequence_parallel) {  // added to the piece after the reduce-scatter: a partial sum under SP
      EXPECT_TRUE(close(down->bias.grad(), full.down->bias.grad())) << "down.bias";
    }
  });
  EXPECT_EQ(shm_segments(), 0) << "destroy_group left segments in /dev/shm";
}

TEST(CppApi, ModulesOnANewGroupMatchTheUnshardedLayers) {
  check_model(/*sequence_parallel=*/false, /*fused_gelu=*/false);
}

TEST(CppApi, SequenceParallelModulesGiveThisRanksPieceOfTheOutput) {
  check_model(/*sequence_parallel=*/true, /*fused_gelu=*/false);
}

TEST(CppApi, ColumnParallelLinearWithFusedGeluMatchesTheUnshardedLayers) {
  check_model(/*sequence_parallel=*/false, /*fused_gelu=*/true);
  check_model(/*sequence_parallel=*/true, /*fused_gelu=*/true);
}

TEST(CppApi, BadArgumentsAreClearErrors) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_TRUE(throws_with([&] { torch_tp::new_group(store, 3, 3, "bad"); },
                          {"torch_tp::new_group", "rank=3", "world_size=3"}));
  EXPECT_TRUE(throws_with([&] { torch_tp::new_group(store, 0, 1, ""); }, {"torch_tp::new_group", "group_name"}));
  EXPECT_TRUE(throws_with([&] { torch_tp::new_group(nullptr, 0, 1, "bad"); }, {"torch_tp::new_group", "store"}));

  torch::nn::Linear linear(4, 4);
  EXPECT_TRUE(throws_with([&] { torch_tp::nn::ColumnParallelLinear(linear, "no_such_group"); },
                          {"torch_tp::nn::shard", "no_such_group"}));
  torch::nn::Embedding with_max_norm(torch::nn::EmbeddingOptions(8, 4).max_norm(1.0));
  const auto group = torch_tp::new_group(store, 0, 1, "single");
  EXPECT_TRUE(throws_with([&] { torch_tp::nn::VocabParallelEmbedding(with_max_norm, "single"); },
                          {"VocabParallelEmbedding", "max_norm"}));
  EXPECT_TRUE(throws_with([&] { torch_tp::nn::ColumnParallelLinear(linear, "single", std::nullopt, "relu"); },
                          {"torch_tp::nn::ColumnParallelLinear", "activation='relu'", "gelu_tanh"}));
  torch_tp::destroy_group("single");
  EXPECT_TRUE(throws_with([&] { torch_tp::nn::shard(at::ones({4}), 0, "single"); }, {"single"}));
}

// torch_tp::rms_norm, called from C++ as a LibTorch program does: ATen's
// rms_norm's output and gradients (float32 and bfloat16 fused on the CPU,
// float16 handed to ATen). Tolerances as test/test_norm.py's, relative to the
// reference's largest magnitude: float32 2^-18 (sums reordered), bfloat16
// 2^-8 (one rounding of the same float32 value, which a reordered sum can move
// by one ulp); float16 is ATen's own call, so equal.
// Row lengths with and without a vector-width tail, no rows, one long row.
TEST(CppApi, RmsNormMatchesATen) {
  const std::vector<std::vector<int64_t>> shapes = {{3, 5, 40}, {2, 33}, {0, 8}, {1, 4096}};
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto& shape : shapes) {
      const double tolerance = dtype == at::kFloat ? 1.0 / (1 << 18) : dtype == at::kBFloat16 ? 1.0 / (1 << 8) : 0.0;
      const int64_t n = shape.back();
      at::manual_seed(7);
      const at::Tensor x = at::randn(shape).to(dtype);
      const at::Tensor weight = (at::rand({n}) + 0.5).to(dtype);
      const at::Tensor grad = at::randn(shape).to(dtype);
      std::vector<at::Tensor> results[2];
      for (const bool ours : {true, false}) {
        const at::Tensor xs = x.clone().requires_grad_(), ws = weight.clone().requires_grad_();
        const at::Tensor out = ours ? torch_tp::rms_norm(xs, {n}, ws, 1e-5) : at::rms_norm(xs, {n}, ws, 1e-5);
        out.backward(grad);
        results[ours ? 0 : 1] = {out.detach(), xs.grad(), ws.grad()};
      }
      for (size_t i = 0; i < 3; ++i) {
        const at::Tensor actual = results[0][i].to(at::kDouble), expected = results[1][i].to(at::kDouble);
        const double scale = std::max(expected.numel() ? expected.abs().max().item<double>() : 0.0, 1e-30);
        const double error = actual.numel() ? (actual - expected).abs().max().item<double>() / scale : 0.0;
        EXPECT_LE(error, tolerance) << dtype << " " << at::IntArrayRef(shape) << " tensor " << i
                                    << " (output, grad input, grad weight)";
      }
    }
  }
  EXPECT_TRUE(throws_with([] { torch_tp::rms_norm(at::ones({2, 8}), {4}); },
                          {"torch_tp::rms_norm", "normalized_shape=[4]", "[2, 8]"}));
}

// torch_tp::vocab_parallel_cross_entropy from C++ on a one-rank group (the
// shards over several ranks are test/test_loss_parallel.py's): ATen's
// cross_entropy_loss's loss and logits gradient for each reduction, with a
// weight and an ignored row, float32 and bfloat16 fused on the CPU, float16
// through the op's composition. Tolerances relative to the reference's largest
// magnitude: float32 2^-18 (sums in another order), bfloat16 and float16 one
// rounding of the output (2^-8, 2^-10) against ATen's loss in float64 on the
// same values.
TEST(CppApi, VocabParallelCrossEntropyMatchesATen) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto group = torch_tp::new_group(store, 0, 1, "cross_entropy");
  const int64_t classes = 37;
  at::manual_seed(11);
  const at::Tensor weight = at::rand({classes}) + 0.5;
  at::Tensor target = at::randint(classes, {3, 5}, at::kLong);
  target[1][2] = -100;
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const double tolerance = dtype == at::kFloat ? 1.0 / (1 << 18) : dtype == at::kBFloat16 ? 1.0 / (1 << 8)
                                                                                             : 1.0 / (1 << 10);
    const at::Tensor x = (at::randn({3, 5, classes}) * 3).to(dtype);
    for (const char* reduction : {"mean", "sum", "none"}) {
      const at::Tensor ours_x = x.clone().requires_grad_();
      const at::Tensor ours = torch_tp::vocab_parallel_cross_entropy(ours_x, target, "cross_entropy", classes,
                                                                     weight.to(dtype), -100, reduction);
      ours.backward(at::ones_like(ours));
      const at::Tensor ref_x = x.to(at::kDouble).requires_grad_();
      const int64_t mode = std::string(reduction) == "none" ? at::Reduction::None
                           : std::string(reduction) == "sum" ? at::Reduction::Sum
                                                             : at::Reduction::Mean;
      at::Tensor ref = at::cross_entropy_loss(ref_x.flatten(0, 1), target.flatten(), weight.to(dtype).to(at::kDouble),
                                              mode, -100);
      ref = std::string(reduction) == "none" ? ref.view({3, 5}) : ref;
      ref.backward(at::ones_like(ref));
      EXPECT_EQ(ours.scalar_type(), dtype);
      EXPECT_EQ(ours.sizes(), ref.sizes()) << reduction;
      for (const auto& [actual, expected] : {std::pair{ours.detach(), ref.detach()}, {ours_x.grad(), ref_x.grad()}}) {
        const double scale = expected.abs().max().item<double>();
        const double error = (actual.to(at::kDouble) - expected).abs().max().item<double>() / scale;
        EXPECT_LE(error, tolerance) << dtype << " " << reduction;
      }
    }
  }
  EXPECT_TRUE(throws_with([] { torch_tp::vocab_parallel_cross_entropy(at::ones({4, 36}), at::zeros({4}, at::kLong),
                                                                      "cross_entropy", 37); },
                          {"torch_tp::vocab_parallel_cross_entropy", "36 classes", "num_classes=37"}));
  EXPECT_TRUE(throws_with([] { torch_tp::vocab_parallel_cross_entropy(at::ones({4, 37}), at::full({4}, 37, at::kLong),
                                                                      "cross_entropy", 37); },
                          {"torch_tp::vocab_parallel_cross_entropy", "outside [0, 37)", "target 37 in row 0"}));
  torch_tp::destroy_group("cross_entropy");
}

} // namespace
