#pragma once
// The backend's Work and the queues that run its calls, one thread each.
//
// NOTE [one worker thread]
// Every call is checked on the caller's thread (bad input raises at once) and
// then queued to one worker thread that runs the calls in issue order and
// completes their Work and future. The caller can thus overlap compute with a
// collective (async_op=True, torch_tp's PendingCollective), and the calls of
// all ranks reach the transport in the same order, as its lockstep needs.
// Receives go to a second queue of their own, so a recv waiting for a late
// send never holds up the collectives; sends never wait for the receiver
// (see NOTE [send and recv] in p2p.cpp).
//
// NOTE [synchronous calls run inline]
// A call made with async_op=False (torch passes it as opts.asyncOp) is waited
// for at once, so handing it to the worker only adds two thread wake-ups
// (on a busy machine more than a small all-reduce takes) and a second runnable thread
// per rank for the scheduler to place.
// When nothing is queued or running, such a call runs on the caller's thread;
// otherwise it queues behind the earlier calls, so the order stays the
// issue order either way.
//
// NOTE [waiters run their own calls]
// A caller that waits (without a timeout) on a call the worker has not
// started yet runs it itself, and any calls queued before it, in order, as
// the worker would: an async_op=True call waited for at once, or an
// overlapped one whose compute was shorter than the worker's wake-up, then
// costs no thread hand-off at all.
// The queue is one at a time either way (`busy_`), so the order stays the
// issue order. A Work holds its queue (shared) only until it completes, so
// the queue outlives every wait that may run its calls. A wait with a
// timeout never runs a call: the call's own deadline would replace it.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace torch_tp::backend {

class WorkQueue;

// A call's Work and its future, completed by whoever ran the call.
//
// NOTE [the Work's future]
// A caller that waited on either side reads the other at once: torch's
// join() calls work.wait() and then work.get_future().value(), and a
// future's waiter may ask work.isCompleted(). So the Work finishes first (a
// woken future implies a completed Work), and wait() returns only once the
// future is completed too. The future is made on the first getFuture() (DDP
// comm hooks, join): most calls never ask for it, and making and completing
// one (a typed list of the outputs) is a good part of what a small
// collective costs. `future_mutex_` orders complete() against getFuture()
// and wait(), so every future made is completed exactly once, after finish().
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);

  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool wait(std::chrono::milliseconds timeout) override;

  // Finishes the Work, then its future if one was made, with `error` or with the outputs.
  void complete(std::exception_ptr error);

 private:
  friend class WorkQueue;

  void complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& future) const;

  std::vector<at::Tensor> outputs_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by future_mutex_, as are:
  bool done_ = false;
  std::exception_ptr error_;
  // The queue that may still run this call, until it completes (NOTE
  // [waiters run their own calls]); null for a queue not owned by a shared_ptr.
  std::shared_ptr<WorkQueue> queue_;
};

// A FIFO of calls run by one thread. stop() lets the queued calls run out
// (they fail fast once the transport is aborted) and joins the thread. Owned
// by a shared_ptr, it also lets waiters run their calls (NOTE [waiters run
// their own calls]).
class WorkQueue : public std::enable_shared_from_this<WorkQueue> {
 public:
  explicit WorkQueue(int rank);
  ~WorkQueue() {
    stop();
  }

  // Queues `run` behind the calls before it; the Work completes once it ran.
  c10::intrusive_ptr<ShmWork> push(c10d::OpType type, std::vector<at::Tensor> outputs, std::function<void()> run);
  // The same for a call its caller waits for at once: runs it on the calling
  // thread if nothing is queued or running (NOTE [synchronous calls run
  // inline]), otherwise queues it behind the others.
  c10::intrusive_ptr<ShmWork> run_inline_or_push(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                 std::function<void()> run);
  // The same for a caller that needs no Work (NOTE [direct calls from the
  // ops] in process_group_shm.h): returns once `run` ran, throwing what it threw.
  void run_now(std::function<void()> run);

  // Runs on the calling thread the queued calls up to and including `work`'s,
  // if the worker has not started them; returns at once otherwise.
  void run_queued_through(const ShmWork* work);

  void stop();

 private:
  struct Item {
    c10::intrusive_ptr<ShmWork> work;
    std::function<void()> run;
  };

  // Appends `item` (mutex_ held), letting its waiter run it.
  void enqueue(Item item);
  static void execute(Item item);
  void loop();
  // Ends an inline run: frees the queue and wakes the worker if it has something to do.
  void end_inline();

  const int rank_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool busy_ = false;  // a call is running, on the worker or inline; the next one waits
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

// Sets `stopping` under `mutex`, wakes `thread` through `cv` and joins it.
void stop_thread(std::mutex& mutex, bool& stopping, std::condition_variable& cv, std::thread& thread);

// Lowers the calling thread's timer slack: a waiting rank naps for tens of
// microseconds (NOTE [waiting]), and the default 50 us slack would more than
// double each nap. For the threads that wait on the transport.
void lower_timer_slack();

} // namespace torch_tp::backend
