#pragma once
// A c10d backend for "ranks as threads of one process", and the harness that
// runs a test body on every rank. The torch wheel ships no gloo headers, so
// the C++ tests cannot build a ProcessGroupGloo; this backend stands in for it.
// It is a test double, written to be obviously correct rather than fast:
//
//   - The W rank threads each construct their own ThreadBackend; all of them
//     hold one ThreadGroupState (the rendezvous), passed in explicitly.
//   - A collective is two barriers. Each rank posts its input tensor (shared,
//     not copied) and a signature (op, reduce op, dtype, sizes) and waits
//     until all W have posted; the last to arrive checks that the signatures
//     agree. Then every rank reads all inputs and computes its own result
//     into a temporary, and waits again, so that no rank writes its output
//     (for allreduce: its input) or starts the next collective while another
//     still reads. The barrier's generation counter keeps consecutive
//     collectives apart.
//   - Reductions fold rank 0, 1, ..., W-1 from the left in the tensor's dtype,
//     the same order on every rank, so every rank gets a bitwise identical result.
//   - No wait is unbounded. A barrier gives up after the group's timeout, and
//     fails at once when a peer has left the group (its test body returned or
//     threw), so a rank that fails before a collective reports a clear error
//     on every rank instead of a hang.
//   - Work is returned already completed; a failed collective throws from the
//     call itself.
//
// run_ranks(W, body) sets all of this up: one c10d::HashStore shared by the W
// ProcessGroups, c10d's group registry in thread-isolation mode (each rank
// thread registers its own ProcessGroup under the same name), and per-rank
// reporting of exceptions and gtest failures.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace torch_tp::testing {

// The rendezvous shared by the W ranks of one group.
class ThreadGroupState {
 public:
  explicit ThreadGroupState(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : world_size_(world_size),
        timeout_(timeout),
        inputs_(world_size),
        signatures_(world_size) {
    TORCH_CHECK(world_size >= 1, "ThreadGroupState: world_size=", world_size, " must be >= 1");
  }

  int world_size() const {
    return world_size_;
  }

  // Runs one collective on `rank`: posts `input` with its `signature`, waits for
  // all ranks, calls compute(inputs of ranks 0..W-1) -> this rank's result,
  // waits for all ranks again, and returns the result. Throws c10::Error when a
  // peer has left, the signatures differ, or the timeout passes.
  template <typename Compute>
  at::Tensor collective(int rank, const at::Tensor& input, const std::string& signature, Compute&& compute) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inputs_[rank] = input;
      signatures_[rank] = signature;
    }
    arrive_and_wait(rank, signature, /*check_signatures=*/true);
    // Between the barriers every rank only reads the posted inputs.
    at::Tensor result = compute(inputs_);
    arrive_and_wait(rank, signature, /*check_signatures=*/false);
    return result;
  }

  // Called when `rank`'s test body has ended, normally or not: peers waiting in
  // a collective can no longer complete it and fail at once.
  void depart(int rank, const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (departure_reason_.empty()) {
      departure_reason_ = "rank " + std::to_string(rank) + " left the group (" + why + ")";
    }
    cv_.notify_all();
  }

 private:
  // A generation-counted barrier. A barrier whose generation has advanced has
  // completed, whatever happened to the group since: a rank that passes it and
  // then departs must not fail peers that have not woken up yet. The one
  // completed barrier that fails is one whose ranks disagreed on the collective.
  void arrive_and_wait(int rank, const std::string& signature, bool check_signatures) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(!broken_, "threads backend: rank ", rank, " cannot run ", signature, ": the group is broken: ",
                broken_reason_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      if (check_signatures) {
        for (int r = 1; r < world_size_; ++r) {
          if (signatures_[r] != signatures_[0]) {
            break_group(c10::str("ranks disagree on the collective: rank 0 runs ", signatures_[0], ", rank ", r,
                                 " runs ", signatures_[r]));
            mismatch_generation_ = generation_;
            break;
          }
        }
      }
      cv_.notify_all();
    } else {
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      while (generation_ == generation) {
        TORCH_CHECK(!broken_, "threads backend: ", broken_reason_);
        if (!departure_reason_.empty()) {
          break_group(departure_reason_ + " while rank " + std::to_string(rank) + " waits in " + signature);
          TORCH_CHECK(false, "threads backend: ", broken_reason_);
        }
        if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation) {
          break_group(c10::str("rank ", rank, " timed out after ", timeout_.count(), " ms waiting for ",
                               world_size_ - arrived_, " of ", world_size_, " ranks in ", signature));
          TORCH_CHECK(false, "threads backend: ", broken_reason_);
        }
      }
    }
    TORCH_CHECK(mismatch_generation_ != generation + 1, "threads backend: ", broken_reason_);
  }

  // Marks the group unusable (the first reason wins) and wakes every waiter. Needs mutex_.
  void break_group(const std::string& reason) {
    if (!broken_) {
      broken_ = true;
      broken_reason_ = reason;
    }
    cv_.notify_all();
  }

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<at::Tensor> inputs_;
  std::vector<std::string> signatures_;
  std::string departure_reason_;
  bool broken_ = false;
  std::string broken_reason_;
  uint64_t mismatch_generation_ = 0; // generations start at 1 once completed
};

// A Work that is complete when it is made: the backend finishes each
// collective before returning.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> result)
      : c10d::Work(rank, op_type), result_(std::move(result)) {
    finish();
  }

  std::vector<at::Tensor> result() override {
    return result_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

class ThreadBackend : public c10d::Backend {
 public:
  ThreadBackend(int rank, int size, std::shared_ptr<ThreadGroupState> state)
      : c10d::Backend(rank, size), state_(std::move(state)) {
    TORCH_CHECK(state_ && state_->world_size() == size, "ThreadBackend: the shared state is for another world size");
    TORCH_CHECK(rank >= 0 && rank < size, "ThreadBackend: rank=", rank, " is out of range for world size ", size);
  }

  const std::string getBackendName() const override {
    return "threads";
  }

  // The tensors the last collective was handed, as they were handed: tests
  // check what callers give a backend (NOTE [what a backend's threads may hold]).
  const std::vector<at::Tensor>& last_handed() const {
    return handed_;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    TORCH_CHECK(tensors.size() == 1, "threads backend: allreduce takes one tensor, got ", tensors.size());
    at::Tensor& tensor = tensors[0];
    handed_ = tensors;
    check_dense("allreduce", tensor);
    const auto op = opts.reduceOp.op_;
    const std::string signature = c10::str("allreduce(", op_name(op), ", ", tensor.scalar_type(), ", ",
                                           tensor.sizes(), ")");
    at::NoGradGuard no_grad;
    const at::Tensor reduced = state_->collective(rank_, tensor, signature, [&](const std::vector<at::Tensor>& in) {
      return fold(op, in, [](const at::Tensor& t) { return t; });
    });
    tensor.copy_(reduced);
    return c10::make_intrusive<CompletedWork>(rank_, c10d::OpType::ALLREDUCE, tensors);
  }

  // Every rank's tensor becomes rank opts.rootRank's (the DDP reducer's bucket rebuild uses it).
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override {
    TORCH_CHECK(tensors.size() == 1, "threads backend: broadcast takes one tensor, got ", tensors.size());
    at::Tensor& tensor = tensors[0];
    handed_ = tensors;
    check_dense("broadcast", tensor);
    const std::string signature = c10::str("broadcast(", opts.rootRank, ", ", tensor.scalar_type(), ", ",
                                           tensor.sizes(), ")");
    at::NoGradGuard no_grad;
    const int64_t root = opts.rootRank;
    const at::Tensor value = state_->collective(rank_, tensor, signature,
                                                [&](const std::vector<at::Tensor>& in) { return in[root].clone(); });
    tensor.copy_(value);
    return c10::make_intrusive<CompletedWork>(rank_, c10d::OpType::BROADCAST, tensors);
  }

  // output [W * n] (flat) holds rank r's input [n] (flat) at r*n..(r+1)*n.
  // torch >= 2.13 routes all_gather_single here; older torch calls this directly.
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/ =
                                                     c10d::AllgatherOptions()) override {
    handed_ = {input, output};
    check_dense("_allgather_base", input);
    check_dense("_allgather_base", output);
    check_pair("_allgather_base", output, input, output.numel() == size_ * input.numel(), "W * input.numel()");
    const std::string signature = c10::str("_allgather_base(", input.scalar_type(), ", numel=", input.numel(), ")");
    at::NoGradGuard no_grad;
    const at::Tensor gathered = state_->collective(rank_, input, signature, [&](const std::vector<at::Tensor>& in) {
      std::vector<at::Tensor> flat;
      flat.reserve(in.size());
      for (const auto& t : in) {
        flat.push_back(t.reshape({-1}));
      }
      return at::cat(flat);
    });
    output.view({-1}).copy_(gathered);
    return c10::make_intrusive<CompletedWork>(rank_, c10d::OpType::_ALLGATHER_BASE, std::vector<at::Tensor>{output});
  }

  // input [W * n] (flat): output [n] = reduce over ranks of their block r*n..(r+1)*n.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts =
                                                          c10d::ReduceScatterOptions()) override {
    handed_ = {input, output};
    check_dense("_reduce_scatter_base", input);
    check_dense("_reduce_scatter_base", output);
    check_pair("_reduce_scatter_base", output, input, input.numel() == size_ * output.numel(), "W * output.numel()");
    const auto op = opts.reduceOp.op_;
    const std::string signature = c10::str("_reduce_scatter_base(", op_name(op), ", ", input.scalar_type(),
                                           ", numel=", input.numel(), ")");
    const int64_t n = output.numel();
    const int64_t rank = rank_;
    at::NoGradGuard no_grad;
    const at::Tensor piece = state_->collective(rank_, input, signature, [&](const std::vector<at::Tensor>& in) {
      return fold(op, in, [&](const at::Tensor& t) { return t.reshape({-1}).narrow(0, rank * n, n); });
    });
    output.view({-1}).copy_(piece);
    return c10::make_intrusive<CompletedWork>(rank_, c10d::OpType::_REDUCE_SCATTER_BASE,
                                              std::vector<at::Tensor>{output});
  }

 private:
  static const char* op_name(c10d::ReduceOp::RedOpType op) {
    switch (op) {
      case c10d::ReduceOp::SUM: return "SUM";
      case c10d::ReduceOp::PRODUCT: return "PRODUCT";
      case c10d::ReduceOp::MIN: return "MIN";
      case c10d::ReduceOp::MAX: return "MAX";
      default: return "unsupported";
    }
  }

  // ((in[0] op in[1]) op in[2]) ... in the tensors' dtype, on a piece of each.
  template <typename Piece>
  static at::Tensor fold(c10d::ReduceOp::RedOpType op, const std::vector<at::Tensor>& in, Piece&& piece) {
    TORCH_CHECK(op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::PRODUCT || op == c10d::ReduceOp::MIN ||
                    op == c10d::ReduceOp::MAX,
                "threads backend: ReduceOp ", static_cast<int>(op), " is not supported (SUM, PRODUCT, MIN, MAX are)");
    at::Tensor acc = piece(in[0]).clone();
    for (size_t r = 1; r < in.size(); ++r) {
      const at::Tensor x = piece(in[r]);
      switch (op) {
        case c10d::ReduceOp::SUM: acc.add_(x); break;
        case c10d::ReduceOp::PRODUCT: acc.mul_(x); break;
        case c10d::ReduceOp::MIN: acc = at::minimum(acc, x); break;
        case c10d::ReduceOp::MAX: acc = at::maximum(acc, x); break;
        default: break;
      }
    }
    return acc;
  }

  static void check_dense(const char* op, const at::Tensor& t) {
    TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous() && t.device().is_cpu(), "threads backend: ", op,
                " needs contiguous dense CPU tensors, got sizes ", t.sizes(), " strides ", t.strides(), " on ",
                t.device());
  }

  static void check_pair(const char* op, const at::Tensor& output, const at::Tensor& input, bool numel_ok,
                         const char* expected) {
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "threads backend: ", op, ": output dtype ",
                output.scalar_type(), " differs from input dtype ", input.scalar_type());
    TORCH_CHECK(numel_ok, "threads backend: ", op, ": output.numel()=", output.numel(), ", input.numel()=",
                input.numel(), ", expected the larger to be ", expected);
  }

  std::shared_ptr<ThreadGroupState> state_;
  std::vector<at::Tensor> handed_;
};

// What a rank that failed said.
struct RankFailure {
  int rank;
  std::string message;
};

inline std::string exception_message(std::exception_ptr error) {
  try {
    std::rethrow_exception(std::move(error));
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

// Runs body(rank, group_name) on `world_size` threads, rank r on thread r, each
// with its own ProcessGroup (one ThreadBackend, one shared HashStore) registered
// under `group_name` in that thread's registry. Returns the ranks whose body
// threw, in rank order; gtest failures inside a body are reported by gtest
// itself (thread-safe), tagged with the rank through SCOPED_TRACE.
inline std::vector<RankFailure> try_run_ranks(int world_size,
                                              const std::function<void(int rank, const std::string& group_name)>& body,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  // Thread isolation (a process-wide switch, turned on once and left on) makes
  // c10d's group registry per thread: RankLocal<GroupRegistry>, keyed by
  // at::RecordFunction::currentThreadId(), a counter never reused, so each new
  // rank thread starts with an empty registry. An autograd node is followed
  // back to the thread that ran its forward, so backward resolves the same
  // group. Every rank thus registers its own group under the same name.
  static std::once_flag isolation_once;
  std::call_once(isolation_once, [] { c10d::set_thread_isolation_mode(true); });

  static std::atomic<int> next_group{0};
  const std::string group_name = c10::str("threads_w", world_size, "_", next_group++);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto state = std::make_shared<ThreadGroupState>(world_size, timeout);
  std::vector<std::exception_ptr> errors(world_size);

  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      SCOPED_TRACE(c10::str("rank ", rank, " of ", world_size));
      std::string why = "its test body returned; a failed ASSERT_* returns early";
      try {
        auto backend = c10::make_intrusive<ThreadBackend>(rank, world_size, state);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
        group->setGroupName(group_name);
        c10d::register_process_group(group_name, group);
        try {
          body(rank, group_name);
        } catch (...) {
          c10d::unregister_process_group(group_name);
          throw;
        }
        c10d::unregister_process_group(group_name);
      } catch (...) {
        errors[rank] = std::current_exception();
        why = "it threw: " + exception_message(errors[rank]);
      }
      state->depart(rank, why);
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }

  std::vector<RankFailure> failures;
  for (int rank = 0; rank < world_size; ++rank) {
    if (errors[rank]) {
      failures.push_back({rank, exception_message(errors[rank])});
    }
  }
  return failures;
}

// try_run_ranks, reporting every rank that threw as a test failure.
inline void run_ranks(int world_size, const std::function<void(int rank, const std::string& group_name)>& body,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  for (const auto& failure : try_run_ranks(world_size, body, timeout)) {
    ADD_FAILURE() << "rank " << failure.rank << " of " << world_size << " threw: " << failure.message;
  }
}

} // namespace torch_tp::testing
