#pragma once
// The ranks of one group that share a node, connected through shared memory:
// one segment per rank, every rank mapping all of them. A collective is a
// sequence of *steps*. In step s every rank writes into its own slot s % 2,
// publishes s in its `posted` counter, waits until every peer has published s,
// and then reads what it needs from the peers' slots s % 2.
//
// NOTE [double buffering without acknowledgements]
// A rank reads the peers' slot s % 2 only between its wait for step s and its
// own post of step s + 1. A rank writes slot s % 2 again only in step s + 2,
// after it waited for every peer to post s + 1, so after every peer finished
// reading step s. Two slots and one monotonic counter per rank therefore need
// no separate acknowledgement. The per-call header (CallHeader) is double
// buffered the same way, one per slot.
//
// NOTE [waiting]
// A rank waits for a peer's counter by polling it. How it passes the time
// between polls decides both the latency of a small collective and whether
// more ranks than cores make progress at all:
// - It spins (a pause instruction between polls, no system call) while
//   spinning can pay off: the peer is not parked (below) and the node's ranks
//   that are not parked fit its cores (sched_getaffinity), so the peer most
//   likely holds a core of its own and is about to post. A peer on another
//   core then answers as soon as it posts, as with DeepSpeed's spin-only
//   wait. Spinning stops after kSpinFor in one wait (the peer may be
//   preempted by another process, or computing for a long time).
// - Otherwise it parks: it sets the `parked` flag beside its `posted`
//   counter (the line its peers poll anyway) and yields the core. A parked
//   rank is not about to post, so its waiters park too instead of spinning
//   for nothing; and with 4 ranks on 2 cores the waiting ranks give the cores
//   to the ranks still computing. A parked waiter starts spinning again as
//   soon as the conditions above hold again (its peer unparked: it is
//   running).
// - After yielding for kYieldFor (500 us) when the node's ranks outnumber its
//   CPUs (the most ranks of the node this process shares a group with, usually
//   the world group's), or kYieldForOwnCores (10 ms) when every rank has a CPU
//   (yielding then takes no rank's CPU, and hands it to any other runnable
//   thread), it
//   sleeps: in a futex wait on the peer's `posted` for a wait on a peer's
//   step, flagged in `parked`, so that the peer wakes it when it posts
//   (arrive(): the poster's store and the sleeper's flag and reload are
//   sequentially consistent, so one of them sees the other); in short naps
//   for the rings. Sleeping costs a wake-up: a sleeping CPU (a VM's
//   especially) resumes long after the post, a yielding one almost at once,
//   which is why the ranks that fit the CPUs yield that long; in the example
//   model's 2-rank training step, where a rank waits for its peer several
//   times per step, often for longer than kYieldFor, yielding
//   kYieldForOwnCores instead made the step faster.
// A wait gives up when the peer has made no progress for the group's
// timeout, or at once when the peer's process is gone (checked with kill(pid,
// 0) and /proc, every few milliseconds), and then names the op and the rank.
// The clock is read once per kPollsPerCheck polls, so those checks cost the
// spinning nothing measurable. After any failure the transport is broken: the
// ranks' steps no longer line up, so every later call fails at once with the
// first reason. The point-to-point rings (NOTE [send and recv] in
// p2p.cpp) wait the same way (wait_counter) and fail the same
// way; the sender thread there, which has no single peer to watch, uses
// Backoff's fixed schedule.
//
// NOTE [point-to-point rings]
// After its two slots, every rank's segment holds one ring per local peer: a
// single-producer/single-consumer byte ring carrying this rank's messages to
// that peer. `head` (bytes written, advanced by the owner) and `tail` (bytes
// read, advanced by the peer) sit on cache lines of their own; both only
// grow. A writer copies in what fits and never waits (ring_write); a reader
// copies out what is there, in pieces of at most a quarter ring so the writer
// can refill behind it, and waits for the rest (ring_read). Each ring holds
// buffer_bytes / (local ranks - 1) bytes (at least kMinRingBytes).

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "backend/shm_segment.h"

#include <c10/util/ArrayRef.h>

namespace torch_tp::backend {

// What every rank says about the call it is making; compared across the ranks
// in the first step of every call. `extra` is not compared (a value each rank
// contributes, e.g. how many steps it needs).
struct CallHeader {
  uint64_t seq = 0;    // the call's number in this group, from 1
  int32_t op = 0;      // OpCode
  int32_t dtype = -1;  // c10::ScalarType, or -1
  int64_t numel = 0;   // elements per rank, or -1 when ranks may differ
  int64_t root = -1;   // group rank of the root, or -1
  int64_t reduce = -1; // Reduction, or -1
  int64_t dim = -1;    // the ops' dim of a direct call, or -1 (NOTE [the ops' dim in the call header])
  int64_t extra = 0;
  // The tensor's shape, so that [2, 3] on one rank and [3, 2] on another (the
  // same numel) is a mismatch too, as gloo's shape checks make it. ndim is -1
  // where ranks may differ (all_to_all). Up to kHeaderDims sizes are kept;
  // beyond that the last slot holds the product of the remaining sizes.
  static constexpr int kHeaderDims = 8;
  int64_t ndim = -1;
  int64_t sizes[kHeaderDims] = {};
  void set_shape(c10::IntArrayRef shape);
};

// NOTE [the ops' dim in the call header]
// torch_tp's all_gather and reduce_scatter along dim d hand the backend x as
// [outer, rows, inner] around d. On a square piece, all_gather(x,
// dim=rank) gives every rank the same shape, and the shapes compared above
// cannot tell that rank 1's rows are rank 0's columns. The ops' direct calls
// (NOTE [direct calls from the ops]) pass d, which the header carries and
// compares like a size, so the mismatch is an error in every mode, not only
// under TORCH_DISTRIBUTED_DEBUG=DETAIL. Calls through c10d carry -1. Across
// nodes only the node-local steps compare it (gloo carries no header).

// The collectives, for headers and messages.
enum class OpCode : int32_t {
  Barrier = 1,
  AllReduce,
  Broadcast,
  AllGather,
  ReduceScatter,
  AllToAll,
  Gather,
  Scatter,
  Reduce,
};
const char* op_code_name(OpCode op);

// One pause of a fixed schedule per call: a spin for the first calls, then
// yields, then short naps (NOTE [waiting]: the sender thread's).
class Backoff {
 public:
  void pause();

 private:
  int calls_ = 0;
  std::chrono::steady_clock::time_point yield_start_{};
};

// Whether process `pid` still runs: it exists and is not a zombie.
bool process_alive(int64_t pid);

constexpr size_t kMinRingBytes = 4096;

class ShmTransport {
 public:
  struct Options {
    int local_rank;                 // index of this rank among the node's ranks
    std::vector<int> group_ranks;   // group rank of each of the node's ranks, ascending
    size_t buffer_bytes;            // data bytes per rank (two slots)
    std::chrono::milliseconds timeout;
    std::string token;              // unique to the group; part of the segment names
  };

  // Creates this rank's segment, maps every local peer's (exchanging readiness
  // through `store`), and unlinks its own once every peer has mapped it.
  ShmTransport(const c10::intrusive_ptr<c10d::Store>& store, Options options);

  int local_rank() const {
    return options_.local_rank;
  }
  int local_size() const {
    return static_cast<int>(options_.group_ranks.size());
  }
  size_t slot_bytes() const {
    return slot_bytes_;
  }
  // Whether the node's local ranks outnumber its online CPUs. The same on
  // every rank (sysconf, not this rank's affinity), so algorithms may be
  // chosen by it (NOTE [all-reduce algorithms]).
  bool ranks_outnumber_cpus() const {
    return ranks_outnumber_cpus_;
  }
  // Whether the node's online CPUs leave each rank a second core, for a
  // worker thread beside it: at least two per rank of the largest group of
  // this node the process has been in (NOTE [waiting]). Like the above, the
  // same on every rank of the node.
  bool ranks_have_spare_cores() const {
    return ranks_have_spare_cores_;
  }

  // The step the next arrive() publishes, and this rank's slot for it.
  uint64_t next_step() const {
    return step_ + 1;
  }
  char* my_slot(uint64_t step) const {
    return slot(options_.local_rank, step);
  }
  const char* peer_slot(int local, uint64_t step) const {
    return slot(local, step);
  }

  // Publishes the next step (the caller has written its slot) and waits until
  // every local rank published it. `header` (on a call's first step) is
  // published with it and checked against every peer's; a difference is a
  // "mismatch" error. Returns the step; the peers' headers can be read with
  // peer_header until the next arrive().
  uint64_t arrive(const char* op, const CallHeader* header = nullptr);
  const CallHeader& peer_header(int local, uint64_t step) const;

  // NOTE [point-to-point rings]. Peers are local ranks, never this one.
  // Copies up to `bytes` from `data` into the ring to `dst` without waiting;
  // returns how many it copied (0 when the ring is full).
  size_t ring_write(int dst, const void* data, size_t bytes);
  // Copies `bytes` out of the ring from `src` into `out` (nullptr: discards
  // them), waiting for them as NOTE [waiting] says; `op` names the call in
  // errors.
  void ring_read(int src, void* out, size_t bytes, const char* op);
  // Whether local rank `local`'s process still runs.
  bool peer_alive(int local) const;
  bool usable() const {
    return !broken_.load(std::memory_order_acquire);
  }

  // Fails every wait in progress and every later one (shutdown, abort).
  void abort(const std::string& why);
  // Throws the first failure again, if there was one.
  void check_usable(const char* op) const;

 private:
  struct Control;
  struct Ring;
  Control* control(int local) const;
  Ring* ring(int src, int dst) const;  // in src's segment
  // `may_sleep`: the counter is a peer's `posted`, whose owner wakes sleepers
  // (NOTE [waiting]); other waits nap.
  template <typename Explain>
  void wait_counter(int local, const std::atomic<uint64_t>& counter, uint64_t target, const char* op,
                    bool may_sleep, const Explain& explain);
  bool spin_pays_off(int local) const;  // NOTE [waiting]
  void set_parked(bool parked);
  void set_parked_state(uint32_t state);
  void wake_sleepers();
  char* slot(int local, uint64_t step) const;
  void wait_for(int local, uint64_t step, const char* op);
  void check_headers(uint64_t step, const char* op);
  [[noreturn]] void fail(const std::string& message);

  Options options_;
  size_t slot_bytes_;
  size_t data_offset_;
  size_t ring_bytes_;
  size_t rings_offset_;
  int cores_;  // the cores this rank may run on (NOTE [waiting])
  bool ranks_outnumber_cpus_;
  bool ranks_have_spare_cores_;
  std::chrono::microseconds yield_for_;  // NOTE [waiting]
  std::vector<ShmSegment> segments_;  // by local rank; ours is segments_[local_rank]
  uint64_t step_ = 0;
  std::atomic<bool> broken_{false};
  mutable std::mutex reason_mutex_;
  std::string broken_reason_;  // the first failure; guarded by reason_mutex_
};

} // namespace torch_tp::backend
