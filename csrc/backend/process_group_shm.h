#pragma once
// ProcessGroupShm: torch_tp's c10d backend for CPU tensors ("torch_tp").
//
// Ranks on one node talk through POSIX shared memory (ShmTransport, the
// algorithms in shm_collectives.h). Ranks are placed on nodes by a host key
// per rank (the hostname, or TORCH_TP_HOST_KEY), which the Python factory
// exchanges through the store. When the group spans several nodes, the
// reductions (all-reduce, reduce, reduce-scatter) and barrier are
// hierarchical: shared memory inside each node, then a gloo group of one
// leader per node, then shared memory again (NOTE [reductions across nodes]);
// the other collectives and send/recv between nodes run on a gloo group of
// all the ranks. The gloo groups are built in Python (the torch wheel ships
// no gloo headers) and passed in.
//
// This class is the c10d front end: it checks every call's arguments on the
// caller's thread, numbers the collectives and runs them through a WorkQueue
// (NOTE [one worker thread] in work_queue.h). What a collective does is the
// Collectives picked at construction (collectives.h): the single-node one
// (node_collectives.cpp) or the multi-node one (multi_node_collectives.cpp).
// send and recv are PointToPoint's (NOTE [send and recv] in p2p.cpp). The
// ops' synchronous calls enter through DirectCollectives, without c10d.

#include "backend/reduction.h"

#include <torch_tp/direct_collectives.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch_tp::backend {

class Collectives;
class PointToPoint;
class ShmTransport;
class WorkQueue;

// The default per-rank shared data buffer: two slots of 1 MiB.
constexpr size_t kDefaultBufferBytes = 2 * 1024 * 1024;

// TORCH_TP_SHM_BUFFER_BYTES, validated, or the default.
size_t buffer_bytes_from_env();

// Places the group's ranks on nodes: every rank publishes its host key
// (TORCH_TP_HOST_KEY, or the hostname) in the group's store and reads all of
// them. Returns the keys by group rank (Options::host_keys). Both ways of
// making a group use it: torch_tp/backend.py's factory and torch_tp::new_group.
std::vector<std::string> exchange_host_keys(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout);

class ProcessGroupShm : public c10d::Backend, public DirectCollectives {
 public:
  struct Options {
    std::chrono::milliseconds timeout;
    size_t buffer_bytes = kDefaultBufferBytes;
    std::vector<std::string> host_keys;  // by group rank; equal keys share a node
    // Required when host_keys name more than one node: gloo over all the
    // group's ranks, and (on each node's first rank only) gloo over the node
    // leaders, ordered by node.
    c10::intrusive_ptr<c10d::Backend> gloo_all;
    c10::intrusive_ptr<c10d::Backend> gloo_leaders;
  };

  ProcessGroupShm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Options options);
  ~ProcessGroupShm() override;

  const std::string getBackendName() const override {
    return "torch_tp";
  }
  // c10d's debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) of torch 2.11 asks the
  // backend it wraps to agree on sequence numbers when it is made (2.14's and 2.15's
  // do not). They agree already: every rank starts at 0 and counts the same calls.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;

  // Fails what is queued or running (with `why`) and stops the worker threads.
  void shutdown() override;
  void abort() override;

  // DirectCollectives: the c10d calls above with async_op=false, entered
  // directly by the ops (NOTE [direct calls from the ops] in
  // <torch_tp/direct_collectives.h>). They run on the caller's thread in
  // queue order (NOTE [synchronous calls run inline]) and carry the ops' dim
  // in the call header (NOTE [the ops' dim in the call header] in
  // shm_transport.h). In a profiler trace each shows as
  // torch_tp_backend::<collective> where c10d's call would show as
  // c10d::<collective>.
  void all_reduce_now(const at::Tensor& input, const at::Tensor& output, const c10d::ReduceOp& reduce_op) override;
  void all_gather_now(const at::Tensor& input, const at::Tensor& output, int64_t dim) override;
  void reduce_scatter_now(const at::Tensor& input, const at::Tensor& output, const c10d::ReduceOp& reduce_op,
                          int64_t dim) override;
  // Through the shared buffers where the group is on one node, else false.
  bool all_to_all_pieces_now(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                             const std::vector<int64_t>& recv_rows, AllToAllPieces& pieces) override;
  bool overlaps_async_calls() const override {
    return overlaps_async_calls_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> collective(c10d::OpType type, std::vector<at::Tensor> outputs, bool async_op,
                                            std::function<void(uint64_t seq)> run);
  // NOTE [direct calls from the ops]; `name` is the profiler's.
  void call_now(const char* name, const std::function<void(uint64_t seq)>& run);
  // The checks of a call and the Run that does it, shared by the c10d method
  // and the direct call; `dim` is the ops' (-1 from c10d); the pieces are
  // concatenated along `concat_dim`: 0 from c10d, 1 of the direct calls' 3-d
  // tensors.
  std::function<void(uint64_t seq)> all_gather_into_tensor_run(std::vector<at::Tensor>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts, int64_t dim,
                                                               int64_t concat_dim);
  std::function<void(uint64_t seq)> reduce_scatter_tensor_run(const std::vector<at::Tensor>& outputs,
                                                              const std::vector<at::Tensor>& inputs,
                                                              std::vector<Reduction> kinds, int64_t dim,
                                                              int64_t concat_dim);
  void stop(const std::string& why);

  c10::intrusive_ptr<c10d::Store> store_;
  Options options_;
  std::unique_ptr<ShmTransport> transport_;
  std::unique_ptr<Collectives> collectives_;  // single- or multi-node, picked at construction
  bool overlaps_async_calls_ = true;  // NOTE [async calls without a core to run on]
  uint64_t seq_ = 0;  // collective calls issued; guarded by the caller's order
  std::shared_ptr<WorkQueue> queue_;  // the collectives' (shared with the Works it may still run)
  std::unique_ptr<PointToPoint> p2p_;
};

} // namespace torch_tp::backend
