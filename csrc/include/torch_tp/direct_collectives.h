#pragma once
// DirectCollectives: the synchronous collectives that torch_tp's ops call on
// a c10d::Backend which also implements this interface, instead of going
// through c10d's ProcessGroup methods. torch_tp's own "torch_tp" backend
// implements it; any backend may:
//
//   class MyBackend : public c10d::Backend, public torch_tp::DirectCollectives { ... };
//
// The ops find it with one dynamic_cast from the group's backend for the
// tensor's device; a backend that does not implement it is called through
// c10d as before.
//
// NOTE [direct calls from the ops]
// For a collective the op waits for at once (c10d's async_op=false), the ops
// call these instead of c10d's ProcessGroup methods. Each must be the
// backend's c10d call with async_op=False: the same checks, sequence
// numbers, order among the backend's other calls and algorithms, so the same
// results bitwise. What it saves is c10d's dispatcher round trip and the
// Work, and all_reduce_now writes a separate output, so the functional op
// needs no copy of its input first; at a few KiB those are a good part of
// what a call costs. Each returns once the collective is done and throws
// what it threw. Inputs and outputs are contiguous, of one dtype, on the
// device the backend serves the group on.
//   all_reduce_now:     output = input reduced with reduce_op over the group
//                       (output may be input). reduce_op is SUM, PRODUCT,
//                       MIN or MAX: the ops divide for avg themselves.
//   all_gather_now:     output [outer, p * n, inner] = the ranks' inputs
//                       [outer, n, inner] concatenated along dim 1 in rank order
//   reduce_scatter_now: output [outer, n, inner] = this rank's piece along
//                       dim 1 of the inputs [outer, p * n, inner], reduced
//                       with reduce_op
// The gathers and scatters are along dim 1 of these 3-d views so that a
// collective along a middle dim of the op's tensor ([b, s, h] along s, outer =
// b) lands in place: a backend that copies through its own buffers can copy
// each rank's piece to and from its `outer` runs directly, where c10d's
// dim-0 calls need a permuted copy before or after (NOTE [rank blocks
// without moving the dim to the front] in csrc/ops/comm.cpp). With outer = 1
// they are c10d's calls along dim 0.
// `dim` is the dim of the op's tensor the collective runs along: the calls
// of two ranks with equal shapes but different dims (all_gather(x, dim=rank)
// on a square x) mean different layouts. A backend that compares its calls
// across ranks should compare `dim` too, as it compares shapes; the torch_tp
// backend does, in its per-call header.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torch_tp {

// NOTE [all-to-all by pieces]
// An all-to-all of rows whose send and receive buffers need not exist as
// tensors: where the sender's rows are a gather of another tensor's rows (the
// token rows of moe_token_dispatch), or the receiver folds what it gets into
// a sum (the gradient of those rows), a backend that copies through its own
// buffers anyway can let the op write each piece straight into them and read
// each piece straight out, which saves the op a full pass over the rows and a
// fresh buffer on each side. pack(rank, offset, len, dst) writes bytes
// [offset, offset + len) of the piece this rank sends group rank `rank`;
// unpack(rank, offset, len, src) takes those bytes of the piece `rank` sent
// this rank. Each byte of each piece is packed and unpacked exactly once, a
// piece's ranges in increasing order, on the calling thread; offsets and
// lengths are whole elements of the rows' dtype, not whole rows.
// sent_piece(rank, len) and received_piece(rank, len) name a side that is a
// tensor's rows as they are (bytes [0, len) of the piece, as a 1-D uint8 view
// of that tensor), else undefined. A backend that copies through buffers of
// its own may ignore them; one that moves tensors sends from and receives
// into them directly, and then neither packs nor unpacks those bytes (the
// gloo path of csrc/ops/comm_pieces.cpp).
class AllToAllPieces {
 public:
  virtual ~AllToAllPieces() = default;
  virtual void pack(int64_t rank, size_t offset, size_t len, void* dst) = 0;
  virtual void unpack(int64_t rank, size_t offset, size_t len, const void* src) = 0;
  virtual at::Tensor sent_piece(int64_t /*rank*/, size_t /*len*/) {
    return {};
  }
  virtual at::Tensor received_piece(int64_t /*rank*/, size_t /*len*/) {
    return {};
  }
};

class DirectCollectives {
 public:
  virtual ~DirectCollectives() = default;

  virtual void all_reduce_now(const at::Tensor& input, const at::Tensor& output, const c10d::ReduceOp& reduce_op) = 0;
  virtual void all_gather_now(const at::Tensor& input, const at::Tensor& output, int64_t dim) = 0;
  virtual void reduce_scatter_now(const at::Tensor& input, const at::Tensor& output, const c10d::ReduceOp& reduce_op,
                                  int64_t dim) = 0;

  // all_to_all_pieces_now: all_to_all_single of send_rows[r] rows to each
  // rank r and recv_rows[r] rows from it, with `pieces` making and taking the
  // bytes (NOTE [all-to-all by pieces]). `rows` stands for the rows: its dtype
  // and its sizes after dim 0 are a row's; only its metadata is read. Returns
  // false, having done nothing, where the backend cannot (the op then makes
  // the buffers and calls all_to_all_single); the answer must be the same on
  // every rank of the group for the same rows.
  virtual bool all_to_all_pieces_now(const at::Tensor& /*rows*/, const std::vector<int64_t>& /*send_rows*/,
                                     const std::vector<int64_t>& /*recv_rows*/, AllToAllPieces& /*pieces*/) {
    return false;
  }

  // NOTE [async calls without a core to run on]
  // Whether a collective the ops start with async_op=True runs beside the
  // caller's compute. The ops start one and compute a GEMM before waiting
  // for it (NOTE [backward overlap] in csrc/ops/linear.cpp); a backend that
  // runs such calls on a worker thread overlaps them only where that thread
  // has a core to itself. Where it would share the rank's core, the handoff
  // is all it adds, and a backend may say false here: the ops then make the
  // call directly when they start it, and compute after it. The answer must
  // be the same on every rank of a group (the two ways are different calls).
  // The torch_tp backend says false on a node with fewer than two CPUs per
  // rank: with 2 ranks on 2 CPUs the example's training step (its output
  // projection's backward gathers and reduce-scatters this way) has a shorter
  // backward so (paired steps).
  virtual bool overlaps_async_calls() const {
    return true;
  }
};

} // namespace torch_tp
