#pragma once
// Collectives on any c10d process group in torch_tp's layout: along any dim,
// with torch.chunk-sized pieces, started now and finished later. The collective
// ops (collectives.cpp) start and immediately wait; the linear backward kernels
// start one, compute a GEMM while it runs, then wait (Megatron's overlap).
//
// NOTE [torch.chunk shards]
// A dim of n rows is split over p ranks as torch.chunk(n, p) splits it, which
// is DTensor's Shard(dim): every piece has c = ceil(n / p) rows except the
// last non-empty one; later ranks may get none. Rank r holds rows
// [r*c, min((r+1)*c, n)). Collectives move such pieces as p blocks of c rows,
// zero-padding the short ones: the valid rows of the gathered [p*c] tensor are
// then exactly its first n rows, since every padded block comes after all full ones.
// chunk_rows, chunk_range and gathered_size below are this rule's only C++
// statement: on int64_t in the kernels, on c10::SymInt in the Meta kernels
// (symbolic sizes under torch.compile).

#include "ops/common.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch_tp/direct_collectives.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <vector>

namespace torch_tp {

// std::min for the two integer types of the shard arithmetic.
inline int64_t min_of(int64_t a, int64_t b) {
  return std::min(a, b);
}
inline c10::SymInt min_of(const c10::SymInt& a, const c10::SymInt& b) {
  return a.min(b);
}

// c = ceil(n / p): the rows of every piece but the last non-empty one, and
// the rows of each block the collectives move.
template <typename Int>
Int chunk_rows(const Int& n, int64_t world_size) {
  return (n + (world_size - 1)) / world_size;
}

// Rank `rank`'s rows [start, start + length) of n rows split as torch.chunk splits them.
template <typename Int>
struct ChunkRange {
  Int start;
  Int length;
};

template <typename Int>
ChunkRange<Int> chunk_range(const Int& n, int64_t world_size, int64_t rank) {
  const Int chunk = chunk_rows(n, world_size);
  const Int start = min_of(chunk * rank, n);
  return {start, min_of(chunk, n - start)};
}

// The length along `dim` of the ranks' pieces gathered, this rank's piece
// having `local` rows: full_size, after checking that `local` is this rank's
// torch.chunk piece of it, or p * local without it (every piece the same
// size). A symbolic `local` (a Meta kernel under torch.compile) is checked
// when the kernel runs. Instantiated for int64_t and c10::SymInt.
template <typename Int>
Int gathered_size(const char* op, const Int& local, int64_t dim, std::optional<int64_t> full_size,
                  int64_t world_size, int64_t rank);

// A collective in flight. wait() blocks until it completed and returns the
// result in its final layout; a backend failure is rethrown with the op, the
// group and the tensor named. Destroying it unwaited waits (errors dropped),
// so no collective outlives the buffers it writes.
class PendingCollective {
 public:
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish, const char* op,
                    c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor input);
  PendingCollective(PendingCollective&&) = default;
  PendingCollective& operator=(PendingCollective&&) = default;
  ~PendingCollective();

  at::Tensor wait();

 private:
  c10::intrusive_ptr<c10d::Work> work_;  // null when there was nothing to send
  std::function<at::Tensor()> finish_;
  const char* op_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Tensor input_;  // for the error message only
};

// NOTE [async_op of the start functions]
// `async_op` is c10d's: false when the caller waits at once, true when it
// computes while the collective runs (the linear backward). It is a hint:
// every backend completes the call either way, but a synchronous call may run
// on the caller's thread (the torch_tp backend's NOTE [synchronous calls run
// inline]; NCCL's on the current stream), which at small sizes saves two
// thread hand-offs, more than the collective itself takes.

// output = input reduced over the group; both contiguous, of one dtype and
// shape. output may be input (in place); a separate output saves the torch_tp
// backend a copy (NOTE [direct calls from the ops]).
PendingCollective start_all_reduce(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& input, at::Tensor output, Reduction reduction);

// Concatenates the ranks' pieces of x along `dim` (already wrapped). Without
// `full_size` every rank's piece has x's size; with it, the pieces are the
// torch.chunk pieces of full_size rows and x must hold this rank's.
// `dim_arg` is the op's name for dim, for NOTE [cross-rank argument check].
PendingCollective start_all_gather(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& x, int64_t dim, std::optional<int64_t> full_size,
                                   const char* dim_arg = "dim");

// Reduces x over the group and keeps this rank's torch.chunk piece along `dim`.
PendingCollective start_reduce_scatter(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                       bool async_op, const at::Tensor& x, int64_t dim, Reduction reduction,
                                       const char* dim_arg = "dim");

// Rows of dim 0 exchanged unevenly (c10d's all_to_all_single with split
// sizes): x [sum(input_splits), rest..] -> [sum(output_splits), rest..]; rank r
// receives input_splits[r] rows from each rank and output_splits[s] from rank
// s. Both split vectors have world_size entries; empty splits are fine.
PendingCollective start_all_to_all(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& x, std::vector<int64_t> output_splits,
                                   std::vector<int64_t> input_splits);

// The all-to-all of start_all_to_all's rows with each piece made and taken
// through `pieces` (NOTE [all-to-all by pieces] in
// <torch_tp/direct_collectives.h>): by the group's backend where it has such
// a call, as gloo messages for CPU rows on gloo (NOTE [all-to-all by pieces
// in messages] in comm_pieces.cpp). `rows` stands for the rows (dtype, row
// shape, device). Returns false, having done nothing, everywhere else; the
// caller then exchanges real buffers.
bool all_to_all_pieces(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& rows,
                       const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                       AllToAllPieces& pieces);

// all_to_all_pieces' gloo path (comm_pieces.cpp), on CPU rows.
void all_to_all_pieces_in_messages(c10d::ProcessGroup& group, const at::Tensor& rows,
                                   const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                                   AllToAllPieces& pieces);

// NOTE [cross-rank argument check]
// A collective only sees bytes: all_gather(x, dim=rank), or an all-reduce of
// [2, 3] on one rank and [3, 2] on another, moves the same number of
// elements and returns a different, wrong answer on each rank, on any
// backend. With TORCH_DISTRIBUTED_DEBUG=DETAIL (c10d's own switch, read once
// when torch.distributed is imported, or dist.set_debug_level), every torch_tp
// collective first all-gathers a small description of the call (op, reduce_op,
// dim, full_size, x's shape; the size along dim is left out where the pieces
// may differ) and raises on every rank, naming the op, the argument and each
// rank's value, when they differ. One extra small all-gather per collective:
// a debugging aid, off by default. The torch_tp backend compares shapes, and
// the dim of the ops' direct calls, in its per-call header always (NOTE [the
// ops' dim in the call header] in shm_transport.h).
bool cross_rank_checks_enabled();
void check_same_across_ranks(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const at::Tensor& x, std::optional<Reduction> reduction, std::optional<int64_t> dim,
                             std::optional<int64_t> full_size, const char* dim_arg);

} // namespace torch_tp
