// The collectives of a group whose ranks all share one node: each one is an
// algorithm of shm_collectives.h (whose NOTEs explain them) on the node's
// ShmTransport, run on dense tensors. Group ranks are the transport's local
// ranks here.

#include "backend/collectives.h"
#include "backend/shm_collectives.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

namespace torch_tp::backend {

CallHeader make_header(uint64_t seq, OpCode op, const at::Tensor& t, int64_t numel, int64_t root, int64_t reduce,
                       int64_t dim) {
  CallHeader header;
  header.seq = seq;
  header.op = static_cast<int32_t>(op);
  header.dtype = static_cast<int32_t>(t.scalar_type());
  header.numel = numel;
  header.root = root;
  header.reduce = reduce;
  header.dim = dim;
  if (numel >= 0) {
    header.set_shape(t.sizes());
  }
  return header;
}

namespace {

// One rank's piece of `piece_bytes` along dim 1 of [outer, p * n, inner]: it
// starts piece_bytes / outer bytes after the previous rank's and is `outer`
// runs of that length, p times as far apart. With outer = 1 it is one run.
size_t first_run_offset(size_t piece_bytes, int64_t outer) {
  return outer > 0 ? piece_bytes / static_cast<size_t>(outer) : 0;
}

PieceLayout piece_layout(size_t piece_bytes, int64_t outer, int size) {
  const size_t run = first_run_offset(piece_bytes, outer);
  if (outer <= 1 || run == 0) {
    return PieceLayout::contiguous();
  }
  return {run, run * static_cast<size_t>(size)};
}

// The chunk of an all-to-all's own piece that goes through a private buffer
// (all_to_all_pieces): whole 64-byte lines, so every offset is whole
// elements, and small enough to stay in L2 between its pack and its unpack.
constexpr size_t kOwnPieceChunkBytes = 64 * 1024;

class NodeCollectives final : public Collectives {
 public:
  NodeCollectives(ShmTransport& transport, int rank, int size) : transport_(transport), rank_(rank), size_(size) {}

  Run all_reduce(std::vector<Dense> dense, std::vector<Reduction> kinds) override {
    const int size = size_;
    auto* transport = &transport_;
    return [=](uint64_t seq) {
      for (const auto i : c10::irange(dense.size())) {
        const at::Tensor& t = dense[i].work;
        const CallHeader header =
            make_header(seq, OpCode::AllReduce, t, t.numel(), -1, static_cast<int64_t>(kinds[i]));
        shm_all_reduce(*transport, header, t.data_ptr(), t.data_ptr(), t.numel(), t.scalar_type(), kinds[i], size);
        dense[i].finish();
      }
    };
  }

  Run all_reduce_into(at::Tensor input, at::Tensor output, Reduction kind) override {
    const int size = size_;
    auto* transport = &transport_;
    return [=](uint64_t seq) {
      const CallHeader header =
          make_header(seq, OpCode::AllReduce, input, input.numel(), -1, static_cast<int64_t>(kind));
      shm_all_reduce(*transport, header, input.data_ptr(), output.data_ptr(), input.numel(), input.scalar_type(),
                     kind, size);
    };
  }

  Run reduce(Dense dense, at::Tensor scratch, Reduction kind, int64_t root_rank) override {
    const bool root = rank_ == root_rank;
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      const CallHeader header =
          make_header(seq, OpCode::Reduce, scratch, scratch.numel(), root_rank, static_cast<int64_t>(kind));
      shm_all_reduce(*transport, header, scratch.data_ptr(), scratch.data_ptr(), scratch.numel(), scratch.scalar_type(),
                     kind, size);
      if (root) {
        dense.finish();
      }
    };
  }

  Run broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    Dense dense(tensors[0]);
    auto* transport = &transport_;
    const int64_t root = opts.rootRank;
    return [=](uint64_t seq) {
      const at::Tensor& t = dense.work;
      shm_broadcast(*transport, make_header(seq, OpCode::Broadcast, t, t.numel(), root), t.data_ptr(), t.nbytes(),
                    static_cast<int>(root));
      dense.finish();
    };
  }

  Run barrier() override {
    auto* transport = &transport_;
    return [=](uint64_t seq) {
      CallHeader header;
      header.seq = seq;
      header.op = static_cast<int32_t>(OpCode::Barrier);
      shm_barrier(*transport, header);
    };
  }

  Run all_gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::AllgatherOptions&) override {
    const at::Tensor input = inputs[0].contiguous();
    std::vector<Dense> dense(outputs[0].begin(), outputs[0].end());
    auto* transport = &transport_;
    return [=](uint64_t seq) {
      std::vector<void*> targets;
      for (const auto& d : dense) {
        targets.push_back(d.work.data_ptr());
      }
      shm_all_gather(*transport, make_header(seq, OpCode::AllGather, input, input.numel()), input.data_ptr(),
                     input.nbytes(), targets.data());
      for (const auto& d : dense) {
        d.finish();
      }
    };
  }

  Run all_gather_into_tensor(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::AllgatherOptions&, int64_t dim, int64_t outer) override {
    std::vector<at::Tensor> dense_inputs;
    std::vector<Dense> dense_outputs;
    for (const auto i : c10::irange(inputs.size())) {
      dense_inputs.push_back(inputs[i].contiguous());
      dense_outputs.emplace_back(outputs[i]);
    }
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      for (const auto i : c10::irange(dense_inputs.size())) {
        const at::Tensor& in = dense_inputs[i];
        auto* base = static_cast<char*>(dense_outputs[i].work.data_ptr());
        const PieceLayout layout = piece_layout(in.nbytes(), outer, size);
        std::vector<void*> targets;
        for (const auto r : c10::irange(size)) {
          targets.push_back(base == nullptr ? nullptr : base + r * first_run_offset(in.nbytes(), outer));
        }
        shm_all_gather(*transport, make_header(seq, OpCode::AllGather, in, in.numel(), -1, -1, dim), in.data_ptr(),
                       in.nbytes(), targets.data(), layout);
        dense_outputs[i].finish();
      }
    };
  }

  Run gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
             const c10d::GatherOptions& opts) override {
    const at::Tensor input = inputs[0].contiguous();
    const std::vector<at::Tensor> result = rank_ == opts.rootRank ? outputs[0] : std::vector<at::Tensor>{};
    std::vector<Dense> dense(result.begin(), result.end());
    auto* transport = &transport_;
    const int size = size_;
    const int64_t root_rank = opts.rootRank;
    return [=](uint64_t seq) {
      std::vector<const void*> send(size, nullptr);
      std::vector<size_t> send_bytes(size, 0);
      std::vector<void*> recv(size, nullptr);
      std::vector<size_t> recv_bytes(size, 0);
      send[root_rank] = input.data_ptr();
      send_bytes[root_rank] = input.nbytes();
      for (const auto r : c10::irange(dense.size())) {
        recv[r] = dense[r].work.data_ptr();
        recv_bytes[r] = input.nbytes();
      }
      shm_all_to_all(*transport, make_header(seq, OpCode::Gather, input, input.numel(), root_rank), send.data(),
                     send_bytes.data(), recv.data(), recv_bytes.data());
      for (const auto& d : dense) {
        d.finish();
      }
    };
  }

  Run scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
              const c10d::ScatterOptions& opts) override {
    std::vector<at::Tensor> sources;
    if (rank_ == opts.rootRank) {
      for (const auto& in : inputs[0]) {
        sources.push_back(in.contiguous());
      }
    }
    Dense dense(outputs[0]);
    auto* transport = &transport_;
    const int size = size_;
    const int64_t root_rank = opts.rootRank;
    return [=](uint64_t seq) {
      const at::Tensor& out = dense.work;
      std::vector<const void*> send(size, nullptr);
      std::vector<size_t> send_bytes(size, 0);
      std::vector<void*> recv(size, nullptr);
      std::vector<size_t> recv_bytes(size, 0);
      for (const auto r : c10::irange(sources.size())) {
        send[r] = sources[r].data_ptr();
        send_bytes[r] = out.nbytes();
      }
      recv[root_rank] = out.data_ptr();
      recv_bytes[root_rank] = out.nbytes();
      shm_all_to_all(*transport, make_header(seq, OpCode::Scatter, out, out.numel(), root_rank), send.data(),
                     send_bytes.data(), recv.data(), recv_bytes.data());
      dense.finish();
    };
  }

  Run reduce_scatter(std::vector<at::Tensor> sources, Dense dense, Reduction kind) override {
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      const at::Tensor& out = dense.work;
      std::vector<const void*> pointers;
      for (const auto& s : sources) {
        pointers.push_back(s.data_ptr());
      }
      shm_reduce_scatter(*transport,
                         make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kind)),
                         pointers.data(), out.data_ptr(), out.numel(), out.scalar_type(), kind, size);
      dense.finish();
    };
  }

  Run reduce_scatter_tensor(std::vector<at::Tensor> sources, std::vector<Dense> targets,
                            std::vector<Reduction> kinds, int64_t dim, int64_t outer) override {
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      for (const auto i : c10::irange(sources.size())) {
        const at::Tensor& out = targets[i].work;
        const auto* base = static_cast<const char*>(sources[i].data_ptr());
        std::vector<const void*> pointers;
        for (const auto r : c10::irange(size)) {
          pointers.push_back(base == nullptr ? nullptr : base + r * first_run_offset(out.nbytes(), outer));
        }
        shm_reduce_scatter(
            *transport,
            make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kinds[i]), dim),
            pointers.data(), out.data_ptr(), out.numel(), out.scalar_type(), kinds[i], size,
            piece_layout(out.nbytes(), outer, size));
        targets[i].finish();
      }
    };
  }

  Run all_to_all_single(at::Tensor& output, at::Tensor& input, std::vector<int64_t>&, std::vector<int64_t>&,
                        const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits,
                        const c10d::AllToAllOptions&) override {
    const int64_t in_row = input.dim() == 0 || input.size(0) == 0 ? 0 : input.numel() / input.size(0);
    const int64_t out_row = output.dim() == 0 || output.size(0) == 0 ? 0 : output.numel() / output.size(0);
    const at::Tensor source = input.contiguous();
    Dense dense(output);
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      const size_t item = source.element_size();
      std::vector<const void*> send(size);
      std::vector<size_t> send_bytes(size);
      std::vector<void*> recv(size);
      std::vector<size_t> recv_bytes(size);
      size_t in_offset = 0;
      size_t out_offset = 0;
      for (const auto r : c10::irange(size)) {
        send_bytes[r] = static_cast<size_t>(in_splits[r] * in_row) * item;
        recv_bytes[r] = static_cast<size_t>(out_splits[r] * out_row) * item;
        send[r] = static_cast<const char*>(source.data_ptr()) + in_offset;
        recv[r] = static_cast<char*>(dense.work.data_ptr()) + out_offset;
        in_offset += send_bytes[r];
        out_offset += recv_bytes[r];
      }
      shm_all_to_all(*transport, make_header(seq, OpCode::AllToAll, source, -1), send.data(), send_bytes.data(),
                     recv.data(), recv_bytes.data());
      dense.finish();
    };
  }

  Run all_to_all_pieces(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows, AllToAllPieces& pieces) override {
    const int64_t row_bytes = rows.dim() == 0 ? 0 : c10::multiply_integers(rows.sizes().slice(1)) * rows.element_size();
    std::vector<size_t> send_bytes(size_);
    std::vector<size_t> recv_bytes(size_);
    for (const auto r : c10::irange(size_)) {
      send_bytes[r] = static_cast<size_t>(send_rows[r] * row_bytes);
      recv_bytes[r] = static_cast<size_t>(recv_rows[r] * row_bytes);
    }
    // The own piece is unpacked as it is packed, so both sides must agree.
    TORCH_CHECK(send_rows[rank_] == recv_rows[rank_], "torch_tp backend: all_to_all: rank ", rank_, " sends ",
                send_rows[rank_], " rows to itself but expects ", recv_rows[rank_], " from itself");
    auto* transport = &transport_;
    const int me = rank_;
    return [=, &pieces](uint64_t seq) {
      const AllToAllCopies copies{
          [&](int r, size_t offset, size_t len, char* dst) { pieces.pack(r, offset, len, dst); },
          [&](int r, size_t offset, size_t len, const char* src) { pieces.unpack(r, offset, len, src); }};
      // This rank's own piece skips the slots and their steps: packed and
      // unpacked a cache-sized chunk at a time through a private buffer.
      auto copy_own = [&] {
        const size_t own = send_bytes[me];
        std::vector<char> chunk(std::min(own, kOwnPieceChunkBytes));
        for (size_t offset = 0; offset < own; offset += chunk.size()) {
          const size_t len = std::min(chunk.size(), own - offset);
          pieces.pack(me, offset, len, chunk.data());
          pieces.unpack(me, offset, len, chunk.data());
        }
      };
      shm_all_to_all(*transport, make_header(seq, OpCode::AllToAll, rows, -1), send_bytes.data(),
                     recv_bytes.data(), copies, copy_own);
    };
  }

  Run all_to_all(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::AllToAllOptions&) override {
    std::vector<at::Tensor> sources;
    std::vector<Dense> targets;
    for (const auto r : c10::irange(size_)) {
      sources.push_back(inputs[r].contiguous());
      targets.emplace_back(outputs[r]);
    }
    auto* transport = &transport_;
    const int size = size_;
    return [=](uint64_t seq) {
      std::vector<const void*> send(size);
      std::vector<size_t> send_bytes(size);
      std::vector<void*> recv(size);
      std::vector<size_t> recv_bytes(size);
      for (const auto r : c10::irange(size)) {
        send[r] = sources[r].data_ptr();
        send_bytes[r] = sources[r].nbytes();
        recv[r] = targets[r].work.data_ptr();
        recv_bytes[r] = targets[r].work.nbytes();
      }
      shm_all_to_all(*transport, make_header(seq, OpCode::AllToAll, sources[0], -1), send.data(), send_bytes.data(),
                     recv.data(), recv_bytes.data());
      for (const auto& t : targets) {
        t.finish();
      }
    };
  }

 private:
  ShmTransport& transport_;
  const int rank_;
  const int size_;
};

} // namespace

std::unique_ptr<Collectives> node_collectives(ShmTransport& transport, int rank, int size) {
  return std::make_unique<NodeCollectives>(transport, rank, size);
}

} // namespace torch_tp::backend
