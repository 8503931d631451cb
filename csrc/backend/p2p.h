#pragma once
// A ProcessGroupShm's send and recv (NOTE [send and recv] in p2p.cpp): to
// ranks of this node through the transport's rings, to ranks of other nodes
// over the gloo group of all ranks.

#include "backend/work_queue.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace c10d {
class Backend;
} // namespace c10d

namespace torch_tp::backend {

class ShmTransport;

class PointToPoint {
 public:
  // `local_index`: by group rank, the rank's index among the transport's
  // local ranks, or -1 for a rank on another node. `gloo_all` spans the group
  // (null when it has one node).
  PointToPoint(ShmTransport& transport, std::vector<int> local_index, c10::intrusive_ptr<c10d::Backend> gloo_all,
               int rank, std::chrono::milliseconds timeout);
  ~PointToPoint();

  // The arguments are checked: one tensor, dense, on the CPU; a peer that is
  // another rank of the group. Called in the caller's issue order.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag);
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag);

  // Lets the queued recvs run out, streams out the queued sends (NOTE [send
  // and recv]) and joins both threads.
  void stop();

 private:
  class Sender;

  ShmTransport& transport_;
  const std::vector<int> local_index_;
  const c10::intrusive_ptr<c10d::Backend> gloo_all_;
  const int rank_;
  std::vector<uint64_t> sent_;      // messages sent to each rank so far
  std::vector<uint64_t> received_;  // messages received from each rank so far
  WorkQueue recvs_;
  std::unique_ptr<Sender> sender_;
};

} // namespace torch_tp::backend
