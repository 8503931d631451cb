// The DDP reducer (csrc/ddp/reducer.h): the bucket assignment as a pure
// function, and the reducer itself on 2 and 4 ranks run as threads over the
// in-process backend of thread_backend.h.
//
// Reducer inputs are k/4 for small integers k (see NOTE [exact test values]
// in test_collectives.cpp), and the world sizes are powers of two: every
// gradient, its division by the world size and the sum over ranks are exact,
// so the averaged gradients are compared exactly with a single-process
// average.

#include "test_util.h"
#include "thread_backend.h"

#include "ddp/reducer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace {

using torch_tp::ddp::compute_bucket_assignment;
using torch_tp::testing::run_ranks;
using torch_tp::testing::throws_with;
using Buckets = std::vector<std::vector<size_t>>;

std::vector<at::Tensor> floats(std::initializer_list<int64_t> numels, at::ScalarType dtype = at::kFloat) {
  std::vector<at::Tensor> tensors;
  for (const int64_t n : numels) {
    tensors.push_back(at::empty({n}, at::dtype(dtype)));
  }
  return tensors;
}

// ---------------------------------------------------------------- assignment

TEST(BucketAssignment, ClosesABucketWhenItReachesTheLimit) {
  // 4-byte floats, limit 40 bytes = 10 elements: 4+4 (32 B) stays open, +4 closes at 48 B.
  const auto result = compute_bucket_assignment(floats({4, 4, 4, 10, 1}), {40});
  EXPECT_EQ(result.buckets, (Buckets{{0, 1, 2}, {3}, {4}}));
  EXPECT_EQ(result.size_limits, (std::vector<size_t>{40, 40, 40}));
}

TEST(BucketAssignment, FirstLimitThenTheLastOneRepeats) {
  // {8 B, 40 B}: the first bucket closes at 2 elements, later ones at 10.
  const auto result = compute_bucket_assignment(floats({2, 6, 6, 6, 1}), {8, 40});
  EXPECT_EQ(result.buckets, (Buckets{{0}, {1, 2}, {3, 4}}));
  EXPECT_EQ(result.size_limits, (std::vector<size_t>{8, 40, 40}));
}

TEST(BucketAssignment, OneBucketWithoutALimit) {
  const auto result =
      compute_bucket_assignment(floats({100, 200, 300}), {static_cast<size_t>(std::numeric_limits<int64_t>::max())});
  EXPECT_EQ(result.buckets, (Buckets{{0, 1, 2}}));
}

TEST(BucketAssignment, DtypesNeverShareABucketAndEachHasItsOwnLimits) {
  std::vector<at::Tensor> tensors = floats({2, 2});
  tensors.insert(tensors.begin() + 1, at::empty({1}, at::kDouble));  // 0: f32, 1: f64, 2: f32
  tensors.push_back(at::empty({1}, at::kDouble));                   // 3: f64
  // 8 B first limit: each dtype's first bucket closes on its first tensor.
  const auto result = compute_bucket_assignment(tensors, {8, 1000});
  // Sorted by smallest index: {0} f32, {1} f64, {2} f32 (open, closed at the end), {3} f64.
  EXPECT_EQ(result.buckets, (Buckets{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(result.size_limits, (std::vector<size_t>{8, 8, 1000, 1000}));
}

TEST(BucketAssignment, AnOrderIsKeptNotSorted) {
  // Gradient-ready order 3, 1, 0, 2 with 40 B buckets.
  const auto result = compute_bucket_assignment(floats({4, 8, 4, 2}), {40}, {3, 1, 0, 2});
  EXPECT_EQ(result.buckets, (Buckets{{3, 1}, {0, 2}}));
}

TEST(BucketAssignment, Errors) {
  EXPECT_TRUE(throws_with([] { compute_bucket_assignment(floats({1, 1}), {}); }, {"size_limits must not be empty"}));
  EXPECT_TRUE(throws_with([] { compute_bucket_assignment(floats({1, 1}), {8}, {0}); },
                          {"order has 1 indices for 2 tensors"}));
  EXPECT_TRUE(throws_with([] { compute_bucket_assignment(floats({1, 1}), {8}, {1, 1}); },
                          {"order[1]=1 is out of range or repeated"}));
  EXPECT_TRUE(throws_with([] { compute_bucket_assignment(floats({1, 1}), {8}, {0, 2}); },
                          {"order[1]=2 is out of range or repeated"}));
}

// ---------------------------------------------------------------- reducer

at::Tensor quarters(int seed, at::IntArrayRef sizes) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7919ULL * static_cast<uint64_t>(seed + 1));
  return at::randint(-8, 9, sizes, generator, at::TensorOptions().dtype(at::kLong)).to(at::kFloat).div_(4);
}

// loss = sum(x @ w1^T + b1) * c + sum(w2): gradients w1 = c * 1^T x, b1 = c * rows, w2 = ones.
struct Model {
  at::Tensor w1 = quarters(1, {3, 4}).requires_grad_();
  at::Tensor b1 = quarters(2, {3}).requires_grad_();
  at::Tensor w2 = quarters(3, {5}).requires_grad_();
  std::vector<at::Tensor> params() const { return {w1, b1, w2}; }
  at::Tensor loss(const at::Tensor& x) const { return at::linear(x, w1, b1).sum() + w2.sum(); }
};

class Reducer : public ::testing::TestWithParam<int> {};

TEST_P(Reducer, AveragesGradientsBeforeAndAfterTheRebuild) {
  const int world_size = GetParam();
  // Every rank's input, so every rank can compute the expected average.
  auto input = [](int rank, int step) { return quarters(100 * step + rank, {2, 4}); };
  run_ranks(world_size, [&](int rank, const std::string& group) {
    Model model;
    torch_tp::ddp::ReducerOptions options;
    options.bucket_bytes_cap = 16;  // 4 floats: several buckets after the rebuild
    options.first_bucket_bytes_cap = 16;
    auto reducer = torch_tp::ddp::make_reducer(model.params(), {"w1", "b1", "w2"}, group, options);
    EXPECT_EQ(reducer->bucket_indices(), (Buckets{{0, 1, 2}}));  // one bucket before the first backward
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(step);
      reducer->prepare_for_forward();
      at::Tensor loss = model.loss(input(rank, step));
      reducer->prepare_for_backward({});
      loss.backward();
      Model reference;
      for (int r = 0; r < world_size; ++r) {
        (reference.loss(input(r, step)) / world_size).backward();
      }
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(torch_tp::testing::equal_exactly(model.params()[i].grad(), reference.params()[i].grad()));
        model.params()[i].mutable_grad() = at::Tensor();
      }
    }
    EXPECT_TRUE(reducer->has_rebuilt_buckets());
    // The rebuilt buckets are cut from the gradient-ready order with 16 B caps (every parameter
    // here is at least 12 B, so at most two per bucket, and more than one bucket).
    const auto order = reducer->grad_ready_order();
    ASSERT_EQ(order.size(), 3u);
    const auto expected = compute_bucket_assignment(model.params(), {16, 16}, order).buckets;
    EXPECT_EQ(reducer->bucket_indices(), expected);
    EXPECT_GT(expected.size(), 1u);
  });
}

TEST_P(Reducer, NamesParametersThatGotNoGradient) {
  const int world_size = GetParam();
  run_ranks(world_size, [&](int rank, const std::string& group) {
    Model model;
    auto reducer = torch_tp::ddp::make_reducer(model.params(), {"w1", "b1", "w2"}, group, {});
    reducer->prepare_for_forward();
    at::Tensor loss = at::linear(quarters(rank, {2, 4}), model.w1, model.b1).sum();  // w2 unused
    reducer->prepare_for_backward({});
    EXPECT_TRUE(throws_with([&] { loss.backward(); },
                            {"1 parameter(s) received no gradient", "find_unused_parameters=True", ": w2"}));
  });
}

TEST_P(Reducer, FindUnusedParametersLeavesGloballyUnusedGradientsAlone) {
  const int world_size = GetParam();
  run_ranks(world_size, [&](int rank, const std::string& group) {
    Model model;
    torch_tp::ddp::ReducerOptions options;
    options.find_unused_parameters = true;
    auto reducer = torch_tp::ddp::make_reducer(model.params(), {"w1", "b1", "w2"}, group, options);
    reducer->prepare_for_forward();
    const at::Tensor x = quarters(rank, {2, 4});
    at::Tensor loss = at::linear(x, model.w1, model.b1).sum();  // w2 unused everywhere
    reducer->prepare_for_backward({loss});
    loss.backward();
    EXPECT_FALSE(model.w2.grad().defined());
    EXPECT_TRUE(torch_tp::testing::equal_exactly(model.b1.grad(), at::full({3}, 2.0f)));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Reducer, ::testing::Values(2, 4));

} // namespace
