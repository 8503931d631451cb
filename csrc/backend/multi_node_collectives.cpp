// The collectives of a group whose ranks sit on several nodes: the
// reductions (all-reduce, reduce, reduce-scatter) and barrier are
// hierarchical, shared memory inside each node (shm_collectives.h on the
// node's ShmTransport) around gloo among the node leaders (NOTE [reductions
// across nodes]); the other collectives run on the gloo group of all the
// ranks, with the caller's c10d arguments as they came.

#include "backend/collectives.h"
#include "backend/shm_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace torch_tp::backend {
namespace {

// [outer, p * n, inner] <-> the ranks' pieces one after another, [p, outer, n * inner]
// (flattened): the dim-0 layout gloo and the node-leader reduction use.
// rank_major returns a new tensor, which the reduction may overwrite.
at::Tensor rank_major(const at::Tensor& t, int64_t outer, int size) {
  if (outer <= 1 || t.numel() == 0) {
    return t.reshape(-1).clone();
  }
  return t.reshape({outer, size, -1}).transpose(0, 1).reshape(-1);
}

void copy_from_rank_major(const at::Tensor& out, const at::Tensor& blocks, int64_t outer, int size) {
  out.view({outer, size, -1}).copy_(blocks.view({size, outer, -1}).transpose(0, 1));
}

// NOTE [reductions across nodes]
// Shared memory inside each node, gloo among the node leaders, shared memory
// again to hand the result to every rank of the node. bf16/fp16 go through
// all three stages in float32 and are rounded once at the end (NOTE
// [reduction precision]); avg is a sum everywhere and one division at the
// end. reduce and reduce_scatter across nodes are this all-reduce followed by
// keeping the root's tensor or this rank's piece: every rank's data crosses
// the nodes once, as in gloo, whose reduce_scatter runs a whole all-reduce too.
// `header` describes the caller's op for the first shared-memory step.
void all_reduce_across_nodes(ShmTransport& transport, c10d::Backend* leaders, int size, CallHeader header,
                             const at::Tensor& t, Reduction kind) {
  const bool widen = t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
  const at::Tensor acc = widen ? t.to(at::kFloat) : t;
  const Reduction folded = kind == Reduction::Avg ? Reduction::Sum : kind;
  shm_all_reduce(transport, header, acc.data_ptr(), acc.data_ptr(), acc.numel(), acc.scalar_type(), folded, size);
  if (leaders != nullptr) {
    std::vector<at::Tensor> one{alias_for_backend(acc)};  // NOTE [what a backend's threads may hold]
    c10d::AllreduceOptions across;
    switch (folded) {
      case Reduction::Product: across.reduceOp = c10d::ReduceOp::PRODUCT; break;
      case Reduction::Min: across.reduceOp = c10d::ReduceOp::MIN; break;
      case Reduction::Max: across.reduceOp = c10d::ReduceOp::MAX; break;
      default: across.reduceOp = c10d::ReduceOp::SUM; break;
    }
    leaders->allreduce(one, across)->wait();
  }
  header.op = static_cast<int32_t>(OpCode::Broadcast);
  shm_broadcast(transport, header, acc.data_ptr(), acc.nbytes(), 0);
  if (kind == Reduction::Avg) {
    acc.div_(size);
  }
  if (widen) {
    t.copy_(acc);
  }
}

// reduce_scatter across nodes (NOTE [reductions across nodes]): `full` is a
// scratch copy of this rank's whole input, flat; out receives rank `rank`'s
// piece of its reduction.
void reduce_scatter_across_nodes(ShmTransport& transport, c10d::Backend* leaders, int size, int rank,
                                 const CallHeader& header, const at::Tensor& full, const at::Tensor& out,
                                 Reduction kind) {
  all_reduce_across_nodes(transport, leaders, size, header, full, kind);
  out.view(-1).copy_(full.narrow(0, rank * out.numel(), out.numel()));
}

class MultiNodeCollectives final : public Collectives {
 public:
  MultiNodeCollectives(ShmTransport& transport, int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo_all,
                       c10::intrusive_ptr<c10d::Backend> gloo_leaders)
      : transport_(transport),
        rank_(rank),
        size_(size),
        gloo_all_(std::move(gloo_all)),
        gloo_leaders_(std::move(gloo_leaders)) {}

  // ---- hierarchical: shared memory, the node leaders' gloo, shared memory --

  Run all_reduce(std::vector<Dense> dense, std::vector<Reduction> kinds) override {
    const int size = size_;
    auto* transport = &transport_;
    auto leaders = gloo_leaders_;  // null except on node leaders
    return [=](uint64_t seq) {
      for (const auto i : c10::irange(dense.size())) {
        const at::Tensor& t = dense[i].work;
        all_reduce_across_nodes(*transport, leaders.get(), size,
                                make_header(seq, OpCode::AllReduce, t, t.numel(), -1, static_cast<int64_t>(kinds[i])),
                                t, kinds[i]);
        dense[i].finish();
      }
    };
  }

  Run all_reduce_into(at::Tensor input, at::Tensor output, Reduction kind) override {
    const int size = size_;
    auto* transport = &transport_;
    auto leaders = gloo_leaders_;
    return [=](uint64_t seq) {
      if (!output.is_same(input)) {
        output.copy_(input);
      }
      all_reduce_across_nodes(*transport, leaders.get(), size,
                              make_header(seq, OpCode::AllReduce, output, output.numel(), -1,
                                          static_cast<int64_t>(kind)),
                              output, kind);
    };
  }

  Run reduce(Dense dense, at::Tensor scratch, Reduction kind, int64_t root_rank) override {
    const bool root = rank_ == root_rank;
    auto* transport = &transport_;
    auto leaders = gloo_leaders_;
    const int size = size_;
    return [=](uint64_t seq) {
      const CallHeader header =
          make_header(seq, OpCode::Reduce, scratch, scratch.numel(), root_rank, static_cast<int64_t>(kind));
      all_reduce_across_nodes(*transport, leaders.get(), size, header, scratch, kind);
      if (root) {
        dense.finish();
      }
    };
  }

  Run barrier() override {
    auto* transport = &transport_;
    auto leaders = gloo_leaders_;  // null except on node leaders
    return [=](uint64_t seq) {
      CallHeader header;
      header.seq = seq;
      header.op = static_cast<int32_t>(OpCode::Barrier);
      shm_barrier(*transport, header);
      // Every node has arrived once its leader passed the leaders' barrier.
      if (leaders) {
        leaders->barrier()->wait();
      }
      shm_barrier(*transport, header);
    };
  }

  Run reduce_scatter(std::vector<at::Tensor> sources, Dense dense, Reduction kind) override {
    auto* transport = &transport_;
    const int size = size_;
    // NOTE [reductions across nodes]: all-reduce the concatenated inputs, keep this rank's piece.
    auto leaders = gloo_leaders_;
    const int rank = rank_;
    return [=](uint64_t seq) {
      const at::Tensor& out = dense.work;
      std::vector<at::Tensor> flat;
      for (const auto& source : sources) {
        flat.push_back(source.reshape(-1));
      }
      reduce_scatter_across_nodes(
          *transport, leaders.get(), size, rank,
          make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kind)), at::cat(flat),
          out, kind);
      dense.finish();
    };
  }

  Run reduce_scatter_tensor(std::vector<at::Tensor> sources, std::vector<Dense> targets,
                            std::vector<Reduction> kinds, int64_t dim, int64_t outer) override {
    auto* transport = &transport_;
    const int size = size_;
    // NOTE [reductions across nodes]: all-reduce a copy of the input, keep this rank's piece.
    auto leaders = gloo_leaders_;
    const int rank = rank_;
    return [=](uint64_t seq) {
      for (const auto i : c10::irange(sources.size())) {
        const at::Tensor& out = targets[i].work;
        reduce_scatter_across_nodes(
            *transport, leaders.get(), size, rank,
            make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kinds[i]), dim),
            rank_major(sources[i], outer, size), out, kinds[i]);
        targets[i].finish();
      }
    };
  }

  // ---- on the gloo group of all ranks ---------------------------------------
  // gloo gets aliases of the caller's tensors (NOTE [what a backend's threads may hold]).

  Run broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, tensors = alias_for_backend(tensors), opts](uint64_t) mutable {
      gloo->broadcast(tensors, opts)->wait();
    };
  }

  Run all_gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::AllgatherOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, outputs = alias_for_backend(outputs), inputs = alias_for_backend(inputs), opts](uint64_t) mutable {
      gloo->allgather(outputs, inputs, opts)->wait();
    };
  }

  // gloo has no header to carry the ops' dim in: a different dim per rank is
  // found only by TORCH_DISTRIBUTED_DEBUG=DETAIL here, as on a gloo group.
  // With outer > 1 gloo gathers the pieces one after another into a buffer,
  // copied into the [outer, p * n, inner] output after.
  Run all_gather_into_tensor(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::AllgatherOptions& opts, int64_t /*dim*/, int64_t outer) override {
    auto gloo = gloo_all_;
    const int size = size_;
    return [gloo, outputs = alias_for_backend(outputs), inputs = alias_for_backend(inputs), opts, outer,
            size](uint64_t) mutable {
      for (const auto i : c10::irange(inputs.size())) {
        if (outer <= 1) {
          gloo->_allgather_base(outputs[i], inputs[i], opts)->wait();
          continue;
        }
        if (outputs[i].numel() == 0) {  // every rank's: the ops' pieces are all one shape
          continue;
        }
        at::Tensor blocks = at::empty({outputs[i].numel()}, outputs[i].options());
        at::Tensor flat_input = inputs[i].reshape(-1);
        gloo->_allgather_base(blocks, flat_input, opts)->wait();
        copy_from_rank_major(outputs[i], blocks, outer, size);
      }
    };
  }

  Run gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
             const c10d::GatherOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, outputs = alias_for_backend(outputs), inputs = alias_for_backend(inputs), opts](uint64_t) mutable {
      gloo->gather(outputs, inputs, opts)->wait();
    };
  }

  Run scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
              const c10d::ScatterOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, outputs = alias_for_backend(outputs), inputs = alias_for_backend(inputs), opts](uint64_t) mutable {
      gloo->scatter(outputs, inputs, opts)->wait();
    };
  }

  Run all_to_all_single(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
                        std::vector<int64_t>& input_split_sizes, const std::vector<int64_t>&,
                        const std::vector<int64_t>&, const c10d::AllToAllOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, output = alias_for_backend(output), input = alias_for_backend(input), output_split_sizes,
            input_split_sizes, opts](uint64_t) mutable {
      gloo->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)->wait();
    };
  }

  Run all_to_all(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::AllToAllOptions& opts) override {
    auto gloo = gloo_all_;
    return [gloo, outputs = alias_for_backend(outputs), inputs = alias_for_backend(inputs), opts](uint64_t) mutable {
      gloo->alltoall(outputs, inputs, opts)->wait();
    };
  }

 private:
  ShmTransport& transport_;
  const int rank_;
  const int size_;
  c10::intrusive_ptr<c10d::Backend> gloo_all_;
  c10::intrusive_ptr<c10d::Backend> gloo_leaders_;  // null except on node leaders
};

} // namespace

std::unique_ptr<Collectives> multi_node_collectives(ShmTransport& transport, int rank, int size,
                                                    c10::intrusive_ptr<c10d::Backend> gloo_all,
                                                    c10::intrusive_ptr<c10d::Backend> gloo_leaders) {
  return std::make_unique<MultiNodeCollectives>(transport, rank, size, std::move(gloo_all), std::move(gloo_leaders));
}

} // namespace torch_tp::backend
