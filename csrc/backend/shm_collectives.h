#pragma once
// The collectives among the ranks of one node, on raw contiguous buffers,
// over a ShmTransport. Each one is a sequence of transport steps whose count
// every rank derives from the header it checked in the first step, so a call
// of any size (including 0 elements) stays in lockstep across the ranks.
// `header` describes the call (op, seq, dtype, numel, root) and is checked
// across the ranks in the first step.
//
// NOTE [all-reduce algorithms]
// Up to kOneShotBytes (kOneShotBytesOversubscribed when the node's ranks
// outnumber its CPUs), all-reduce is one step: every rank copies its tensor
// into its slot and reduces all W slots itself (rank order), which costs one
// synchronisation. Above, it goes chunk by chunk, a slot at a time (the
// default 1 MiB slot keeps a chunk in cache from the copy-in to the copy-out
// while needing few synchronisations, which dominate when ranks share a
// core): step 1 copies the chunk in (all but this rank's portion) and each rank
// reduces its 1/W portion of it (reduce-scatter), writing the result to its
// next slot; step 2 every rank copies the other portions out (all-gather).
// Per byte a rank then reads W/W + 1 slots' worth instead of W, and the work
// of reducing is split across the ranks. Both fold ranks 0..W-1 in order
// with the same kernel, so the result is the same bitwise whichever path ran
// and whichever rank reduced an element.
//
// NOTE [all-reduce traffic]
// Large all-reduces are memory-bound, so the chunked path moves as few bytes
// as it can. Per byte of the tensor a rank copies into its slot only the
// (W-1)/W that other ranks reduce (its own portion is read from the tensor in
// place), reduces its 1/W reading W inputs and writing the tensor and the
// next slot (the second write reads a sub-block still in L1/L2), and copies
// (W-1)/W out: at W = 2 about 2 bytes read and 2 written per byte, where a
// memcpy moves 1 and 1, so half of memcpy's bandwidth is the ceiling.
// Reading the peers' tensors in place with process_vm_readv (Linux
// cross-memory attach) would cut that to 1.5 and 1, but the kernel's copy is
// slower than memcpy, and the in-place path ran slower than the chunked one;
// so the backend copies through the segments only.

#include "backend/reduce_kernels.h"
#include "backend/shm_transport.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>

namespace torch_tp::backend {

// The largest all-reduce done in one step (NOTE [all-reduce algorithms]).
// One step costs every rank a fold of all W tensors, two steps a second
// synchronisation: which is cheaper depends on what a cache line crossing
// cores costs on the CPU, and the crossover lies between 4 KiB and 128 KiB
// on the CPUs measured (benchmarks/RESULTS.md). Up to 64 KiB, so that a
// decode token's activations (a few KiB to tens of KiB) synchronise once;
// when the ranks outnumber the CPUs a synchronisation may cost a context
// switch, and one step is worth it up to 128 KiB.
constexpr size_t kOneShotBytes = 64 * 1024;
constexpr size_t kOneShotBytesOversubscribed = 128 * 1024;
// The granularity of the reduced portion's two writes (NOTE [all-reduce traffic]).
constexpr size_t kReduceSubBlockBytes = 32 * 1024;

// output[numel] = reduction over the local ranks of their input[numel].
// output may be input (in place).
void shm_all_reduce(ShmTransport& t, CallHeader header, const void* input, void* output, int64_t numel,
                    c10::ScalarType dtype, Reduction kind, int64_t avg_divisor);

// Every local rank's data[bytes] becomes root_local's.
void shm_broadcast(ShmTransport& t, CallHeader header, void* data, size_t bytes, int root_local);

// Where the bytes of one rank's piece lie in a buffer the ranks' pieces
// share: runs of `run` bytes, `stride` bytes apart, from the piece's first
// byte. A piece of x's rows [outer, c, inner] inside [outer, p * c, inner]
// (the ops' gathers and reduce-scatters along dim 1, NOTE [rank blocks
// without moving the dim to the front] in csrc/ops/comm.cpp) is `outer` runs
// of c * inner elements, p * c * inner apart. `contiguous` is one run.
struct PieceLayout {
  size_t run;
  size_t stride;
  static PieceLayout contiguous() {
    return {std::numeric_limits<size_t>::max(), 0};
  }
};

// outputs[r][bytes] = local rank r's input[bytes], each output laid out as `layout` says.
void shm_all_gather(ShmTransport& t, CallHeader header, const void* input, size_t bytes, void* const* outputs,
                    PieceLayout layout = PieceLayout::contiguous());

// output[numel] = reduction over the local ranks of their inputs[this rank][numel],
// each input laid out as `layout` says.
void shm_reduce_scatter(ShmTransport& t, CallHeader header, const void* const* inputs, void* output, int64_t numel,
                        c10::ScalarType dtype, Reduction kind, int64_t avg_divisor,
                        PieceLayout layout = PieceLayout::contiguous());

// outputs[r][recv_bytes[r]] = local rank r's inputs[this rank]. Sizes may be 0
// (gather and scatter are this with one non-empty side) and must agree pairwise.
// The pieces to peers go through the slots; this rank's own piece is copied
// straight to its output unless the two overlap.
void shm_all_to_all(ShmTransport& t, CallHeader header, const void* const* inputs, const size_t* send_bytes,
                    void* const* outputs, const size_t* recv_bytes);

// The same exchange with the copies into and out of the slots made by
// `copies` (NOTE [all-to-all by pieces] in <torch_tp/direct_collectives.h>):
// pack(r, offset, len, dst) writes bytes [offset, offset + len) of the piece
// for local rank r, unpack(r, offset, len, src) takes those of the piece from
// r, each piece's blocks in order. `copy_own`, where given, moves this rank's
// own piece by itself (once, while the peers read the first step); else that
// piece goes through the slot like the others.
struct AllToAllCopies {
  std::function<void(int r, size_t offset, size_t len, char* dst)> pack;
  std::function<void(int r, size_t offset, size_t len, const char* src)> unpack;
};
void shm_all_to_all(ShmTransport& t, CallHeader header, const size_t* send_bytes, const size_t* recv_bytes,
                    const AllToAllCopies& copies, const std::function<void()>& copy_own = nullptr);

void shm_barrier(ShmTransport& t, CallHeader header);

} // namespace torch_tp::backend
