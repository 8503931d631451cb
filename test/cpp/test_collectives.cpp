// The collective ops through their public C++ API (torch_tp::all_reduce, ...,
// which call the dispatcher, so the Autograd and CPU kernels both run), on 1 to
// 4 ranks run as threads over the in-process backend of thread_backend.h.
//
// Every rank builds its input from a seed derived from its rank, so every rank
// can rebuild every other rank's input and compute the expected result itself,
// without communicating: the reference is a plain single-process computation.
//
// NOTE [exact test values]
// Unless a test says otherwise, float inputs are k/4 for integers |k| <= 8.
// Every sum, min, max and product of up to 4 of them is exactly representable
// in float32 (a product is at most 8^4 = 4096 over 4^4 = 256, well inside the
// 24-bit significand), so the result does not depend on the order in which
// the backend reduces, and results are compared exactly. avg is that exact sum
// divided once by the world size, a single correctly rounded operation in the
// kernel and in the reference alike, so it is exact too. Integers are exact.
// The one test with general floats (AllReduceSumOfGeneralFloats) names its
// tolerance.

#include "test_util.h"
#include "thread_backend.h"

#include <torch_tp/ops.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace torch_tp::testing;  // test_util.h's checks, thread_backend.h's ranks

const std::vector<std::string> kFloatReductions{"sum", "avg", "min", "max", "product"};
const std::vector<std::string> kIntReductions{"sum", "min", "max", "product"};

// Rank `rank`'s deterministic input; `salt` tells apart the tensors of one test.
// Values: see NOTE [exact test values].
at::Tensor rank_values(int rank, at::IntArrayRef sizes, at::ScalarType dtype, int salt = 0) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000003ULL * static_cast<uint64_t>(salt + 1) +
                                                            static_cast<uint64_t>(rank));
  const at::Tensor k = at::randint(-8, 9, sizes, generator, at::TensorOptions().dtype(at::kLong));
  if (at::isFloatingType(dtype)) {
    return k.to(dtype).div_(4);
  }
  return k.to(dtype);
}

// make(r) for every rank r of a group of `world_size`.
std::vector<at::Tensor> every_rank(int world_size, const std::function<at::Tensor(int)>& make) {
  std::vector<at::Tensor> tensors;
  for (int r = 0; r < world_size; ++r) {
    tensors.push_back(make(r));
  }
  return tensors;
}

// The single-process reference: ranks 0..W-1 folded from the left.
at::Tensor reference_reduce(const std::vector<at::Tensor>& xs, const std::string& reduce_op) {
  at::Tensor acc = xs[0].clone();
  for (size_t r = 1; r < xs.size(); ++r) {
    if (reduce_op == "sum" || reduce_op == "avg") {
      acc = acc + xs[r];
    } else if (reduce_op == "product") {
      acc = acc * xs[r];
    } else if (reduce_op == "min") {
      acc = at::minimum(acc, xs[r]);
    } else if (reduce_op == "max") {
      acc = at::maximum(acc, xs[r]);
    } else {
      ADD_FAILURE() << "reference_reduce: unknown reduce_op " << reduce_op;
    }
  }
  if (reduce_op == "avg") {
    acc = acc / static_cast<int64_t>(xs.size());
  }
  return acc;
}

class Collectives : public ::testing::TestWithParam<int> {};

// ---------------------------------------------------------------- all_reduce

TEST_P(Collectives, AllReduceFloat32) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {3, 4}, at::kFloat); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = rank_values(rank, {3, 4}, at::kFloat);
    const at::Tensor x_before = x.clone();
    for (const auto& reduce_op : kFloatReductions) {
      SCOPED_TRACE(reduce_op);
      const at::Tensor out = torch_tp::all_reduce(x, reduce_op, group);
      EXPECT_TRUE(equal_exactly(out, reference_reduce(xs, reduce_op)));
      EXPECT_TRUE(out.is_contiguous());
    }
    // The op is functional: its input is left alone.
    EXPECT_TRUE(equal_exactly(x, x_before));
  });
}

TEST_P(Collectives, AllReduceInt64) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {5}, at::kLong); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = rank_values(rank, {5}, at::kLong);
    for (const auto& reduce_op : kIntReductions) {
      SCOPED_TRACE(reduce_op);
      EXPECT_TRUE(equal_exactly(torch_tp::all_reduce(x, reduce_op, group), reference_reduce(xs, reduce_op)));
    }
    EXPECT_TRUE(throws_with([&] { torch_tp::all_reduce(x, "avg", group); }, {"torch_tp::all_reduce", "avg"}));
  });
}

TEST_P(Collectives, AllReduceNonContiguousInput) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {4, 3}, at::kFloat).t(); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = rank_values(rank, {4, 3}, at::kFloat).t();
    ASSERT_FALSE(x.is_contiguous());
    EXPECT_TRUE(equal_exactly(torch_tp::all_reduce(x, "sum", group), reference_reduce(xs, "sum")));
  });
}

TEST_P(Collectives, AllReduceInPlace) {
  const int world_size = GetParam();
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const bool contiguous : {true, false}) {
      SCOPED_TRACE(contiguous ? "contiguous" : "transposed");
      at::Tensor x = contiguous ? rank_values(rank, {4, 3}, at::kLong) : rank_values(rank, {3, 4}, at::kLong).t();
      const at::Tensor expected = torch_tp::all_reduce(x, "max", group);
      const void* storage = x.data_ptr();
      torch_tp::all_reduce_(x, "max", group);
      EXPECT_EQ(x.data_ptr(), storage);
      EXPECT_TRUE(equal_exactly(x, expected));
    }
    const at::Tensor w = at::ones({3}, at::kFloat).requires_grad_();
    EXPECT_TRUE(throws_with([&] { torch_tp::all_reduce_(w, "sum", group); },
                            {"torch_tp::all_reduce_", "requires grad"}));
  });
}

// General float32 values: the backend may add them in any order, so the sum
// is compared with a tolerance. Summing W terms in any order in float32 is off
// from the exact sum by at most (W-1) * eps * sum_r |x_r| (the standard
// recursive-summation bound); the reference is computed in float64 (its own
// error is negligible), and kSumSlack = W bounds W-1 with room to spare.
TEST_P(Collectives, AllReduceSumOfGeneralFloats) {
  const int world_size = GetParam();
  auto make = [](int r) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(77 + static_cast<uint64_t>(r));
    return at::randn({64}, generator, at::TensorOptions().dtype(at::kFloat));
  };
  const auto xs = every_rank(world_size, make);
  at::Tensor exact = at::zeros({64}, at::kDouble);
  at::Tensor magnitude = at::zeros({64}, at::kDouble);
  for (const auto& x : xs) {
    exact += x.to(at::kDouble);
    magnitude += x.to(at::kDouble).abs();
  }
  const double kSumSlack = world_size;
  const at::Tensor bound = kSumSlack * std::numeric_limits<float>::epsilon() * magnitude;
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor out = torch_tp::all_reduce(make(rank), "sum", group);
    const at::Tensor error = (out.to(at::kDouble) - exact).abs();
    EXPECT_TRUE(error.le(bound).all().item<bool>()) << "max error " << error.max().item<double>();
    // Whatever the order, every rank must hold the same bits.
    const at::Tensor everyone = torch_tp::all_gather(out.unsqueeze(0), 0, group);
    for (int r = 0; r < world_size; ++r) {
      EXPECT_TRUE(equal_exactly(everyone[r], out)) << "rank " << r << " holds another result";
    }
  });
}

// ---------------------------------------------------------------- all_gather

TEST_P(Collectives, AllGatherAlongEachDim) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = rank_values(rank, {2, 3}, at::kFloat);
    for (const int64_t dim : {0, 1, -1}) {
      SCOPED_TRACE(c10::str("dim=", dim));
      const at::Tensor out = torch_tp::all_gather(x, dim, group);
      EXPECT_TRUE(equal_exactly(out, at::cat(xs, dim)));
      EXPECT_TRUE(out.is_contiguous());
    }
  });
}

// The kernel moves the gather dim to the front and back again: a middle dim
// of a 3-d tensor, and inputs that are not contiguous, exercise that.
TEST_P(Collectives, AllGatherMiddleDimAndNonContiguousInputs) {
  const int world_size = GetParam();
  const auto cubes = every_rank(world_size, [](int r) { return rank_values(r, {2, 3, 2}, at::kFloat); });
  const auto transposed = every_rank(world_size, [](int r) { return rank_values(r, {3, 2}, at::kFloat, 1).t(); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    EXPECT_TRUE(equal_exactly(torch_tp::all_gather(cubes[rank].clone(), 1, group), at::cat(cubes, 1)));

    const at::Tensor x = rank_values(rank, {3, 2}, at::kFloat, 1).t(); // [2, 3], strides (1, 2)
    ASSERT_FALSE(x.is_contiguous());
    for (const int64_t dim : {0, 1}) {
      SCOPED_TRACE(c10::str("dim=", dim));
      const at::Tensor out = torch_tp::all_gather(x, dim, group);
      EXPECT_TRUE(equal_exactly(out, at::cat(transposed, dim)));
      EXPECT_TRUE(out.is_contiguous());
    }
  });
}

TEST_P(Collectives, AllGatherInt64AndBool) {
  const int world_size = GetParam();
  const auto ints = every_rank(world_size, [](int r) { return rank_values(r, {2, 2}, at::kLong); });
  const auto bools = every_rank(world_size, [](int r) { return rank_values(r, {3}, at::kLong).gt(0); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    EXPECT_TRUE(equal_exactly(torch_tp::all_gather(ints[rank].clone(), 1, group), at::cat(ints, 1)));
    EXPECT_TRUE(equal_exactly(torch_tp::all_gather(bools[rank].clone(), 0, group), at::cat(bools, 0)));
  });
}

// ------------------------------------------------------------ reduce_scatter

TEST_P(Collectives, ReduceScatterAlongDim0And1) {
  const int world_size = GetParam();
  const int64_t n = 2 * world_size;
  // dim 0: [2W, 3] -> [2, 3]; dim 1: [3, 2W] -> [3, 2].
  const auto rows = every_rank(world_size, [&](int r) { return rank_values(r, {n, 3}, at::kFloat); });
  const auto cols = every_rank(world_size, [&](int r) { return rank_values(r, {3, n}, at::kFloat, 1); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const auto& reduce_op : kFloatReductions) {
      SCOPED_TRACE(reduce_op);
      EXPECT_TRUE(equal_exactly(torch_tp::reduce_scatter(rows[rank].clone(), 0, reduce_op, group),
                                reference_reduce(rows, reduce_op).chunk(world_size, 0)[rank]));
      EXPECT_TRUE(equal_exactly(torch_tp::reduce_scatter(cols[rank].clone(), 1, reduce_op, group),
                                reference_reduce(cols, reduce_op).chunk(world_size, 1)[rank]));
      EXPECT_TRUE(equal_exactly(torch_tp::reduce_scatter(cols[rank].clone(), -1, reduce_op, group),
                                reference_reduce(cols, reduce_op).chunk(world_size, 1)[rank]));
    }
  });
}

TEST_P(Collectives, ReduceScatterInt64AndNonContiguousInput) {
  const int world_size = GetParam();
  const int64_t n = 2 * world_size;
  const auto ints = every_rank(world_size, [&](int r) { return rank_values(r, {n, 2}, at::kLong); });
  // [3, 2W] viewed through a transpose of a contiguous [2W, 3].
  const auto transposed = every_rank(world_size, [&](int r) { return rank_values(r, {n, 3}, at::kFloat, 2).t(); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const auto& reduce_op : kIntReductions) {
      SCOPED_TRACE(reduce_op);
      EXPECT_TRUE(equal_exactly(torch_tp::reduce_scatter(ints[rank].clone(), 0, reduce_op, group),
                                reference_reduce(ints, reduce_op).chunk(world_size, 0)[rank]));
    }
    const at::Tensor x = rank_values(rank, {n, 3}, at::kFloat, 2).t();
    ASSERT_FALSE(x.is_contiguous());
    const at::Tensor out = torch_tp::reduce_scatter(x, 1, "sum", group);
    EXPECT_TRUE(equal_exactly(out, reference_reduce(transposed, "sum").chunk(world_size, 1)[rank]));
    EXPECT_TRUE(out.is_contiguous());
  });
}

// ------------------------------------------------------------------ autograd
// Each rank runs forward and backward on its own thread; the backward
// collectives meet across ranks as the forward ones do. g_r is rank r's
// upstream gradient, again rebuildable by every rank.

TEST_P(Collectives, AllGatherBackwardIsReduceScatterSum) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    for (const int64_t dim : {0, 1}) {
      SCOPED_TRACE(c10::str("dim=", dim));
      const at::Tensor x = xs[rank].clone().requires_grad_(true);
      const at::Tensor y = torch_tp::all_gather(x, dim, group);
      ASSERT_TRUE(y.requires_grad());
      EXPECT_TRUE(equal_exactly(y.detach(), at::cat(xs, dim)));
      const auto gs = every_rank(world_size, [&](int r) { return rank_values(r, y.sizes(), at::kFloat, 10 + dim); });
      y.backward(gs[rank]);
      // dL/dx_r = sum_j (g_j's block r along dim).
      EXPECT_TRUE(equal_exactly(x.grad(), reference_reduce(gs, "sum").chunk(world_size, dim)[rank]));
    }
  });
}

TEST_P(Collectives, ReduceScatterSumBackwardIsAllGather) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [&](int r) { return rank_values(r, {2 * world_size, 3}, at::kFloat); });
  const auto gs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat, 1); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = xs[rank].clone().requires_grad_(true);
    const at::Tensor y = torch_tp::reduce_scatter(x, 0, "sum", group);
    y.backward(gs[rank]);
    EXPECT_TRUE(equal_exactly(x.grad(), at::cat(gs, 0)));
  });
}

TEST_P(Collectives, CopyToTpRegionIsIdentityForwardAllReduceBackward) {
  const int world_size = GetParam();
  const auto gs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat, 1); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = rank_values(rank, {2, 3}, at::kFloat).requires_grad_(true);
    const at::Tensor y = torch_tp::copy_to_tp_region(x, group);
    EXPECT_TRUE(equal_exactly(y.detach(), x.detach()));
    EXPECT_NE(y.data_ptr(), x.data_ptr()) << "a functional op must not alias its input";
    y.backward(gs[rank]);
    EXPECT_TRUE(equal_exactly(x.grad(), reference_reduce(gs, "sum")));
  });
}

TEST_P(Collectives, ReduceFromTpRegionIsAllReduceForwardIdentityBackward) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat); });
  const auto gs = every_rank(world_size, [](int r) { return rank_values(r, {2, 3}, at::kFloat, 1); });
  run_ranks(world_size, [&](int rank, const std::string& group) {
    const at::Tensor x = xs[rank].clone().requires_grad_(true);
    const at::Tensor y = torch_tp::reduce_from_tp_region(x, group);
    EXPECT_TRUE(equal_exactly(y.detach(), reference_reduce(xs, "sum")));
    y.backward(gs[rank]);
    EXPECT_TRUE(equal_exactly(x.grad(), gs[rank]));
  });
}

// See NOTE [adjoint of a reduction over ranks] in collectives_autograd.cpp.
// Inputs in {-1/4, 0, 1/4} make ties across ranks common.
TEST_P(Collectives, AllReduceMaxAndProductBackward) {
  const int world_size = GetParam();
  const auto xs = every_rank(world_size, [](int r) {
    return rank_values(r, {16}, at::kLong, 3).remainder(3).sub(1).to(at::kFloat).div(4);
  });
  const auto gs = every_rank(world_size, [](int r) { return rank_values(r, {16}, at::kFloat, 4); });
  const at::Tensor upstream = reference_reduce(gs, "sum");
  const at::Tensor y_max = reference_reduce(xs, "max");
  at::Tensor ties = at::zeros({16}, at::kFloat);
  for (const auto& x : xs) {
    ties += x.eq(y_max).to(at::kFloat);
  }
  run_ranks(world_size, [&](int rank, const std::string& group) {
    {
      SCOPED_TRACE("max");
      const at::Tensor x = xs[rank].clone().requires_grad_(true);
      torch_tp::all_reduce(x, "max", group).backward(gs[rank]);
      // Tied ranks share the gradient equally.
      EXPECT_TRUE(equal_exactly(x.grad(), upstream * xs[rank].eq(y_max).to(at::kFloat) / ties));
    }
    {
      SCOPED_TRACE("product");
      const at::Tensor x = xs[rank].clone().requires_grad_(true);
      torch_tp::all_reduce(x, "product", group).backward(gs[rank]);
      at::Tensor others = at::ones({16}, at::kFloat);
      for (int r = 0; r < world_size; ++r) {
        if (r != rank) {
          others = others * xs[r];
        }
      }
      EXPECT_TRUE(equal_exactly(x.grad(), upstream * others));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return c10::str("w", info.param); });

// -------------------------------------------------------------------- errors
// Every rank makes the same bad call, so no rank is left waiting; after them
// all, one good collective shows the ranks are still in step.

TEST(CollectiveErrors, MessagesNameTheOpTheArgumentAndTheValue) {
  run_ranks(2, [](int /*rank*/, const std::string& group) {
    const at::Tensor x = at::ones({3, 4});
    EXPECT_TRUE(throws_with([&] { torch_tp::all_gather(x, 5, group); }, {"torch_tp::all_gather", "dim=5"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::all_gather(x, -3, group); }, {"torch_tp::all_gather", "dim=-3"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::all_gather(at::scalar_tensor(1.0), 0, group); },
                            {"torch_tp::all_gather", "0-d"}));
    EXPECT_TRUE(
        throws_with([&] { torch_tp::reduce_scatter(x, 2, "sum", group); }, {"torch_tp::reduce_scatter", "dim=2"}));

    // 3 rows are not a torch.chunk piece of 10 rows over 2 ranks (those have 5).
    EXPECT_TRUE(throws_with([&] { torch_tp::all_gather(x, 0, group, 10); },
                            {"torch_tp::all_gather", "x.size(0)=3", "full_size=10", "has 5 rows"}));

    EXPECT_TRUE(throws_with([&] { torch_tp::all_reduce(x, "sum", "no_such_group"); },
                            {"torch_tp::all_reduce", "group_name='no_such_group'"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::all_gather(x, 0, "no_such_group"); },
                            {"torch_tp::all_gather", "group_name='no_such_group'"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::copy_to_tp_region(x, "no_such_group"); },
                            {"torch_tp::copy_to_tp_region", "group_name='no_such_group'"}));

    EXPECT_TRUE(
        throws_with([&] { torch_tp::all_reduce(x, "median", group); }, {"torch_tp::all_reduce", "reduce_op='median'"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::reduce_scatter(at::ones({4}), 0, "median", group); },
                            {"torch_tp::reduce_scatter", "reduce_op='median'"}));

    const at::Tensor ints = at::ones({4}, at::kLong);
    EXPECT_TRUE(throws_with([&] { torch_tp::all_reduce(ints, "avg", group); },
                            {"torch_tp::all_reduce", "reduce_op='avg'", "Long"}));
    EXPECT_TRUE(throws_with([&] { torch_tp::reduce_scatter(ints, 0, "avg", group); },
                            {"torch_tp::reduce_scatter", "reduce_op='avg'", "Long"}));

    EXPECT_TRUE(equal_exactly(torch_tp::all_reduce(x, "sum", group), at::full({3, 4}, 2.0f)));
  });
}

// ------------------------------------------------------------------ hand-off
// NOTE [what a backend's threads may hold]: a backend gets aliases over the
// caller's storage, never the caller's own TensorImpls, which Python may wrap
// (releasing those on a backend's thread can need the GIL). The results are
// still written through to the caller's tensors.

TEST(CollectiveHandoff, BackendGetsAliasesOfTheCallersTensors) {
  run_ranks(2, [](int /*rank*/, const std::string& group) {
    auto* backend = dynamic_cast<torch_tp::testing::ThreadBackend*>(
        c10d::resolve_process_group(group)->getBackend(c10::DeviceType::CPU).get());
    ASSERT_NE(backend, nullptr);
    auto expect_aliased = [&](const at::Tensor& caller, const char* what) {
      bool same_storage = false;
      for (const at::Tensor& handed : backend->last_handed()) {
        EXPECT_FALSE(handed.is_same(caller)) << what << " itself was handed to the backend";
        same_storage = same_storage || handed.data_ptr() == caller.data_ptr();
      }
      EXPECT_TRUE(same_storage) << "no tensor handed to the backend shares " << what << "'s storage";
    };

    at::Tensor x = at::ones({4, 3});
    torch_tp::all_reduce_(x, "sum", group);
    expect_aliased(x, "all_reduce_'s x");
    EXPECT_TRUE(equal_exactly(x, at::full({4, 3}, 2.0f)));

    const at::Tensor reduced = torch_tp::all_reduce(x, "sum", group);
    expect_aliased(reduced, "all_reduce's result");
    EXPECT_TRUE(equal_exactly(reduced, at::full({4, 3}, 4.0f)));

    // Along dim 0 with whole pieces, x is the backend's input and the
    // backend's output is the result: neither is copied on the way.
    const at::Tensor gathered = torch_tp::all_gather(x, 0, group);
    expect_aliased(x, "all_gather's x");
    expect_aliased(gathered, "all_gather's result");
    EXPECT_TRUE(equal_exactly(gathered, at::full({8, 3}, 2.0f)));

    const at::Tensor piece = torch_tp::reduce_scatter(x, 0, "sum", group);
    expect_aliased(x, "reduce_scatter's x");
    expect_aliased(piece, "reduce_scatter's result");
    EXPECT_TRUE(equal_exactly(piece, at::full({2, 3}, 4.0f)));
  });
}

// ------------------------------------------------------------------- harness
// The test double itself: each rank resolves its own group, and a rank that
// fails, disagrees or stalls gives every rank a clear error instead of a hang.

TEST(ThreadHarness, EachRankResolvesItsOwnGroup) {
  run_ranks(3, [](int rank, const std::string& group) {
    const auto pg = c10d::resolve_process_group(group);
    EXPECT_EQ(pg->getRank(), rank);
    EXPECT_EQ(pg->getSize(), 3);
    EXPECT_EQ(pg->getBackend(c10::DeviceType::CPU)->getBackendName(), "threads");
  });
}

TEST(ThreadHarness, RankThatThrowsReleasesItsPeers) {
  const auto start = std::chrono::steady_clock::now();
  const auto failures = try_run_ranks(3, [](int rank, const std::string& group) {
    if (rank == 1) {
      throw std::runtime_error("boom before the collective");
    }
    torch_tp::all_reduce(at::ones({2}), "sum", group);
  });
  // Well inside the 30 s rendezvous timeout: the peers fail as soon as rank 1 leaves.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ASSERT_EQ(failures.size(), 3u);
  EXPECT_EQ(failures[1].rank, 1);
  EXPECT_TRUE(contains(failures[1].message, "boom before the collective")) << failures[1].message;
  for (const int i : {0, 2}) {
    EXPECT_EQ(failures[i].rank, i);
    EXPECT_TRUE(contains(failures[i].message, "rank 1 left the group")) << failures[i].message;
    EXPECT_TRUE(contains(failures[i].message, "boom before the collective")) << failures[i].message;
  }
}

TEST(ThreadHarness, RanksThatDisagreeOnTheCollectiveFail) {
  const auto failures = try_run_ranks(2, [](int rank, const std::string& group) {
    torch_tp::all_reduce(at::ones({rank + 2}), "sum", group);
  });
  ASSERT_EQ(failures.size(), 2u);
  for (const auto& failure : failures) {
    EXPECT_TRUE(contains(failure.message, "ranks disagree on the collective")) << failure.message;
  }
}

TEST(ThreadHarness, StalledRankTimesOut) {
  const auto failures = try_run_ranks(
      2,
      [](int rank, const std::string& group) {
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(600));
        }
        torch_tp::all_reduce(at::ones({2}), "sum", group);
      },
      std::chrono::milliseconds(200));
  ASSERT_EQ(failures.size(), 2u);
  EXPECT_TRUE(contains(failures[0].message, "rank 0 timed out after 200 ms")) << failures[0].message;
  EXPECT_TRUE(contains(failures[1].message, "the group is broken")) << failures[1].message;
}

} // namespace
