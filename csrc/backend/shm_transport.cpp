#include "backend/shm_transport.h"

#include "backend/reduce_kernels.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace torch_tp::backend {

// The head of every segment. `posted`, `parked` (NOTE [waiting]: 0 running,
// kParked, or kAsleep in a futex wait on a peer's `posted`) and the headers'
// digests (NOTE [header digests]) share a cache line of their own, which only
// the owner writes: peers poll it while the owner writes its header and data.
struct alignas(64) ShmTransport::Control {
  std::atomic<uint64_t> posted;
  std::atomic<uint32_t> parked;
  uint64_t digest[2];  // of call[0], call[1]; published by the release store to `posted`
  char pad0[64 - 2 * sizeof(uint64_t) - sizeof(std::atomic<uint64_t>) - sizeof(std::atomic<uint32_t>) - 4];
  int64_t pid;
  char pad1[64 - sizeof(int64_t)];
  alignas(64) CallHeader call[2];
};

// NOTE [point-to-point rings]: the head of each ring, its bytes follow.
struct alignas(64) ShmTransport::Ring {
  std::atomic<uint64_t> head;  // bytes written, by the segment's owner
  char pad0[64 - sizeof(std::atomic<uint64_t>)];
  std::atomic<uint64_t> tail;  // bytes read, by the peer
  char pad1[64 - sizeof(std::atomic<uint64_t>)];
};

namespace {

constexpr size_t kPage = 4096;
// NOTE [waiting]: the longest spin of one wait, how long a parked waiter
// yields before it sleeps (when the node's ranks outnumber its CPUs, and when
// they do not), the nap, and the polls between two reads of the clock (a few
// microseconds of pauses). Backoff (the sender thread) spins kSpins polls
// instead.
constexpr auto kSpinFor = std::chrono::microseconds(50);
constexpr auto kYieldFor = std::chrono::microseconds(500);
constexpr auto kYieldForOwnCores = std::chrono::milliseconds(10);
constexpr auto kNap = std::chrono::microseconds(20);
// The longest futex sleep of a waiter on a peer's `posted` before it checks the
// deadline, the peer's liveness and abort() again.
constexpr auto kSleepFor = std::chrono::milliseconds(2);
// Values of Control::parked.
constexpr uint32_t kParked = 1;
constexpr uint32_t kAsleep = 2;
constexpr int kPollsPerCheck = 64;
constexpr int kSpins = 1000;
// How often a waiter checks that the peer's process still runs.
constexpr auto kLivenessEvery = std::chrono::milliseconds(5);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// NOTE [waiting]: a parked waiter sleeps on the low 32 bits of the peer's
// `posted` counter, which change with every step the peer publishes. The
// segments are shared mappings, so the futex is a process-shared one (no
// FUTEX_PRIVATE_FLAG). The kernel reads the word itself; little-endian, the
// low half of the 64-bit counter is its first four bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the futex word is the counter's low half");
static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "a lock-free 64-bit counter");

uint32_t* futex_word(const std::atomic<uint64_t>& counter) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(&counter));
}

// Sleeps while the word still holds `expected`, for at most `timeout`; any
// return (a wake, a changed word, the timeout, a signal) sends the caller back
// to polling.
void futex_sleep(const std::atomic<uint64_t>& counter, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds.count());
  ts.tv_nsec = static_cast<long>((timeout - seconds).count());
  ::syscall(SYS_futex, futex_word(counter), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(const std::atomic<uint64_t>& counter) {
  ::syscall(SYS_futex, futex_word(counter), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

size_t round_up(size_t value, size_t to) {
  return (value + to - 1) / to * to;
}

} // namespace

void CallHeader::set_shape(c10::IntArrayRef shape) {
  ndim = static_cast<int64_t>(shape.size());
  std::fill(std::begin(sizes), std::end(sizes), 0);
  for (const auto d : c10::irange(shape.size())) {
    const size_t slot = std::min<size_t>(d, kHeaderDims - 1);
    sizes[slot] = d <= slot ? shape[d] : sizes[slot] * shape[d];
  }
}

namespace {

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
    out += c10::str(", reduce_op=", reduction_name(static_cast<Reduction>(h.reduce)));
  }
  if (h.dim >= 0) {
    out += c10::str(", the op's dim=", h.dim);
  }
  if (h.ndim >= 0) {
    const auto kept = std::min<int64_t>(h.ndim, CallHeader::kHeaderDims);
    out += c10::str(", shape=", c10::IntArrayRef(h.sizes, static_cast<size_t>(kept)));
  }
  return out + ")";
}

bool same_shape(const CallHeader& a, const CallHeader& b) {
  return a.ndim == b.ndim && std::equal(std::begin(a.sizes), std::end(a.sizes), std::begin(b.sizes));
}

bool same_call(const CallHeader& a, const CallHeader& b) {
  return a.seq == b.seq && a.op == b.op && a.dtype == b.dtype && a.numel == b.numel && a.root == b.root &&
         a.reduce == b.reduce && a.dim == b.dim && same_shape(a, b);
}

// NOTE [header digests]
// A call's first step checks that every rank made the same call. Reading
// each peer's header would pull two more cache lines per peer from another
// core on every call, a good part of a small collective's time. So each rank
// also publishes a 64-bit digest of its header on the line its peers poll
// anyway (beside `posted`), and a peer's header is read only when its digest
// differs, to name what differs. The digest mixes exactly the fields
// same_call compares (multiply-xorshift per word): equal calls give equal
// digests; different calls give equal ones with a chance of about 2^-64.
uint64_t digest_of(const CallHeader& h) {
  uint64_t d = 0x9e3779b97f4a7c15ull;
  auto mix = [&d](uint64_t word) {
    d = (d ^ word) * 0xbf58476d1ce4e5b9ull;
    d ^= d >> 31;
  };
  mix(h.seq);
  mix((static_cast<uint64_t>(static_cast<uint32_t>(h.op)) << 32) | static_cast<uint32_t>(h.dtype));
  mix(static_cast<uint64_t>(h.numel));
  mix(static_cast<uint64_t>(h.root));
  mix(static_cast<uint64_t>(h.reduce));
  mix(static_cast<uint64_t>(h.dim));
  mix(static_cast<uint64_t>(h.ndim));
  for (const int64_t size : h.sizes) {
    mix(static_cast<uint64_t>(size));
  }
  return d;
}

} // namespace

// A killed rank whose parent has not reaped it yet is a zombie.
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

void Backoff::pause() {
  if (calls_ < kSpins) {
    ++calls_;
    cpu_relax();
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (calls_ == kSpins) {
    ++calls_;
    yield_start_ = now;
  }
  if (now - yield_start_ < kYieldFor) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(kNap);
  }
}

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
  static_assert(offsetof(Control, pid) == 64, "the polled line holds posted, parked and the digests only");
  const int n = local_size();
  TORCH_INTERNAL_ASSERT(options_.local_rank >= 0 && options_.local_rank < n);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  cores_ = ::sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed) : 1;
  const long cpus = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  ranks_outnumber_cpus_ = n > cpus;
  // The most ranks of one node this process has shared a group with (usually the
  // world group's, made first): a TP sub-group of 2 fits 2 CPUs, but not beside a
  // second one (NOTE [waiting]).
  static std::atomic<int> most_node_ranks{0};
  int most = most_node_ranks.load();
  while (most < n && !most_node_ranks.compare_exchange_weak(most, n)) {
  }
  yield_for_ = std::max(most, n) > cpus ? kYieldFor : kYieldForOwnCores;
  ranks_have_spare_cores_ = 2L * std::max(most, n) <= cpus;
  // Slots start on cache lines, so chunk boundaries do too.
  slot_bytes_ = options_.buffer_bytes / 2 / 64 * 64;
  data_offset_ = round_up(sizeof(Control), kPage);
  rings_offset_ = data_offset_ + 2 * slot_bytes_;
  ring_bytes_ = n > 1 ? std::max(options_.buffer_bytes / static_cast<size_t>(n - 1) / 64 * 64, kMinRingBytes) : 0;
  const size_t bytes = rings_offset_ + static_cast<size_t>(n - 1) * (sizeof(Ring) + ring_bytes_);
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
  own->parked.store(0, std::memory_order_relaxed);
  own->pid = static_cast<int64_t>(::getpid());
  for (const auto local : c10::irange(n)) {
    if (local != options_.local_rank) {
      auto* r = new (ring(options_.local_rank, local)) Ring();
      r->head.store(0, std::memory_order_relaxed);
      r->tail.store(0, std::memory_order_relaxed);
    }
  }
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
    own->digest[step % 2] = digest_of(*header);
  }
  // seq_cst, as the waiter's store of kAsleep and its reload of `posted` (NOTE
  // [waiting]): either the waiter sees this step before it sleeps, or this
  // rank sees it asleep below and wakes it.
  own->posted.store(step, std::memory_order_seq_cst);
  wake_sleepers();
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
  const int rank = options_.group_ranks[local];
  const int me = options_.group_ranks[options_.local_rank];
  wait_counter(local, control(local)->posted, step, op, /*may_sleep=*/true, [&](bool timed_out, uint64_t seen) {
    return timed_out ? c10::str(" (it reached step ", seen, ", rank ", me, " waits at step ", step, "); rank ", rank,
                                " stopped calling collectives or is stuck")
                     : c10::str(" at step ", step);
  });
}

// Waits until `counter`, which local rank `local` advances, reaches `target`,
// as NOTE [waiting] says. explain(timed_out, seen) completes the error message.
template <typename Explain>
void ShmTransport::wait_counter(int local, const std::atomic<uint64_t>& counter, uint64_t target, const char* op,
                                bool may_sleep, const Explain& explain) {
  using Clock = std::chrono::steady_clock;
  auto arrived = [&] { return counter.load(std::memory_order_acquire) >= target; };
  // The common case, a peer that is there or about to be: no clock read.
  for (int i = 0; i < kPollsPerCheck; ++i) {
    if (arrived()) {
      return;
    }
    cpu_relax();
  }
  const auto start = Clock::now();
  auto last_progress = start;
  auto next_liveness = start + kLivenessEvery;
  auto last_check = start;
  Clock::duration spun{};
  Clock::time_point parked_since{};
  bool parked = false;
  bool spinning = true;  // during the polls since last_check
  uint64_t seen = counter.load(std::memory_order_acquire);
  const int rank = options_.group_ranks[local];
  const int me = options_.group_ranks[options_.local_rank];
  // Unparks on every way out, a throw included.
  struct Unpark {
    ShmTransport& t;
    const bool& parked;
    ~Unpark() {
      if (parked) {
        t.set_parked(false);
      }
    }
  } unpark{*this, parked};
  for (;;) {
    const uint64_t now_seen = counter.load(std::memory_order_acquire);
    if (now_seen >= target) {
      return;
    }
    const auto now = Clock::now();
    if (spinning) {
      spun += now - last_check;
    }
    last_check = now;
    if (now_seen != seen) {
      seen = now_seen;
      last_progress = now;
    }
    if (broken_.load(std::memory_order_acquire)) {
      check_usable(op);
    }
    if (now >= next_liveness) {
      next_liveness = now + kLivenessEvery;
      const int64_t pid = control(local)->pid;
      if (!process_alive(pid)) {
        fail(c10::str("torch_tp backend: ", op, ": rank ", rank, " (pid ", pid, ") exited while rank ", me,
                      " waited for it", explain(false, seen), "; the group is unusable"));
      }
    }
    if (now - last_progress >= options_.timeout) {
      fail(c10::str("torch_tp backend: ", op, ": timed out after ", options_.timeout.count(), " ms waiting for rank ",
                    rank, explain(true, seen)));
    }
    spinning = spun < kSpinFor && spin_pays_off(local);
    if (spinning) {
      if (parked) {
        parked = false;
        set_parked(false);
      }
      for (int i = 0; i < kPollsPerCheck && !arrived(); ++i) {
        cpu_relax();
      }
      continue;
    }
    if (!parked) {
      parked = true;
      parked_since = now;
      set_parked(true);
    }
    if (now - parked_since < yield_for_) {
      std::this_thread::yield();
    } else if (may_sleep) {
      // Asleep only while the peer has not posted since `seen` (reloaded after the flag
      // is set; see arrive()), for at most kSleepFor or until the next liveness check.
      set_parked_state(kAsleep);
      const uint64_t current = counter.load(std::memory_order_seq_cst);
      if (current < target) {
        futex_sleep(counter, static_cast<uint32_t>(current),
                    std::min<Clock::duration>(kSleepFor, std::max<Clock::duration>(next_liveness - now, {})));
      }
      set_parked_state(kParked);
    } else {
      std::this_thread::sleep_for(kNap);
    }
  }
}

// NOTE [waiting]: local rank `local` is not parked, and the ranks that are
// not parked (this one included) have a core each.
bool ShmTransport::spin_pays_off(int local) const {
  if (control(local)->parked.load(std::memory_order_relaxed) != 0) {
    return false;
  }
  int active = 0;
  for (const auto r : c10::irange(local_size())) {
    active += r == options_.local_rank || control(r)->parked.load(std::memory_order_relaxed) == 0 ? 1 : 0;
  }
  return active <= cores_;
}

void ShmTransport::set_parked(bool parked) {
  control(options_.local_rank)->parked.store(parked ? kParked : 0, std::memory_order_relaxed);
}

void ShmTransport::set_parked_state(uint32_t state) {
  control(options_.local_rank)->parked.store(state, std::memory_order_seq_cst);
}

// NOTE [waiting]: after publishing a step, wakes the local peers asleep on it.
void ShmTransport::wake_sleepers() {
  for (const auto local : c10::irange(local_size())) {
    if (local != options_.local_rank && control(local)->parked.load(std::memory_order_seq_cst) == kAsleep) {
      futex_wake_all(control(options_.local_rank)->posted);
      return;
    }
  }
}

ShmTransport::Ring* ShmTransport::ring(int src, int dst) const {
  const size_t index = static_cast<size_t>(dst < src ? dst : dst - 1);
  return reinterpret_cast<Ring*>(static_cast<char*>(segments_[src].data()) + rings_offset_ +
                                 index * (sizeof(Ring) + ring_bytes_));
}

size_t ShmTransport::ring_write(int dst, const void* data, size_t bytes) {
  Ring* r = ring(options_.local_rank, dst);
  const uint64_t head = r->head.load(std::memory_order_relaxed);
  const uint64_t tail = r->tail.load(std::memory_order_acquire);
  const size_t n = std::min(bytes, ring_bytes_ - static_cast<size_t>(head - tail));
  if (n == 0) {
    return 0;
  }
  char* base = reinterpret_cast<char*>(r + 1);
  const size_t at = static_cast<size_t>(head % ring_bytes_);
  const size_t first = std::min(n, ring_bytes_ - at);
  std::memcpy(base + at, data, first);
  std::memcpy(base, static_cast<const char*>(data) + first, n - first);
  r->head.store(head + n, std::memory_order_release);
  return n;
}

void ShmTransport::ring_read(int src, void* out, size_t bytes, const char* op) {
  check_usable(op);
  Ring* r = ring(src, options_.local_rank);
  const char* base = reinterpret_cast<const char*>(r + 1);
  const size_t piece = std::max<size_t>(ring_bytes_ / 4, 64);
  const int me = options_.group_ranks[options_.local_rank];
  const int rank = options_.group_ranks[src];
  uint64_t tail = r->tail.load(std::memory_order_relaxed);
  size_t done = 0;
  while (done < bytes) {
    uint64_t head = r->head.load(std::memory_order_acquire);
    if (head == tail) {
      wait_counter(src, r->head, tail + 1, op, /*may_sleep=*/false, [&](bool timed_out, uint64_t) {
        return timed_out ? c10::str(" to send (rank ", me, " waits for it); rank ", rank,
                                    " did not call send or is stuck")
                         : std::string(" to send");
      });
      head = r->head.load(std::memory_order_acquire);
    }
    const size_t n = std::min({bytes - done, static_cast<size_t>(head - tail), piece});
    if (out != nullptr) {
      const size_t at = static_cast<size_t>(tail % ring_bytes_);
      const size_t first = std::min(n, ring_bytes_ - at);
      std::memcpy(static_cast<char*>(out) + done, base + at, first);
      std::memcpy(static_cast<char*>(out) + done + first, base, n - first);
    }
    tail += n;
    done += n;
    r->tail.store(tail, std::memory_order_release);
  }
}

bool ShmTransport::peer_alive(int local) const {
  return process_alive(control(local)->pid);
}

// A peer whose digest equals this rank's made the same call (NOTE [header digests]).
void ShmTransport::check_headers(uint64_t step, const char* op) {
  const uint64_t my_digest = control(options_.local_rank)->digest[step % 2];
  const CallHeader& mine = peer_header(options_.local_rank, step);
  for (const auto local : c10::irange(local_size())) {
    if (control(local)->digest[step % 2] == my_digest) {
      continue;
    }
    const CallHeader& theirs = peer_header(local, step);
    if (!same_call(theirs, mine)) {
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
