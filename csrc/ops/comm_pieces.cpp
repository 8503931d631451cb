// all_to_all_pieces (ops/comm.h) on gloo, which moves tensors, not pieces.
//
// NOTE [all-to-all by pieces in messages]
// gloo's all_to_all_single takes one send buffer and one receive buffer
// holding all the rows. Where a side is a gather or a sum (NOTE [all-to-all
// by pieces] in <torch_tp/direct_collectives.h>), each such buffer costs a
// full pass over the rows and a fresh allocation ([T*K, H] slot rows: 32 MiB
// at Qwen3-30B-A3B's sizes, whose page faults cost about what the pass
// does), and this rank's own piece is copied once more inside gloo. Here the
// pieces go as gloo send/recv messages instead, each at most
// message_bytes() long:
// - a side that is a tensor's rows as they are (sent_piece, received_piece)
//   is sent from, or received into, where it lies, every message posted at
//   the start;
// - a side that packs or unpacks goes through a ring of kWindow message
//   buffers per peer, which stay in cache;
// - this rank's own piece never reaches gloo: it is packed straight into its
//   destination, or unpacked straight from its source, a message's worth at
//   each step, while the peers' messages are in flight.
// Both ends cut a piece of n bytes at the same multiples of message_bytes()
// (every rank must have the same TORCH_TP_GLOO_MESSAGE_BYTES), and gloo
// matches one peer's sends to our receives of one tag in posting order.
// The ringed sides run in steps j = 0, 1, ..: at step j this rank packs and
// sends message j to each peer (first waiting for the send of message j -
// kWindow, whose buffer it reuses), copies message j of its own piece, then
// waits for message j from each peer, unpacks it and posts the receive of
// message j + kWindow into the buffer it freed. Step j's first wait needs the
// peer's receive of message j - kWindow, which the peer posted at its step
// j - 2 kWindow or before its first; its second needs the peer's send of
// message j, which waits only on what this rank posted at its step j -
// 2 kWindow. So no two ranks ever wait on each other. A failure (a timeout,
// a dead peer) is thrown by the wait that sees it; the messages still posted
// hold their tensors' storage, so none outlives the memory it reads or writes.

#include "ops/comm.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

namespace torch_tp {
namespace {

// The tag of the exchange's messages: gloo keeps one queue per (peer, tag).
constexpr int kPiecesTag = 0x7470;
// Message buffers per peer on a ringed side: one filling while one is in flight.
constexpr int64_t kWindow = 2;

// TORCH_TP_GLOO_MESSAGE_BYTES, validated, or 1 MiB: a whole number of
// elements of every dtype (a multiple of 8), large enough that gloo's
// per-message cost is small against the copy, small enough that a peer's
// ring stays in the last-level cache.
size_t message_bytes() {
  static const size_t bytes = [] {
    const char* text = std::getenv("TORCH_TP_GLOO_MESSAGE_BYTES");
    if (text == nullptr || *text == '\0') {
      return size_t{1} << 20;
    }
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    TORCH_CHECK(*end == '\0' && value >= 8 && value % 8 == 0, "torch_tp: TORCH_TP_GLOO_MESSAGE_BYTES=", text,
                " must be a positive multiple of 8 (bytes)");
    return static_cast<size_t>(value);
  }();
  return bytes;
}

// A piece of `bytes` bytes cut into messages of `size`, the last one shorter.
struct Cuts {
  size_t bytes = 0;
  size_t size = 1;
  int64_t count() const {
    return static_cast<int64_t>((bytes + size - 1) / size);
  }
  size_t offset(int64_t j) const {
    return static_cast<size_t>(j) * size;
  }
  size_t length(int64_t j) const {
    return std::min(size, bytes - offset(j));
  }
};

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// gloo's send and recv rethrow gloo's own exceptions, not c10::Error: each
// becomes a DistBackendError (what gloo's collectives throw) naming the
// peer, so that all_to_all_pieces adds the op's context to it.
template <typename Call>
auto naming_the_peer(bool send, int64_t peer, Call&& call) {
  try {
    return call();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, c10::str(send ? "send to" : "receive from", " rank ", peer, ": ", e.what()));
  }
}

WorkPtr post(c10d::ProcessGroup& group, bool send, int64_t peer, const at::Tensor& bytes) {
  std::vector<at::Tensor> tensors{bytes};
  const int rank = static_cast<int>(peer);
  return naming_the_peer(send, peer, [&] {
    return send ? group.send(tensors, rank, kPiecesTag) : group.recv(tensors, rank, kPiecesTag);
  });
}

void wait(const WorkPtr& work, bool send, int64_t peer) {
  naming_the_peer(send, peer, [&] { return work->wait(); });
}

} // namespace

void all_to_all_pieces_in_messages(c10d::ProcessGroup& group, const at::Tensor& rows,
                                   const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                                   AllToAllPieces& pieces) {
  const int64_t world_size = group.getSize();
  const int64_t me = group.getRank();
  const size_t row_bytes = rows.element_size() * static_cast<size_t>(c10::multiply_integers(rows.sizes().slice(1)));
  const size_t size = message_bytes();
  std::vector<Cuts> out(world_size), in(world_size);
  std::vector<at::Tensor> sent(world_size), received(world_size);
  bool ring_out = false;
  bool ring_in = false;
  int64_t steps = 0;
  for (const auto r : c10::irange(world_size)) {
    out[r] = {static_cast<size_t>(send_rows[r]) * row_bytes, size};
    in[r] = {static_cast<size_t>(recv_rows[r]) * row_bytes, size};
    sent[r] = pieces.sent_piece(r, out[r].bytes);
    received[r] = pieces.received_piece(r, in[r].bytes);
    if (r != me) {
      ring_out = ring_out || (!sent[r].defined() && out[r].bytes > 0);
      ring_in = ring_in || (!received[r].defined() && in[r].bytes > 0);
    }
    steps = std::max({steps, out[r].count(), in[r].count()});
  }
  TORCH_INTERNAL_ASSERT(out[me].bytes == in[me].bytes, "the rows this rank sends itself are the rows it receives");
  const bool own_through_buffer = !sent[me].defined() && !received[me].defined();
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  const at::Tensor out_ring =
      ring_out || own_through_buffer ? at::empty({world_size * kWindow * static_cast<int64_t>(size)}, bytes) : at::Tensor();
  const at::Tensor in_ring = ring_in ? at::empty({world_size * kWindow * static_cast<int64_t>(size)}, bytes) : at::Tensor();
  // Message j's buffer of peer r's ring.
  auto buffer = [&](const at::Tensor& ring, int64_t r, int64_t j, size_t len) {
    return ring.narrow(0, (r * kWindow + j % kWindow) * static_cast<int64_t>(size), static_cast<int64_t>(len));
  };
  auto part = [](const at::Tensor& piece, const Cuts& cuts, int64_t j) {
    return piece.narrow(0, static_cast<int64_t>(cuts.offset(j)), static_cast<int64_t>(cuts.length(j)));
  };

  struct Posted {
    WorkPtr work;
    bool send;
    int64_t peer;
  };
  std::vector<Posted> posted;  // the sides that are tensors: waited at the end
  std::vector<WorkPtr> out_slots(world_size * kWindow), in_slots(world_size * kWindow);
  for (const auto r : c10::irange(world_size)) {
    if (r == me) {
      continue;
    }
    if (received[r].defined()) {
      for (const auto j : c10::irange(in[r].count())) {
        posted.push_back({post(group, false, r, part(received[r], in[r], j)), false, r});
      }
    } else {
      for (const auto j : c10::irange(std::min(kWindow, in[r].count()))) {
        in_slots[r * kWindow + j] = post(group, false, r, buffer(in_ring, r, j, in[r].length(j)));
      }
    }
    if (sent[r].defined()) {
      for (const auto j : c10::irange(out[r].count())) {
        posted.push_back({post(group, true, r, part(sent[r], out[r], j)), true, r});
      }
    }
  }

  for (const auto j : c10::irange(steps)) {
    for (const auto r : c10::irange(world_size)) {
      if (r == me || sent[r].defined() || j >= out[r].count()) {
        continue;
      }
      WorkPtr& slot = out_slots[r * kWindow + j % kWindow];
      if (slot) {
        wait(slot, true, r);
      }
      at::Tensor message = buffer(out_ring, r, j, out[r].length(j));
      pieces.pack(r, out[r].offset(j), out[r].length(j), message.mutable_data_ptr());
      slot = post(group, true, r, message);
    }
    if (j < in[me].count()) {
      const size_t offset = in[me].offset(j);
      const size_t len = in[me].length(j);
      char* to = received[me].defined() ? static_cast<char*>(received[me].mutable_data_ptr()) + offset : nullptr;
      const char* from = sent[me].defined() ? static_cast<const char*>(sent[me].const_data_ptr()) + offset : nullptr;
      if (to != nullptr && from != nullptr) {
        std::memcpy(to, from, len);
      } else if (to != nullptr) {
        pieces.pack(me, offset, len, to);
      } else if (from != nullptr) {
        pieces.unpack(me, offset, len, from);
      } else {
        at::Tensor message = buffer(out_ring, me, 0, len);
        pieces.pack(me, offset, len, message.mutable_data_ptr());
        pieces.unpack(me, offset, len, message.const_data_ptr());
      }
    }
    for (const auto r : c10::irange(world_size)) {
      if (r == me || received[r].defined() || j >= in[r].count()) {
        continue;
      }
      WorkPtr& slot = in_slots[r * kWindow + j % kWindow];
      wait(slot, false, r);
      pieces.unpack(r, in[r].offset(j), in[r].length(j), buffer(in_ring, r, j, in[r].length(j)).const_data_ptr());
      const int64_t next = j + kWindow;
      slot = next < in[r].count() ? post(group, false, r, buffer(in_ring, r, next, in[r].length(next))) : WorkPtr();
    }
  }
  for (const auto r : c10::irange(world_size)) {
    for (const auto i : c10::irange(kWindow)) {
      if (const WorkPtr& slot = out_slots[r * kWindow + i]) {
        wait(slot, true, r);
      }
    }
  }
  for (const auto& [work, send, peer] : posted) {
    wait(work, send, peer);
  }
}

} // namespace torch_tp
