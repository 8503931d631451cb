#include "backend/work_queue.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <sys/prctl.h>

#include <algorithm>

namespace torch_tp::backend {

ShmWork::ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    if (done_) {
      complete_future(future_);
    }
  }
  return future_;
}

bool ShmWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) {
    std::shared_ptr<WorkQueue> queue;
    {
      std::lock_guard<std::mutex> lock(future_mutex_);
      queue = queue_;  // keeps the queue alive while this thread runs its calls
    }
    if (queue) {
      queue->run_queued_through(this);
    }
  }
  const bool done = c10d::Work::wait(timeout);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);  // complete() has finished with it
    future = future_;
  }
  if (future) {
    future->wait();
  }
  return done;
}

void ShmWork::complete(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    finish(error);
    error_ = error;
    done_ = true;
    future = future_;
    queue_.reset();  // never the last owner here: whoever runs the call holds one
  }
  if (future) {
    complete_future(future);
  }
}

void ShmWork::complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& future) const {
  if (error_) {
    future->setError(error_);
  } else {
    future->markCompleted(c10::IValue(outputs_));
  }
}

void stop_thread(std::mutex& mutex, bool& stopping, std::condition_variable& cv, std::thread& thread) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  cv.notify_one();
  if (thread.joinable()) {
    thread.join();
  }
}

void lower_timer_slack() {
  ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
}

WorkQueue::WorkQueue(int rank)
    : rank_(rank), thread_([this] {
        lower_timer_slack();
        loop();
      }) {}

c10::intrusive_ptr<ShmWork> WorkQueue::push(c10d::OpType type, std::vector<at::Tensor> outputs,
                                            std::function<void()> run) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, std::move(outputs));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "torch_tp backend: the process group was shut down");
    enqueue({work, std::move(run)});
  }
  cv_.notify_one();
  return work;
}

c10::intrusive_ptr<ShmWork> WorkQueue::run_inline_or_push(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                          std::function<void()> run) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, std::move(outputs));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "torch_tp backend: the process group was shut down");
    if (busy_ || !items_.empty()) {
      enqueue({work, std::move(run)});
      cv_.notify_one();
      return work;
    }
    busy_ = true;
  }
  execute({work, std::move(run)});
  end_inline();
  return work;
}

void WorkQueue::run_now(std::function<void()> run) {
  c10::intrusive_ptr<ShmWork> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "torch_tp backend: the process group was shut down");
    if (busy_ || !items_.empty()) {
      queued = c10::make_intrusive<ShmWork>(rank_, c10d::OpType::UNKNOWN, std::vector<at::Tensor>{});
      enqueue({queued, std::move(run)});
    } else {
      busy_ = true;
    }
  }
  if (queued) {
    cv_.notify_one();
    queued->wait(kNoTimeout);  // rethrows the call's error
    return;
  }
  struct EndInline {
    WorkQueue& queue;
    ~EndInline() {
      queue.end_inline();
    }
  } end{*this};
  run();
}

void WorkQueue::enqueue(Item item) {
  item.work->queue_ = weak_from_this().lock();  // NOTE [waiters run their own calls]
  items_.push_back(std::move(item));
}

void WorkQueue::run_queued_through(const ShmWork* work) {
  for (;;) {
    Item item;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool queued = std::any_of(items_.begin(), items_.end(), [&](const Item& i) { return i.work.get() == work; });
      if (busy_ || !queued) {
        return;  // running on the worker or another waiter (the Work's wait follows), or done
      }
      item = std::move(items_.front());
      items_.pop_front();
      busy_ = true;
    }
    const bool mine = item.work.get() == work;
    execute(std::move(item));
    end_inline();
    if (mine) {
      return;
    }
  }
}

void WorkQueue::end_inline() {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    wake = !items_.empty() || stopping_;
  }
  // Only when the worker has something to do (a call another thread queued
  // meanwhile, or stop()): a needless wake-up makes it runnable for nothing,
  // and on a busy node it then competes with the ranks for a core.
  if (wake) {
    cv_.notify_one();
  }
}

void WorkQueue::stop() {
  stop_thread(mutex_, stopping_, cv_, thread_);
}

void WorkQueue::execute(Item item) {
  std::exception_ptr error;
  try {
    item.run();
  } catch (...) {
    error = std::current_exception();
  }
  item.run = nullptr;  // drop the captured tensors before completing
  item.work->complete(error);
}

void WorkQueue::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return (stopping_ && !busy_) || (!items_.empty() && !busy_); });
      if (items_.empty()) {
        return;
      }
      item = std::move(items_.front());
      items_.pop_front();
      busy_ = true;
    }
    execute(std::move(item));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
  }
}

} // namespace torch_tp::backend
