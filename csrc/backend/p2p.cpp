// NOTE [send and recv]
// Between ranks of one node a message goes through shared memory: the ring
// from the sender to the receiver in the sender's segment (NOTE
// [point-to-point rings] in shm_transport.h). It is a P2PHeader (tag, dtype,
// numel, the message's number on that ordered pair) followed by the bytes, so
// messages match in issue order per pair; a tag, dtype or numel that differs
// from the recv's is a "mismatch" error (the recv first skips the message's
// bytes, so the pair stays in step).
//
// Sends are buffered, as gloo's are: send() runs on the caller's thread and
// never waits for the receiver. It writes into the ring what fits now; the
// rest is copied into the Sender's outbox for that peer, and the Sender
// thread streams it in as the receiver frees space (a message of any size
// goes through a ring of any size), serving all peers' outboxes round robin.
// The Work completes at once. Recvs run on the p2p queue thread in issue
// order, each reading its message out of the ring as it arrives.
//
// Why a Sender thread rather than sends on the p2p queue: with sends and
// recvs on one thread, rank A queueing send(B, big), recv(B) while B queues
// send(A, big), recv(A) would deadlock once the messages outgrow the rings,
// each thread stuck in a send its peer never drains. Here a send never
// blocks any thread on a receiver, so every program that works with fully
// buffered sends (gloo's) works here, at the cost of one copy of what does
// not fit in the ring at send time.
//
// A recv waits as collectives do (NOTE [waiting]): an error naming recv and
// the sender when the sender's process is gone or sends nothing for the
// group's timeout; that failure, like a collective's, makes the group
// unusable. Messages still in an outbox at shutdown are streamed out first
// (unless aborted, the receiver died, or it took nothing for the timeout).
//
// Ranks on other nodes use the gloo group of all ranks instead: the header
// and the bytes go as one byte message with an internal tag (gloo delivers
// one pair's messages on one tag in order), and recv checks the header as
// above. The message is a copy, so the caller's tensor is free at once, as
// with local sends; gloo's Work completes when it has gone out. A wait is
// gloo's, bounded by the same timeout.

#include "backend/p2p.h"

#include "backend/dense.h"
#include "backend/shm_transport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstring>

namespace torch_tp::backend {
namespace {

// The sender thread polls a full ring with NOTE [waiting]'s schedule, and
// after this long without progress only every kSenderDoze.
constexpr auto kSenderDozeAfter = std::chrono::milliseconds(20);
constexpr auto kSenderDoze = std::chrono::milliseconds(1);

struct P2PHeader {
  int32_t tag;
  int32_t dtype;
  int64_t numel;
  uint64_t seq;  // the message's number on its (src, dst) pair
};

void check_p2p_header(const P2PHeader& header, uint64_t seq, int tag, const at::Tensor& t, int src, int dst) {
  TORCH_CHECK(header.seq == seq, "torch_tp backend: recv: rank ", dst, " expected message ", seq, " from rank ", src,
              " but got message ", header.seq);
  TORCH_CHECK(header.tag == tag && header.dtype == static_cast<int32_t>(t.scalar_type()) && header.numel == t.numel(),
              "torch_tp backend: recv: mismatch between ranks: rank ", src, " sent (tag=", header.tag,
              ", dtype=", static_cast<at::ScalarType>(header.dtype), ", numel=", header.numel, ") but rank ", dst,
              " receives (tag=", tag, ", dtype=", t.scalar_type(), ", numel=", t.numel(), ")");
}

// The gloo tag of the messages to and from other nodes; gloo_all is this
// backend's own group, so no other traffic uses it.
constexpr int kRemoteP2PTag = 0;

} // namespace

// The sending side of NOTE [send and recv]: messages to local peers, each
// written into its ring at once as far as it fits; the rest is copied and
// streamed in by the sender thread as the receiver frees space.
class PointToPoint::Sender {
 public:
  Sender(ShmTransport& transport, std::chrono::milliseconds timeout)
      : transport_(transport),
        timeout_(timeout),
        outboxes_(static_cast<size_t>(transport.local_size())),
        thread_([this] {
          lower_timer_slack();
          loop();
        }) {}
  ~Sender() {
    stop();
  }

  // Never waits for the receiver: the message is in the ring or queued here.
  void send(int dst, const void* header, size_t header_bytes, const void* data, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "torch_tp backend: the process group was shut down");
    std::deque<Pending>& outbox = outboxes_[dst];
    size_t header_done = 0;
    size_t data_done = 0;
    if (outbox.empty()) {
      header_done = transport_.ring_write(dst, header, header_bytes);
      if (header_done == header_bytes) {
        data_done = transport_.ring_write(dst, data, bytes);
      }
    }
    if (header_done == header_bytes && data_done == bytes) {
      return;
    }
    Pending pending;
    pending.bytes.resize(header_bytes - header_done + bytes - data_done);
    std::memcpy(pending.bytes.data(), static_cast<const char*>(header) + header_done, header_bytes - header_done);
    if (bytes > data_done) {
      std::memcpy(pending.bytes.data() + header_bytes - header_done, static_cast<const char*>(data) + data_done,
                  bytes - data_done);
    }
    outbox.push_back(std::move(pending));
    cv_.notify_one();
  }

  // Streams out what is queued (a normal shutdown waits for it, as a recv
  // would), unless the transport was aborted, a receiver died, or one made no
  // progress for the timeout; then joins the thread.
  void stop() {
    stop_thread(mutex_, stopping_, cv_, thread_);
  }

 private:
  struct Pending {
    std::vector<uint8_t> bytes;
    size_t done = 0;
  };

  void loop() {
    using Clock = std::chrono::steady_clock;
    std::vector<Clock::time_point> last_progress(outboxes_.size(), Clock::now());
    auto next_liveness = Clock::now();
    Backoff backoff;
    auto stalled_since = Clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      bool pending = false;
      bool progress = false;
      const auto now = Clock::now();
      const bool check_liveness = now >= next_liveness;
      if (check_liveness) {
        next_liveness = now + std::chrono::milliseconds(5);
      }
      for (const auto dst : c10::irange(outboxes_.size())) {
        std::deque<Pending>& outbox = outboxes_[dst];
        while (!outbox.empty()) {
          Pending& front = outbox.front();
          const size_t n = transport_.ring_write(static_cast<int>(dst), front.bytes.data() + front.done,
                                                 front.bytes.size() - front.done);
          front.done += n;
          if (n > 0) {
            progress = true;
            last_progress[dst] = now;
          }
          if (front.done < front.bytes.size()) {
            break;
          }
          outbox.pop_front();
        }
        // Nobody will read these: drop them (the sends completed already; the
        // receivers' side reports the failure).
        if (!outbox.empty() && (!transport_.usable() ||
                                (check_liveness && !transport_.peer_alive(static_cast<int>(dst))) ||
                                (stopping_ && now - last_progress[dst] >= timeout_))) {
          outbox.clear();
        }
        if (outbox.empty()) {
          last_progress[dst] = now;
        }
        pending = pending || !outbox.empty();
      }
      if (!pending) {
        if (stopping_) {
          return;
        }
        cv_.wait(lock);
        backoff = Backoff();
        stalled_since = Clock::now();
        continue;
      }
      if (progress) {
        backoff = Backoff();
        stalled_since = now;
      } else if (now - stalled_since >= kSenderDozeAfter) {
        // A receiver that is not receiving yet: poll less often.
        cv_.wait_for(lock, kSenderDoze);
        continue;
      }
      lock.unlock();
      backoff.pause();
      lock.lock();
    }
  }

  ShmTransport& transport_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::deque<Pending>> outboxes_;  // by local rank
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

PointToPoint::PointToPoint(ShmTransport& transport, std::vector<int> local_index,
                           c10::intrusive_ptr<c10d::Backend> gloo_all, int rank, std::chrono::milliseconds timeout)
    : transport_(transport),
      local_index_(std::move(local_index)),
      gloo_all_(std::move(gloo_all)),
      rank_(rank),
      sent_(local_index_.size(), 0),
      received_(local_index_.size(), 0),
      recvs_(rank),
      sender_(std::make_unique<Sender>(transport, timeout)) {}

PointToPoint::~PointToPoint() = default;

void PointToPoint::stop() {
  recvs_.stop();
  sender_->stop();
}

c10::intrusive_ptr<c10d::Work> PointToPoint::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  const at::Tensor t = tensors[0].contiguous();
  const uint64_t seq = sent_[dst_rank]++;
  const P2PHeader header{tag, static_cast<int32_t>(t.scalar_type()), t.numel(), seq};
  if (local_index_[dst_rank] < 0) {
    std::vector<at::Tensor> message{at::empty({static_cast<int64_t>(sizeof(header) + t.nbytes())}, at::kByte)};
    auto* bytes = static_cast<char*>(message[0].data_ptr());
    std::memcpy(bytes, &header, sizeof(header));
    if (t.nbytes() > 0) {
      std::memcpy(bytes + sizeof(header), t.data_ptr(), t.nbytes());
    }
    return gloo_all_->send(message, dst_rank, kRemoteP2PTag);
  }
  sender_->send(local_index_[dst_rank], &header, sizeof(header), t.data_ptr(), t.nbytes());
  auto work = c10::make_intrusive<ShmWork>(rank_, c10d::OpType::SEND, tensors);
  work->complete(nullptr);
  return work;
}

c10::intrusive_ptr<c10d::Work> PointToPoint::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  const char* op = "recv";
  const uint64_t seq = received_[src_rank]++;
  Dense dense(tensors[0]);
  const int src_local = local_index_[src_rank];
  if (src_local >= 0) {
    auto* transport = &transport_;
    const int me = rank_;
    return recvs_.push(c10d::OpType::RECV, tensors, [=] {
      const at::Tensor& t = dense.work;
      P2PHeader header{};
      transport->ring_read(src_local, &header, sizeof(header), op);
      const size_t bytes = static_cast<size_t>(header.numel) * c10::elementSize(static_cast<at::ScalarType>(header.dtype));
      if (header.seq != seq || header.tag != tag || header.dtype != static_cast<int32_t>(t.scalar_type()) ||
          header.numel != t.numel()) {
        transport->ring_read(src_local, nullptr, bytes, op);  // skip it: the next message starts behind it
        check_p2p_header(header, seq, tag, t, src_rank, me);
      }
      transport->ring_read(src_local, t.data_ptr(), bytes, op);
      dense.finish();
    });
  }
  auto gloo = gloo_all_;
  const int me = rank_;
  return recvs_.push(c10d::OpType::RECV, tensors, [gloo, seq, dense, src_rank, tag, op, me] {
    const at::Tensor& t = dense.work;
    std::vector<at::Tensor> message{at::empty({static_cast<int64_t>(sizeof(P2PHeader) + t.nbytes())}, at::kByte)};
    try {
      gloo->recv(message, src_rank, kRemoteP2PTag)->wait();
    } catch (c10::Error& e) {
      e.add_context(c10::str("torch_tp backend: ", op, ": rank ", me, " receiving ", t.nbytes(), " bytes from rank ",
                             src_rank, " on another node (a message of another size from that rank also fails here)"));
      throw;
    }
    const auto* bytes = static_cast<const char*>(message[0].data_ptr());
    P2PHeader header{};
    std::memcpy(&header, bytes, sizeof(header));
    check_p2p_header(header, seq, tag, t, src_rank, me);
    if (t.nbytes() > 0) {
      std::memcpy(t.data_ptr(), bytes + sizeof(header), t.nbytes());
    }
    dense.finish();
  });
}

} // namespace torch_tp::backend
