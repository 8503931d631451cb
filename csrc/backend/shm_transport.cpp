#include "backend/shm_transport.h"

#include "backend/reduce_kernels.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <thread>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace torch_tp::backend {

// The head of every segment. `posted` has a cache line of its own: peers
// poll it while the owner writes its header and data.
struct alignas(64) ShmTransport::Control {
  std::atomic<uint64_t> posted;
  char pad0[64 - sizeof(std::atomic<uint64_t>)];
  int64_t pid;
  char pad1[64 - sizeof(int64_t)];
  alignas(64) CallHeader call[2];
};

namespace {

constexpr size_t kPage = 4096;
// Busy polls before a waiter starts yielding the core, and how long it keeps
// yielding before it naps.
constexpr int kSpins = 1000;
constexpr auto kYieldFor = std::chrono::microseconds(500);
constexpr auto kNap = std::chrono::microseconds(20);
// How often a waiter checks that the peer's process still runs.
constexpr auto kLivenessEvery = std::chrono::milliseconds(5);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

size_t round_up(size_t value, size_t to) {
  return (value + to - 1) / to * to;
}

// Whether process `pid` still runs: it exists and is not a zombie (a killed
// rank whose parent has not reaped it yet is one).
bool process_alive(int64_t pid) {
  if (pid <= 0 || pid == static_cast<int64_t>(::getpid())) {
    return true;
  }
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    return false;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) {
    return true;  // no /proc: trust kill()
  }
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) {
    return true;
  }
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

std::string describe(const CallHeader& h) {
  std::string out = c10::str(op_code_name(static_cast<OpCode>(h.op)), "(call ", h.seq);
  if (h.dtype >= 0) {
    out += c10::str(", dtype=", static_cast<c10::ScalarType>(h.dtype));
  }
  if (h.numel >= 0) {
    out += c10::str(", numel=", h.numel);
  }
  if (h.root >= 0) {
    out += c10::str(", root=", h.root);
  }
  if (h.reduce >= 0) {
    out += c10::str(", reduce_op=", reduce_kind_name(static_cast<ReduceKind>(h.reduce)));
  }
  return out + ")";
}

} // namespace

const char* op_code_name(OpCode op) {
  switch (op) {
    case OpCode::Barrier: return "barrier";
    case OpCode::AllReduce: return "all_reduce";
    case OpCode::Broadcast: return "broadcast";
    case OpCode::AllGather: return "all_gather";
    case OpCode::ReduceScatter: return "reduce_scatter";
    case OpCode::AllToAll: return "all_to_all";
    case OpCode::Gather: return "gather";
    case OpCode::Scatter: return "scatter";
    case OpCode::Reduce: return "reduce";
  }
  return "unknown op";
}

ShmTransport::ShmTransport(const c10::intrusive_ptr<c10d::Store>& store, Options options)
    : options_(std::move(options)) {
  const int n = local_size();
  TORCH_INTERNAL_ASSERT(options_.local_rank >= 0 && options_.local_rank < n);
  // Slots start on cache lines, so chunk boundaries do too.
  slot_bytes_ = options_.buffer_bytes / 2 / 64 * 64;
  data_offset_ = round_up(sizeof(Control), kPage);
  const size_t bytes = data_offset_ + 2 * slot_bytes_;
  auto name_of = [&](int local) {
    return c10::str("/torch_tp_", ::getuid(), "_", options_.token, "_", options_.group_ranks[local]);
  };
  auto key_of = [&](const char* what, int local) {
    return c10::str("torch_tp/shm/", what, "/", options_.group_ranks[local]);
  };
  auto wait_keys = [&](const char* what) {
    std::vector<std::string> keys;
    for (const auto local : c10::irange(n)) {
      keys.push_back(key_of(what, local));
    }
    try {
      store->wait(keys, options_.timeout);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "torch_tp backend: init: timed out after ", options_.timeout.count(),
                  " ms waiting for the node's ranks ", options_.group_ranks, " to ", what,
                  " their shared-memory segments: ", e.what_without_backtrace());
    }
  };

  segments_.resize(n);
  ShmSegment& mine = segments_[options_.local_rank];
  mine = ShmSegment::create(name_of(options_.local_rank), bytes);
  auto* own = new (mine.data()) Control();
  own->posted.store(0, std::memory_order_relaxed);
  own->pid = static_cast<int64_t>(::getpid());
  store->set(key_of("create", options_.local_rank), std::vector<uint8_t>{1});
  wait_keys("create");
  for (const auto local : c10::irange(n)) {
    if (local != options_.local_rank) {
      segments_[local] = ShmSegment::open(name_of(local), bytes);
    }
  }
  store->set(key_of("map", options_.local_rank), std::vector<uint8_t>{1});
  wait_keys("map");
  // NOTE [segment lifetime]: every peer holds a mapping now.
  mine.unlink();
}

ShmTransport::Control* ShmTransport::control(int local) const {
  return static_cast<Control*>(segments_[local].data());
}

char* ShmTransport::slot(int local, uint64_t step) const {
  return static_cast<char*>(segments_[local].data()) + data_offset_ + (step % 2) * slot_bytes_;
}

const CallHeader& ShmTransport::peer_header(int local, uint64_t step) const {
  return control(local)->call[step % 2];
}

uint64_t ShmTransport::arrive(const char* op, const CallHeader* header) {
  check_usable(op);
  const uint64_t step = step_ + 1;
  Control* own = control(options_.local_rank);
  if (header != nullptr) {
    own->call[step % 2] = *header;
  }
  own->posted.store(step, std::memory_order_release);
  for (const auto local : c10::irange(local_size())) {
    if (local != options_.local_rank) {
      wait_for(local, step, op);
    }
  }
  step_ = step;
  if (header != nullptr) {
    check_headers(step, op);
  }
  return step;
}

void ShmTransport::wait_for(int local, uint64_t step, const char* op) {
  const std::atomic<uint64_t>& posted = control(local)->posted;
  for (int i = 0; i < kSpins; ++i) {
    if (posted.load(std::memory_order_acquire) >= step) {
      return;
    }
    cpu_relax();
  }
  const auto start = std::chrono::steady_clock::now();
  auto last_progress = start;
  auto next_liveness = start + kLivenessEvery;
  uint64_t seen = posted.load(std::memory_order_acquire);
  const int rank = options_.group_ranks[local];
  for (;;) {
    const uint64_t now_posted = posted.load(std::memory_order_acquire);
    if (now_posted >= step) {
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now_posted != seen) {
      seen = now_posted;
      last_progress = now;
    }
    if (broken_.load(std::memory_order_acquire)) {
      check_usable(op);
    }
    if (now >= next_liveness) {
      next_liveness = now + kLivenessEvery;
      const int64_t pid = control(local)->pid;
      if (!process_alive(pid)) {
        fail(c10::str("torch_tp backend: ", op, ": rank ", rank, " (pid ", pid, ") exited while rank ",
                      options_.group_ranks[options_.local_rank], " waited for it at step ", step,
                      "; the group is unusable"));
      }
    }
    if (now - last_progress >= options_.timeout) {
      fail(c10::str("torch_tp backend: ", op, ": timed out after ", options_.timeout.count(),
                    " ms waiting for rank ", rank, " (it reached step ", now_posted, ", rank ",
                    options_.group_ranks[options_.local_rank], " waits at step ", step, "); rank ", rank,
                    " stopped calling collectives or is stuck"));
    }
    if (now - start < kYieldFor) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kNap);
    }
  }
}

void ShmTransport::check_headers(uint64_t step, const char* op) {
  const CallHeader& mine = peer_header(options_.local_rank, step);
  for (const auto local : c10::irange(local_size())) {
    const CallHeader& theirs = peer_header(local, step);
    const bool same = theirs.seq == mine.seq && theirs.op == mine.op && theirs.dtype == mine.dtype &&
                      theirs.numel == mine.numel && theirs.root == mine.root && theirs.reduce == mine.reduce;
    if (!same) {
      fail(c10::str("torch_tp backend: ", op, ": mismatch between ranks: rank ",
                    options_.group_ranks[options_.local_rank], " called ", describe(mine), " but rank ",
                    options_.group_ranks[local], " called ", describe(theirs),
                    "; every rank must make the same collective calls in the same order"));
    }
  }
}

void ShmTransport::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  if (!broken_.load(std::memory_order_relaxed)) {
    broken_reason_ = why;
    broken_.store(true, std::memory_order_release);
  }
}

void ShmTransport::check_usable(const char* op) const {
  if (broken_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    C10_THROW_ERROR(DistBackendError, c10::str("torch_tp backend: ", op,
                                               ": the group is unusable after an earlier failure: ", broken_reason_));
  }
}

void ShmTransport::fail(const std::string& message) {
  abort(message);
  C10_THROW_ERROR(DistBackendError, message);
}

} // namespace torch_tp::backend
