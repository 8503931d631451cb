#include "backend/shm_collectives.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace torch_tp::backend {
namespace {

constexpr size_t kLine = 64;

// memcpy that accepts the null data pointer of an empty tensor.
void copy_bytes(void* dst, const void* src, size_t len) {
  if (len > 0) {
    std::memcpy(dst, src, len);
  }
}

// Bytes [offset, offset + len) of a piece laid out as `layout`, to or from a
// flat buffer: one memcpy per run they touch.
template <typename Copy>
void for_each_run(PieceLayout layout, size_t offset, size_t len, Copy&& copy) {
  size_t done = 0;
  while (done < len) {
    const size_t at = offset + done;
    const size_t within = at % layout.run;
    const size_t n = std::min(len - done, layout.run - within);
    copy(at / layout.run * layout.stride + within, done, n);
    done += n;
  }
}

void copy_into_piece(char* piece, PieceLayout layout, size_t offset, const char* src, size_t len) {
  for_each_run(layout, offset, len, [&](size_t to, size_t from, size_t n) { copy_bytes(piece + to, src + from, n); });
}

void copy_from_piece(char* dst, const char* piece, PieceLayout layout, size_t offset, size_t len) {
  for_each_run(layout, offset, len, [&](size_t from, size_t to, size_t n) { copy_bytes(dst + to, piece + from, n); });
}

size_t ceil_div(size_t a, size_t b) {
  return (a + b - 1) / b;
}

const char* name_of(const CallHeader& header) {
  return op_code_name(static_cast<OpCode>(header.op));
}

// [lo, hi) of `count` items that local rank `rank` of `n` owns: pieces of a
// whole number of cache lines, so that no two ranks write one line.
struct Span {
  size_t lo, hi;
};
Span portion(size_t count, size_t item_bytes, int n, int rank) {
  const size_t per_line = std::max<size_t>(1, kLine / item_bytes);
  const size_t piece = ceil_div(ceil_div(count, static_cast<size_t>(n)), per_line) * per_line;
  const size_t lo = std::min(count, piece * static_cast<size_t>(rank));
  return {lo, std::min(count, lo + piece)};
}

// The bytes a piece of `bytes` laid out as `layout` spans, from its first byte.
size_t piece_extent(size_t bytes, PieceLayout layout) {
  return layout.run >= bytes ? bytes : (ceil_div(bytes, layout.run) - 1) * layout.stride + layout.run;
}

// Whether a reduce-scatter's output overlaps any rank's piece of its input
// other than exactly in place (NCCL's in-place reduce-scatter: the output is
// this rank's own contiguous piece, which each fold reads before it writes).
// NCCL leaves such overlaps undefined; here they would change input that a
// later block still copies or reads.
bool output_overlaps_input(const void* const* inputs, int n, int me, const void* output, size_t bytes,
                           PieceLayout layout) {
  const auto out = reinterpret_cast<uintptr_t>(output);
  const size_t extent = piece_extent(bytes, layout);
  for (const auto r : c10::irange(n)) {
    const auto in = reinterpret_cast<uintptr_t>(inputs[r]);
    const bool in_place = r == me && layout.run >= bytes && in == out;
    if (!in_place && out < in + extent && in < out + bytes) {
      return true;
    }
  }
  return false;
}

} // namespace

void shm_all_reduce(ShmTransport& t, CallHeader header, const void* input, void* output, int64_t numel,
                    c10::ScalarType dtype, Reduction kind, int64_t avg_divisor) {
  const char* op = name_of(header);
  const int n = t.local_size();
  const int me = t.local_rank();
  const size_t item = c10::elementSize(dtype);
  const size_t total = static_cast<size_t>(numel) * item;
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  std::vector<const void*> inputs(n);

  const size_t one_shot_bytes = t.ranks_outnumber_cpus() ? kOneShotBytesOversubscribed : kOneShotBytes;
  if (total <= std::min(one_shot_bytes, t.slot_bytes())) {
    const uint64_t step = t.next_step();
    copy_bytes(t.my_slot(step), in, total);
    t.arrive(op, &header);
    for (const auto r : c10::irange(n)) {
      inputs[r] = t.peer_slot(r, step);
    }
    reduce_inputs(kind, dtype, out, inputs.data(), n, numel, avg_divisor);
    return;
  }

  const size_t chunk_items = std::max<size_t>(1, t.slot_bytes() / item);
  const size_t count = static_cast<size_t>(numel);
  // The reduced portion goes to the output and to the next slot a sub-block
  // at a time, so the second copy reads it from L1/L2 (NOTE [all-reduce traffic]).
  const size_t sub_items = std::max<size_t>(1, kReduceSubBlockBytes / item);
  bool first = true;
  for (size_t base = 0; base < count; base += chunk_items) {
    const size_t len = std::min(chunk_items, count - base);
    const char* chunk_in = in + base * item;
    char* chunk_out = out + base * item;
    const Span mine = portion(len, item, n, me);
    // Step 1: copy in the portions the other ranks reduce (this rank's own
    // portion is read from the input itself); reduce this rank's portion
    // into the output and into the next slot.
    const uint64_t in_step = t.next_step();
    copy_bytes(t.my_slot(in_step), chunk_in, mine.lo * item);
    copy_bytes(t.my_slot(in_step) + mine.hi * item, chunk_in + mine.hi * item, (len - mine.hi) * item);
    t.arrive(op, first ? &header : nullptr);
    first = false;
    const uint64_t out_step = t.next_step();
    for (size_t lo = mine.lo; lo < mine.hi; lo += sub_items) {
      const size_t sub = std::min(sub_items, mine.hi - lo);
      for (const auto r : c10::irange(n)) {
        inputs[r] = r == me ? chunk_in + lo * item : t.peer_slot(r, in_step) + lo * item;
      }
      // In place when output is input: fold reads a block before it writes it.
      reduce_inputs(kind, dtype, chunk_out + lo * item, inputs.data(), n, static_cast<int64_t>(sub), avg_divisor);
      copy_bytes(t.my_slot(out_step) + lo * item, chunk_out + lo * item, sub * item);
    }
    // Step 2: copy the other ranks' reduced portions out.
    t.arrive(op);
    for (const auto r : c10::irange(n)) {
      if (r != me) {
        const Span theirs = portion(len, item, n, r);
        copy_bytes(chunk_out + theirs.lo * item, t.peer_slot(r, out_step) + theirs.lo * item,
                    (theirs.hi - theirs.lo) * item);
      }
    }
  }
}

void shm_broadcast(ShmTransport& t, CallHeader header, void* data, size_t bytes, int root_local) {
  const char* op = name_of(header);
  const size_t chunk = t.slot_bytes();
  const bool root = t.local_rank() == root_local;
  auto* out = static_cast<char*>(data);
  size_t base = 0;
  do {
    const size_t len = std::min(chunk, bytes - base);
    const uint64_t step = t.next_step();
    if (root) {
      copy_bytes(t.my_slot(step), out + base, len);
    }
    t.arrive(op, base == 0 ? &header : nullptr);
    if (!root) {
      copy_bytes(out + base, t.peer_slot(root_local, step), len);
    }
    base += len;
  } while (base < bytes);
}

void shm_all_gather(ShmTransport& t, CallHeader header, const void* input, size_t bytes, void* const* outputs,
                    PieceLayout layout) {
  const char* op = name_of(header);
  const int n = t.local_size();
  const size_t chunk = t.slot_bytes();
  const auto* in = static_cast<const char*>(input);
  size_t base = 0;
  do {
    const size_t len = std::min(chunk, bytes - base);
    const uint64_t step = t.next_step();
    copy_bytes(t.my_slot(step), in + base, len);
    t.arrive(op, base == 0 ? &header : nullptr);
    for (const auto r : c10::irange(n)) {
      copy_into_piece(static_cast<char*>(outputs[r]), layout, base, t.peer_slot(r, step), len);
    }
    base += len;
  } while (base < bytes);
}

void shm_reduce_scatter(ShmTransport& t, CallHeader header, const void* const* inputs, void* output, int64_t numel,
                        c10::ScalarType dtype, Reduction kind, int64_t avg_divisor, PieceLayout layout) {
  const char* op = name_of(header);
  const int n = t.local_size();
  const int me = t.local_rank();
  const size_t item = c10::elementSize(dtype);
  // The slot holds one block per destination rank, each a whole number of lines.
  const size_t block_bytes = t.slot_bytes() / static_cast<size_t>(n) / kLine * kLine;
  const size_t block_items = std::max<size_t>(1, block_bytes / item);
  TORCH_CHECK(block_items * item <= block_bytes, "torch_tp backend: ", op, ": the shared buffer of ",
              t.slot_bytes(), " bytes per slot is too small for ", n, " ranks of ", item, "-byte elements");
  const size_t count = static_cast<size_t>(numel);
  std::vector<char> scratch;
  auto* out = static_cast<char*>(output);
  if (output_overlaps_input(inputs, n, me, output, count * item, layout)) {
    scratch.resize(count * item);
    out = scratch.data();
  }
  // This rank's own piece is folded where it lies in its input, not copied
  // through its own slot first (which only this rank reads): 1/p of the input
  // not copied, 128 KiB a call at the example's [4, 64, 256] float32 over 2
  // ranks. Not when its runs are short: a fold call per run would cost more
  // than the copy.
  constexpr size_t kMinDirectRunBytes = 1024;
  const auto* own = static_cast<const char*>(inputs[me]);
  const bool own_direct = layout.run >= kMinDirectRunBytes;
  std::vector<const void*> sources(n);
  size_t base = 0;
  do {
    const size_t len = std::min(block_items, count - base);
    const uint64_t step = t.next_step();
    char* slot = t.my_slot(step);
    for (const auto r : c10::irange(n)) {
      if (r != me || !own_direct) {
        copy_from_piece(slot + r * block_bytes, static_cast<const char*>(inputs[r]), layout, base * item, len * item);
      }
    }
    t.arrive(op, base == 0 ? &header : nullptr);
    for (const auto r : c10::irange(n)) {
      sources[r] = t.peer_slot(r, step) + me * block_bytes;
    }
    if (!own_direct) {
      reduce_inputs(kind, dtype, out + base * item, sources.data(), n, static_cast<int64_t>(len), avg_divisor);
    } else {
      // One fold per run of this rank's own piece, read where it lies; the
      // others' blocks are flat in their slots, `done` bytes in.
      for_each_run(layout, base * item, len * item, [&](size_t at, size_t done, size_t bytes) {
        sources[me] = own + at;
        for (const auto r : c10::irange(n)) {
          if (r != me) {
            sources[r] = t.peer_slot(r, step) + me * block_bytes + done;
          }
        }
        reduce_inputs(kind, dtype, out + base * item + done, sources.data(), n, static_cast<int64_t>(bytes / item),
                      avg_divisor);
      });
    }
    base += len;
  } while (base < count);
  if (!scratch.empty()) {
    std::memcpy(output, scratch.data(), scratch.size());
  }
}

void shm_all_to_all(ShmTransport& t, CallHeader header, const size_t* send_bytes, const size_t* recv_bytes,
                    const AllToAllCopies& copies, const std::function<void()>& copy_own) {
  const char* op = name_of(header);
  const int n = t.local_size();
  const int me = t.local_rank();
  const size_t block = t.slot_bytes() / static_cast<size_t>(n) / kLine * kLine;
  TORCH_CHECK(block > 0, "torch_tp backend: ", op, ": the shared buffer of ", t.slot_bytes(),
              " bytes per slot is too small for ", n, " ranks");
  const bool own_direct = static_cast<bool>(copy_own);
  // Every rank needs as many steps as the largest piece any rank sends
  // through the slots: each contributes its own need through the header's
  // `extra`, read in step 1.
  size_t need = 1;
  for (const auto r : c10::irange(n)) {
    if (r != me || !own_direct) {
      need = std::max({need, ceil_div(send_bytes[r], block), ceil_div(recv_bytes[r], block)});
    }
  }
  header.extra = static_cast<int64_t>(need);
  size_t steps = 1;
  for (size_t s = 0; s < steps; ++s) {
    const size_t base = s * block;
    const uint64_t step = t.next_step();
    char* slot = t.my_slot(step);
    for (const auto r : c10::irange(n)) {
      if (send_bytes[r] > base && (r != me || !own_direct)) {
        copies.pack(r, base, std::min(block, send_bytes[r] - base), slot + r * block);
      }
    }
    t.arrive(op, s == 0 ? &header : nullptr);
    if (s == 0) {
      for (const auto r : c10::irange(n)) {
        steps = std::max(steps, static_cast<size_t>(t.peer_header(r, step).extra));
      }
      if (own_direct) {  // while the peers read this rank's slot
        copy_own();
      }
    }
    for (const auto r : c10::irange(n)) {
      if (recv_bytes[r] > base && (r != me || !own_direct)) {
        copies.unpack(r, base, std::min(block, recv_bytes[r] - base), t.peer_slot(r, step) + me * block);
      }
    }
  }
}

void shm_all_to_all(ShmTransport& t, CallHeader header, const void* const* inputs, const size_t* send_bytes,
                    void* const* outputs, const size_t* recv_bytes) {
  // This rank's own piece goes straight from its input to its output, one
  // copy where the slot would take two, unless the two overlap (a copy
  // through the slot keeps the input's bytes until they are read).
  const int me = t.local_rank();
  const auto* own_in = static_cast<const char*>(inputs[me]);
  auto* own_out = static_cast<char*>(outputs[me]);
  const size_t own = send_bytes[me];
  const bool own_direct =
      own == recv_bytes[me] && (own == 0 || own_in + own <= own_out || own_out + own <= own_in);
  const AllToAllCopies copies{
      [&](int r, size_t offset, size_t len, char* dst) {
        copy_bytes(dst, static_cast<const char*>(inputs[r]) + offset, len);
      },
      [&](int r, size_t offset, size_t len, const char* src) {
        copy_bytes(static_cast<char*>(outputs[r]) + offset, src, len);
      }};
  shm_all_to_all(t, header, send_bytes, recv_bytes, copies,
                 own_direct ? std::function<void()>([&] { copy_bytes(own_out, own_in, own); }) : nullptr);
}

void shm_barrier(ShmTransport& t, CallHeader header) {
  t.arrive(name_of(header), &header);
}

} // namespace torch_tp::backend
