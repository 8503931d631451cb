// The torch_tp process-group backend below Python: the reduction kernels
// against references, and the shared-memory transport through
// ProcessGroupShm with ranks as threads of this process over one HashStore
// (all on one "node"): multi-chunk collectives, bitwise agreement across
// ranks, a timeout naming the silent rank, a header mismatch, and an empty
// /dev/shm afterwards.
//
// NOTE [kernel tolerances]
// Integer and bool reductions, min and max are exact. A float32 or float64
// sum folded in rank order is compared with the same fold in float64, within
// kFloatRtol (W - 1 roundings of at most 2^-24 relative each, W <= 4) of the
// partial sums, which for inputs of magnitude ~1 is kFloatAtol when the sum
// itself cancels to near zero. For
// bfloat16 and float16 the reference folds in float32 with ATen and rounds
// once: the kernel must match it bitwise, which fails if it accumulated in
// the narrow type.

#include "test_util.h"

#include "backend/process_group_shm.h"
#include "backend/reduce_kernels.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <dirent.h>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

using torch_tp::backend::ProcessGroupShm;
using torch_tp::backend::fold_isa_name;
using torch_tp::backend::FoldIsa;
using torch_tp::backend::reduce_inputs;
using torch_tp::backend::reduce_inputs_with;
using torch_tp::backend::supported_fold_isas;
using torch_tp::Reduction;
using torch_tp::testing::contains;
using torch_tp::testing::equal_exactly;
using torch_tp::testing::throws_with;

constexpr double kFloatRtol = 4 * 6e-8;
constexpr double kFloatAtol = 4 * 4 * 6e-8 * 4;  // W roundings of partial sums up to ~4 (randn, W <= 4)

// Rank r's input (a generator of its own: rank threads call this at once).
at::Tensor input(int rank, int64_t n, at::ScalarType dtype, int salt = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7919ULL * static_cast<uint64_t>(salt) + rank);
  if (dtype == at::kBool) {
    return at::randint(0, 2, {n}, gen).to(at::kBool);
  }
  if (at::isFloatingType(dtype)) {
    return at::randn({n}, gen).to(dtype);
  }
  return at::randint(-100, 100, {n}, gen).to(dtype);
}

at::Tensor fold_reference(const std::vector<at::Tensor>& xs, Reduction kind, at::ScalarType acc) {
  at::Tensor out = xs[0].to(acc);
  for (size_t r = 1; r < xs.size(); ++r) {
    const at::Tensor x = xs[r].to(acc);
    switch (kind) {
      case Reduction::Sum:
      case Reduction::Avg: out = xs[0].scalar_type() == at::kBool ? at::logical_or(out, x) : out + x; break;
      case Reduction::Product: out = xs[0].scalar_type() == at::kBool ? at::logical_and(out, x) : out * x; break;
      case Reduction::Min: out = at::minimum(out, x); break;
      case Reduction::Max: out = at::maximum(out, x); break;
    }
  }
  if (kind == Reduction::Avg) {
    out = out / static_cast<double>(xs.size());
  }
  return out;
}

// The kernel tests run every variant this CPU runs (NOTE [runtime ISA dispatch]).
at::Tensor run_kernel(FoldIsa isa, const std::vector<at::Tensor>& xs, Reduction kind) {
  at::Tensor out = at::empty_like(xs[0]);
  std::vector<const void*> pointers;
  for (const auto& x : xs) {
    pointers.push_back(x.data_ptr());
  }
  reduce_inputs_with(isa, kind, xs[0].scalar_type(), out.data_ptr(), pointers.data(), static_cast<int>(xs.size()),
                     out.numel(), static_cast<int64_t>(xs.size()));
  return out;
}

const std::vector<Reduction> kAllKinds{Reduction::Sum, Reduction::Avg, Reduction::Product, Reduction::Min,
                                        Reduction::Max};

TEST(ReduceKernels, IntegersAndBoolAreExact) {
  for (const FoldIsa isa : supported_fold_isas()) {
    for (auto dtype : {at::kChar, at::kByte, at::kShort, at::kInt, at::kLong, at::kBool}) {
      for (int world : {1, 2, 3, 4}) {
        std::vector<at::Tensor> xs;
        for (int r = 0; r < world; ++r) {
          xs.push_back(input(r, 2500, dtype));
        }
        for (auto kind : kAllKinds) {
          if (kind == Reduction::Avg) {
            continue;  // refused for integers (reduction_supported)
          }
          // Wrap-around integer arithmetic: fold in int64, then truncate.
          const at::ScalarType acc = dtype == at::kBool ? at::kBool : at::kLong;
          EXPECT_TRUE(equal_exactly(run_kernel(isa, xs, kind), fold_reference(xs, kind, acc).to(dtype)))
              << fold_isa_name(isa) << " " << dtype << " " << torch_tp::reduction_name(kind) << " W=" << world;
        }
      }
    }
  }
}

TEST(ReduceKernels, FloatsMatchAFloat64Fold) {
  for (const FoldIsa isa : supported_fold_isas()) {
    for (auto dtype : {at::kFloat, at::kDouble}) {
      for (int world : {1, 2, 3, 4}) {
        std::vector<at::Tensor> xs;
        for (int r = 0; r < world; ++r) {
          xs.push_back(input(r, 3001, dtype));  // not a multiple of any vector width
        }
        for (auto kind : kAllKinds) {
          const at::Tensor got = run_kernel(isa, xs, kind).to(at::kDouble);
          const at::Tensor want = fold_reference(xs, kind, at::kDouble);
          EXPECT_TRUE(at::allclose(got, want, kFloatRtol, kFloatAtol))
              << fold_isa_name(isa) << " " << dtype << " " << torch_tp::reduction_name(kind);
          if (kind == Reduction::Min || kind == Reduction::Max) {
            EXPECT_TRUE(at::equal(got, want));
          }
        }
      }
    }
  }
}

TEST(ReduceKernels, HalfTypesAccumulateInFloat32) {
  for (const FoldIsa isa : supported_fold_isas()) {
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      for (int world : {2, 3, 4}) {
        std::vector<at::Tensor> xs;
        for (int r = 0; r < world; ++r) {
          xs.push_back(input(r, 4099, dtype).mul_(100));
        }
        for (auto kind : kAllKinds) {
          const at::Tensor want = fold_reference(xs, kind, at::kFloat).to(dtype);
          EXPECT_TRUE(equal_exactly(run_kernel(isa, xs, kind), want))
              << fold_isa_name(isa) << " " << dtype << " " << torch_tp::reduction_name(kind) << " W=" << world;
        }
      }
      // A fold in the narrow type would lose the small terms: 256 + 1 + 1 is 258 in
      // float32 but 256 in bfloat16 when added one at a time.
      std::vector<at::Tensor> xs{at::full({8}, 256.0, dtype), at::full({8}, 1.0, dtype), at::full({8}, 1.0, dtype)};
      if (dtype == at::kBFloat16) {
        EXPECT_TRUE(equal_exactly(run_kernel(isa, xs, Reduction::Sum), at::full({8}, 258.0, dtype)));
      }
    }
  }
}

TEST(ReduceKernels, HalfConversionsMatchC10OnEveryPattern) {
  // Every float16 and bfloat16 bit pattern, paired with a shuffled copy: the
  // sum goes through the widening load of both and the rounding store. Both
  // halves of every 32-bit word the kernels split (NOTE [portable
  // vectorisation]) see every pattern: the shuffle puts patterns at both
  // parities.
  at::Tensor bits = at::arange(0, 65536, at::kInt).to(at::kShort);
  const at::Tensor order = at::randperm(65536, at::make_generator<at::CPUGeneratorImpl>(1), at::kLong);
  for (const FoldIsa isa : supported_fold_isas()) {
    for (auto dtype : {at::kHalf, at::kBFloat16}) {
      at::Tensor a = bits.view(dtype);
      at::Tensor b = a.index_select(0, order);
      const at::Tensor got = run_kernel(isa, {a, b}, Reduction::Sum);
      const at::Tensor want = (a.to(at::kFloat) + b.to(at::kFloat)).to(dtype);
      const at::Tensor nan_both = at::isnan(got) & at::isnan(want);
      EXPECT_TRUE(
          at::equal(got.view(at::kShort).masked_fill(nan_both, 0), want.view(at::kShort).masked_fill(nan_both, 0)))
          << fold_isa_name(isa) << " " << dtype;
      EXPECT_TRUE(at::equal(at::isnan(got), at::isnan(want))) << fold_isa_name(isa) << " " << dtype;
      // Identity round trip (one input) of every pattern: load then store.
      const at::Tensor copied = run_kernel(isa, {a}, Reduction::Max);
      const at::Tensor nan = at::isnan(a);
      EXPECT_TRUE(at::equal(copied.view(at::kShort).masked_fill(nan, 0), bits.masked_fill(nan, 0)))
          << fold_isa_name(isa) << " " << dtype;
      EXPECT_TRUE(at::equal(at::isnan(copied), nan)) << fold_isa_name(isa) << " " << dtype;
    }
  }
}

TEST(ReduceKernels, EveryVariantGivesTheBaselinesBits) {
  // Ranks on one node all run the same variant, but a job may span machines of
  // different CPUs: the variants must agree bitwise on every length around
  // the vector widths (randn inputs: no NaN, whose payload no reduction promises).
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kChar, at::kLong, at::kBool}) {
    for (int64_t numel : {1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000}) {
      std::vector<at::Tensor> xs;
      for (int r = 0; r < 3; ++r) {
        xs.push_back(input(r, numel, dtype, static_cast<int>(numel)));
      }
      for (auto kind : kAllKinds) {
        const char* why = nullptr;
        if (!torch_tp::backend::reduction_supported(kind, dtype, &why)) {
          continue;
        }
        const at::Tensor want = run_kernel(FoldIsa::Baseline, xs, kind);
        for (const FoldIsa isa : supported_fold_isas()) {
          EXPECT_TRUE(equal_exactly(run_kernel(isa, xs, kind).view(at::kByte), want.view(at::kByte)))
              << fold_isa_name(isa) << " " << dtype << " " << torch_tp::reduction_name(kind) << " n=" << numel;
        }
      }
    }
  }
}

TEST(ReduceKernels, AVariantTheCpuLacksIsRefused) {
  const std::vector<FoldIsa> runs = supported_fold_isas();
  ASSERT_EQ(runs.back(), FoldIsa::Baseline);
  at::Tensor x = at::ones({4});
  const void* in[1] = {x.data_ptr()};
  for (const FoldIsa isa : {FoldIsa::Avx2, FoldIsa::Avx512}) {
    if (std::find(runs.begin(), runs.end(), isa) == runs.end()) {
      EXPECT_TRUE(throws_with([&] { reduce_inputs_with(isa, Reduction::Sum, at::kFloat, x.data_ptr(), in, 1, 4, 1); },
                              {fold_isa_name(isa), "need a CPU"}));
    }
  }
  // reduce_inputs itself takes the widest variant.
  at::Tensor out = at::empty({4});
  reduce_inputs(Reduction::Sum, at::kFloat, out.data_ptr(), in, 1, 4, 1);
  EXPECT_TRUE(at::equal(out, x));
}

// ---- the backend, ranks as threads -----------------------------------------

// The tokens of the groups this process made, which their segment names
// carry (/torch_tp_<uid>_<token>_<rank>): segments of other processes, such
// as this test's other cases under a parallel ctest, are not looked at.
std::mutex tokens_mutex;
std::vector<std::string> our_tokens;

void remember_token(c10d::Store& store) {
  const std::vector<uint8_t> bytes = store.get("torch_tp/token");
  std::lock_guard<std::mutex> lock(tokens_mutex);
  const std::string token(bytes.begin(), bytes.end());
  if (std::find(our_tokens.begin(), our_tokens.end(), token) == our_tokens.end()) {
    our_tokens.push_back(token);
  }
}

// The segments of this process's groups still in /dev/shm.
std::vector<std::string> shm_files() {
  std::vector<std::string> names;
  const std::string prefix = "torch_tp_" + std::to_string(::getuid()) + "_";
  std::lock_guard<std::mutex> lock(tokens_mutex);
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      for (const auto& token : our_tokens) {
        if (name.rfind(prefix + token + "_", 0) == 0) {
          names.push_back(name);
        }
      }
    }
    ::closedir(dir);
  }
  return names;
}

struct RankResult {
  std::string error;  // empty when the body returned normally
};

// Runs body(rank, backend) on `world` threads, each with its own
// ProcessGroupShm over one HashStore; returns what each rank threw.
std::vector<RankResult> run_ranks(int world, size_t buffer_bytes, std::chrono::milliseconds timeout,
                                  const std::function<void(int, ProcessGroupShm&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<RankResult> results(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        ProcessGroupShm::Options options;
        options.timeout = timeout;
        options.buffer_bytes = buffer_bytes;
        options.host_keys.assign(world, "node");
        auto backend = c10::make_intrusive<ProcessGroupShm>(store, rank, world, options);
        // Past this barrier every rank has finished its constructor, which
        // unlinks its segment (NOTE [segment lifetime]).
        backend->barrier()->wait();
        remember_token(*store);
        EXPECT_TRUE(shm_files().empty()) << "segments stay linked after every rank mapped them";
        body(rank, *backend);
      } catch (const c10::Error& e) {
        results[rank].error = e.what_without_backtrace();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  return results;
}

void expect_no_errors(const std::vector<RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(results[r].error.empty()) << "rank " << r << " threw: " << results[r].error;
  }
}

// The smallest buffer: a 2048-byte slot, so the tensors below take many chunks.
constexpr size_t kSmallBuffer = 4096;

TEST(ShmBackend, MultiChunkCollectivesMatchReferencesOnEveryRank) {
  for (int world : {1, 2, 3, 4}) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kInt}) {
      for (int64_t n : {0, 1, 1000, 40001}) {  // up to ~80 slots of float32
        std::vector<at::Tensor> reduced(world), gathered(world), scattered(world);
        expect_no_errors(run_ranks(world, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
          std::vector<at::Tensor> t{input(rank, n, dtype)};
          c10d::AllreduceOptions sum;
          pg.allreduce(t, sum)->wait();
          reduced[rank] = t[0];
          at::Tensor in = input(rank, n, dtype, 1);
          at::Tensor out = at::empty({n * world}, in.options());
          pg._allgather_base(out, in)->wait();
          gathered[rank] = out;
          at::Tensor rs_in = input(rank, n * world, dtype, 2);
          at::Tensor rs_out = at::empty({n}, rs_in.options());
          pg._reduce_scatter_base(rs_out, rs_in)->wait();
          scattered[rank] = rs_out;
        }));
        std::vector<at::Tensor> ar_in, ag_in, rs_in;
        for (int r = 0; r < world; ++r) {
          ar_in.push_back(input(r, n, dtype));
          ag_in.push_back(input(r, n, dtype, 1));
          rs_in.push_back(input(r, n * world, dtype, 2));
        }
        const at::ScalarType acc = dtype == at::kInt ? at::kLong : at::kFloat;
        const at::Tensor ar_want = fold_reference(ar_in, Reduction::Sum, acc).to(dtype);
        const at::Tensor ag_want = at::cat(ag_in);
        for (int r = 0; r < world; ++r) {
          SCOPED_TRACE(c10::str("W=", world, " ", dtype, " n=", n, " rank ", r));
          // float32 sums: the same fold order, so bitwise equal to each other;
          // against the float32 reference, within kFloatRtol.
          EXPECT_TRUE(equal_exactly(reduced[r], reduced[0]));
          if (dtype == at::kFloat) {
            EXPECT_TRUE(at::allclose(reduced[r], ar_want, kFloatRtol, kFloatAtol));
          } else {
            EXPECT_TRUE(equal_exactly(reduced[r], ar_want));
          }
          EXPECT_TRUE(equal_exactly(gathered[r], ag_want));
          std::vector<at::Tensor> pieces;
          for (const auto& x : rs_in) {
            pieces.push_back(x.narrow(0, r * n, n));
          }
          const at::Tensor rs_want = fold_reference(pieces, Reduction::Sum, acc).to(dtype);
          if (dtype == at::kFloat) {
            EXPECT_TRUE(at::allclose(scattered[r], rs_want, kFloatRtol, kFloatAtol));
          } else {
            EXPECT_TRUE(equal_exactly(scattered[r], rs_want));
          }
        }
      }
    }
  }
  EXPECT_TRUE(shm_files().empty());
}

// A reduce-scatter folds its own piece where it lies in its input (NOTE in
// shm_reduce_scatter). An output that is exactly that piece (NCCL's in-place
// reduce-scatter) is folded in place; one that overlaps the input anywhere else
// (here: the piece shifted by 5 elements) goes through a scratch buffer, or
// later chunks would read input the earlier ones overwrote.
TEST(ShmBackend, ReduceScatterIntoItsOwnInput) {
  constexpr int64_t n = 3000;  // int32: 12000 bytes a piece, ~6 chunks of the small slot
  for (int world : {1, 2, 3, 4}) {
    for (int64_t shift : {0, 5}) {
      std::vector<at::Tensor> scattered(world);
      expect_no_errors(run_ranks(world, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
        at::Tensor storage = at::zeros({n * world + 5}, at::kInt);
        storage.narrow(0, 0, n * world).copy_(input(rank, n * world, at::kInt, 5));
        at::Tensor out = storage.narrow(0, rank * n + shift, n);
        at::Tensor in = storage.narrow(0, 0, n * world);
        pg._reduce_scatter_base(out, in)->wait();
        scattered[rank] = out.clone();
      }));
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(c10::str("W=", world, " shift ", shift, " rank ", r));
        std::vector<at::Tensor> pieces;
        for (int q = 0; q < world; ++q) {
          pieces.push_back(input(q, n * world, at::kInt, 5).narrow(0, r * n, n));
        }
        EXPECT_TRUE(equal_exactly(scattered[r], fold_reference(pieces, Reduction::Sum, at::kLong).to(at::kInt)));
      }
    }
  }
}

// The ops' direct calls move each rank's piece along dim 1 of [outer, rows,
// inner] (<torch_tp/direct_collectives.h>): runs of rows * inner elements,
// which here fall across the 2048-byte slots' chunk boundaries (a 7 x 33 run
// is 924 bytes of int32, a 300 x 5 run 6000) and come in several per chunk.
TEST(ShmBackend, DirectCallsMovePiecesAlongTheMiddleDim) {
  struct Shape {
    int64_t outer, rows, inner;
  };
  for (int world : {2, 3}) {
    for (const Shape shape : {Shape{1, 7, 33}, Shape{3, 0, 5}, Shape{3, 1, 1}, Shape{3, 7, 33}, Shape{4, 300, 5}}) {
      std::vector<at::Tensor> gathered(world), scattered(world);
      auto gather_input = [&](int rank) {
        return input(rank, shape.outer * shape.rows * shape.inner, at::kInt, 3)
            .view({shape.outer, shape.rows, shape.inner});
      };
      auto scatter_input = [&](int rank) {
        return input(rank, shape.outer * world * shape.rows * shape.inner, at::kInt, 4)
            .view({shape.outer, world * shape.rows, shape.inner});
      };
      expect_no_errors(run_ranks(world, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
        torch_tp::DirectCollectives& direct = pg;
        at::Tensor out = at::empty({shape.outer, world * shape.rows, shape.inner}, at::kInt);
        direct.all_gather_now(gather_input(rank), out, /*dim=*/1);
        gathered[rank] = out;
        at::Tensor piece = at::empty({shape.outer, shape.rows, shape.inner}, at::kInt);
        direct.reduce_scatter_now(scatter_input(rank), piece, c10d::ReduceOp(c10d::ReduceOp::SUM), /*dim=*/1);
        scattered[rank] = piece;
      }));
      std::vector<at::Tensor> ag_in, rs_in;
      for (int r = 0; r < world; ++r) {
        ag_in.push_back(gather_input(r));
        rs_in.push_back(scatter_input(r));
      }
      const at::Tensor ag_want = at::cat(ag_in, 1);
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(c10::str("W=", world, " [", shape.outer, ", ", shape.rows, ", ", shape.inner, "] rank ", r));
        EXPECT_TRUE(equal_exactly(gathered[r], ag_want));
        std::vector<at::Tensor> pieces;
        for (const auto& x : rs_in) {
          pieces.push_back(x.narrow(1, r * shape.rows, shape.rows));
        }
        EXPECT_TRUE(equal_exactly(scattered[r], fold_reference(pieces, Reduction::Sum, at::kLong).to(at::kInt)));
      }
    }
  }
  EXPECT_TRUE(shm_files().empty());
}

TEST(ShmBackend, SilentRankTimesOutWithItsRankNamed) {
  const auto timeout = std::chrono::milliseconds(500);
  const auto start = std::chrono::steady_clock::now();
  auto results = run_ranks(2, kSmallBuffer, timeout, [&](int rank, ProcessGroupShm& pg) {
    if (rank == 0) {
      std::vector<at::Tensor> t{at::ones({10})};
      pg.allreduce(t)->wait();
    } else {
      // Rank 1 never calls; it outlives rank 0's wait so it is not reported dead.
      std::this_thread::sleep_for(timeout * 3);
    }
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(contains(results[0].error, "all_reduce") && contains(results[0].error, "timed out") &&
              contains(results[0].error, "rank 1"))
      << results[0].error;
  EXPECT_TRUE(results[1].error.empty());
  EXPECT_LT(elapsed, timeout * 3 + std::chrono::seconds(2));
}

TEST(ShmBackend, MismatchedCallsFailOnEveryRank) {
  auto results = run_ranks(3, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
    std::vector<at::Tensor> t{at::ones({rank == 2 ? 7 : 5})};
    pg.allreduce(t)->wait();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(results[r].error, "mismatch") && contains(results[r].error, "all_reduce"))
        << results[r].error;
  }
  EXPECT_TRUE(contains(results[2].error, "numel=7") && contains(results[2].error, "numel=5")) << results[2].error;
  EXPECT_TRUE(shm_files().empty());
}

// NOTE [the ops' dim in the call header]: equal shapes, different dims of
// the ops' tensor, through the ops' door (DirectCollectives).
TEST(ShmBackend, DirectCallsWithDifferentDimsFailOnEveryRank) {
  auto results = run_ranks(2, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
    torch_tp::DirectCollectives& direct = pg;
    direct.all_gather_now(at::ones({1, 2, 2}), at::empty({1, 4, 2}), /*dim=*/rank);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(results[r].error, "mismatch") && contains(results[r].error, "the op's dim=0") &&
                contains(results[r].error, "the op's dim=1"))
        << results[r].error;
  }
  EXPECT_TRUE(shm_files().empty());
}

TEST(ShmBackend, BadInputIsRefusedWithTheOpAndValueNamed) {
  expect_no_errors(run_ranks(2, kSmallBuffer, std::chrono::seconds(30), [&](int, ProcessGroupShm& pg) {
    std::vector<at::Tensor> ints{at::ones({4}, at::kInt)};
    c10d::AllreduceOptions avg;
    avg.reduceOp = c10d::ReduceOp(c10d::ReduceOp::AVG);
    EXPECT_TRUE(torch_tp::testing::throws_with([&] { pg.allreduce(ints, avg); },
                                                {"torch_tp backend: all_reduce", "avg", "Int"}));
    std::vector<at::Tensor> two{at::ones({4}), at::ones({4})};
    EXPECT_TRUE(torch_tp::testing::throws_with([&] { pg.allreduce(two); }, {"all_reduce", "1 tensor(s), got 2"}));
    at::Tensor in = at::ones({4});
    at::Tensor out = at::empty({7});
    EXPECT_TRUE(torch_tp::testing::throws_with([&] { pg._allgather_base(out, in); },
                                                {"all_gather_into_tensor", "8 elements, got 7"}));
    c10d::AllreduceOptions band;
    band.reduceOp = c10d::ReduceOp(c10d::ReduceOp::BAND);
    EXPECT_TRUE(torch_tp::testing::throws_with([&] { pg.allreduce(ints, band); },
                                                {"torch_tp backend: all_reduce", "reduce_op BAND", "not supported"}));
    // A refused call does not break the group.
    pg.barrier()->wait();
  }));
}

TEST(ShmBackend, AsyncWorkCompletesItsFuture) {
  expect_no_errors(run_ranks(2, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
    std::vector<at::Tensor> t{at::full({3000}, static_cast<float>(rank + 1))};
    auto work = pg.allreduce(t);
    auto future = work->getFuture();
    future->wait();
    EXPECT_TRUE(work->isCompleted());
    EXPECT_TRUE(equal_exactly(future->value().toTensorVector()[0], at::full({3000}, 3.0f)));
  }));
}

TEST(ShmBackend, WaitingOnTheLastCallRunsTheQueuedOnesInOrder) {
  // The wait may run the calls the worker has not started on this thread
  // (NOTE [waiters run their own calls]): all of them, in issue order (the
  // call headers would not match across ranks otherwise), and each Work done.
  expect_no_errors(run_ranks(2, kSmallBuffer, std::chrono::seconds(30), [&](int rank, ProcessGroupShm& pg) {
    for (int round = 0; round < 50; ++round) {
      std::vector<std::vector<at::Tensor>> tensors;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int i = 0; i < 6; ++i) {
        tensors.push_back({at::full({100 + 700 * i}, static_cast<float>((rank + 1) * (i + 1)))});
        c10d::AllreduceOptions options;
        options.asyncOp = true;
        works.push_back(pg.allreduce(tensors.back(), options));
      }
      works.back()->wait();
      for (int i = 0; i < 6; ++i) {
        works[i]->wait();
        EXPECT_TRUE(equal_exactly(tensors[i][0], at::full({100 + 700 * i}, 3.0f * (i + 1))))
            << "round " << round << " call " << i;
      }
    }
  }));
}

} // namespace
