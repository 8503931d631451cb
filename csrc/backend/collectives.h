#pragma once
// What each collective of a ProcessGroupShm does, behind one interface with
// two implementations, picked once when the group is made:
//   node_collectives.cpp        all ranks on one node: shared memory only
//                               (shm_collectives.h on the node's ShmTransport)
//   multi_node_collectives.cpp  ranks on several nodes: shared memory inside
//                               each node composed with gloo between them
// ProcessGroupShm (the c10d front end) checks the arguments on the caller's
// thread and hands them here, still on the caller's thread: an
// implementation prepares what must be taken at issue time (dense copies)
// and returns the Run that the front end's queue calls with the call's
// sequence number. The reductions run on shared memory in both, so the front
// end makes their dense tensors itself; the other collectives take the c10d
// arguments as they came, which the multi-node one hands on to gloo.

#include "backend/dense.h"
#include "backend/reduction.h"
#include "backend/shm_transport.h"

#include <torch_tp/direct_collectives.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace c10d {
class Backend;
} // namespace c10d

namespace torch_tp::backend {

using Run = std::function<void(uint64_t seq)>;

class Collectives {
 public:
  virtual ~Collectives() = default;

  // Every tensors[i] reduced with kinds[i] across the group, in place.
  virtual Run all_reduce(std::vector<Dense> tensors, std::vector<Reduction> kinds) = 0;
  // output = input reduced with `kind` across the group: both contiguous, of
  // one dtype and numel; output may be input (NOTE [direct calls from the ops]).
  virtual Run all_reduce_into(at::Tensor input, at::Tensor output, Reduction kind) = 0;
  // The reduction lands in `tensor` on the root; every rank reduces into
  // `scratch` (the root: tensor.work itself, the others a copy).
  virtual Run reduce(Dense tensor, at::Tensor scratch, Reduction kind, int64_t root) = 0;
  virtual Run broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) = 0;
  virtual Run barrier() = 0;
  virtual Run all_gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                         const c10d::AllgatherOptions& opts) = 0;
  // `dim` (also of reduce_scatter_tensor): the ops' dim of a direct call,
  // -1 from c10d (NOTE [the ops' dim in the call header] in shm_transport.h).
  // `outer` (also of reduce_scatter_tensor): the ranks' pieces are
  // concatenated along dim 1 of [outer, rows, inner] views (the ops' direct
  // calls; c10d's calls are outer = 1, along dim 0). Each input is then
  // [outer, n, inner] and each output [outer, p * n, inner].
  virtual Run all_gather_into_tensor(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts, int64_t dim, int64_t outer) = 0;
  virtual Run gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                     const c10d::GatherOptions& opts) = 0;
  virtual Run scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                      const c10d::ScatterOptions& opts) = 0;
  // output = the reduction over the ranks of their sources[this rank]
  // (contiguous, one per rank).
  virtual Run reduce_scatter(std::vector<at::Tensor> sources, Dense output, Reduction kind) = 0;
  // targets[i] = the reduction over the ranks of this rank's piece of their
  // sources[i] (contiguous, every rank's piece in rank order along dim 1 of
  // [outer, p * n, inner]; targets[i] is [outer, n, inner]).
  virtual Run reduce_scatter_tensor(std::vector<at::Tensor> sources, std::vector<Dense> targets,
                                    std::vector<Reduction> kinds, int64_t dim, int64_t outer) = 0;
  // `in_rows` and `out_rows` are the split sizes as checked: the given ones,
  // or the even split where none were given.
  virtual Run all_to_all_single(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
                                std::vector<int64_t>& input_split_sizes, const std::vector<int64_t>& out_rows,
                                const std::vector<int64_t>& in_rows, const c10d::AllToAllOptions& opts) = 0;
  virtual Run all_to_all(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                         const c10d::AllToAllOptions& opts) = 0;
  // all_to_all_single of rows like `rows` through `pieces` (NOTE [all-to-all
  // by pieces] in <torch_tp/direct_collectives.h>), which must outlive the
  // Run; null where the implementation cannot (ranks on several nodes).
  virtual Run all_to_all_pieces(const at::Tensor& /*rows*/, const std::vector<int64_t>& /*send_rows*/,
                                const std::vector<int64_t>& /*recv_rows*/, AllToAllPieces& /*pieces*/) {
    return nullptr;
  }
};

// The group's ranks all on this node, which `transport` connects.
std::unique_ptr<Collectives> node_collectives(ShmTransport& transport, int rank, int size);

// The group's ranks on several nodes; `transport` connects this rank's node.
// `gloo_all` spans the group; `gloo_leaders` spans the first rank of each
// node, ordered by node, and is null except on those ranks.
std::unique_ptr<Collectives> multi_node_collectives(ShmTransport& transport, int rank, int size,
                                                    c10::intrusive_ptr<c10d::Backend> gloo_all,
                                                    c10::intrusive_ptr<c10d::Backend> gloo_leaders);

// The header a call on `t` publishes in its first transport step.
CallHeader make_header(uint64_t seq, OpCode op, const at::Tensor& t, int64_t numel, int64_t root = -1,
                       int64_t reduce = -1, int64_t dim = -1);

} // namespace torch_tp::backend
