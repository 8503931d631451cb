#include "backend/process_group_shm.h"

#include "backend/dense.h"
#include "backend/p2p.h"
#include "backend/reduce_kernels.h"
#include "backend/shm_collectives.h"
#include "backend/shm_transport.h"
#include "backend/work_queue.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <random>
#include <unistd.h>

namespace torch_tp::backend {
namespace {

// Smallest buffer that still holds a cache line per rank per slot for a
// large node; below it the chunking would degenerate.
constexpr size_t kMinBufferBytes = 4096;

void check_tensor(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "torch_tp backend: ", op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "torch_tp backend: ", op, ": ", arg,
              " must be a CPU tensor (the torch_tp backend serves CPU tensors; use e.g. "
              "\"cpu:torch_tp,cuda:nccl\" for CUDA), got device ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "torch_tp backend: ", op, ": ", arg, " must be a dense tensor, got layout ",
              t.layout());
}

void check_count(const char* op, const char* arg, size_t got, size_t expected) {
  TORCH_CHECK(got == expected, "torch_tp backend: ", op, ": ", arg, " must hold ", expected, " tensor(s), got ", got);
}

void check_like(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref, int64_t numel) {
  check_tensor(op, arg, t);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "torch_tp backend: ", op, ": ", arg, " has dtype ",
              t.scalar_type(), " but the input has dtype ", ref.scalar_type());
  TORCH_CHECK(t.numel() == numel, "torch_tp backend: ", op, ": ", arg, " must have ", numel, " elements, got ",
              t.numel(), " (sizes ", t.sizes(), ")");
}

Reduction from_c10d(const char* op, const c10d::ReduceOp& reduce_op, at::ScalarType dtype) {
  Reduction kind{};
  switch (reduce_op.op_) {
    case c10d::ReduceOp::SUM: kind = Reduction::Sum; break;
    case c10d::ReduceOp::AVG: kind = Reduction::Avg; break;
    case c10d::ReduceOp::PRODUCT: kind = Reduction::Product; break;
    case c10d::ReduceOp::MIN: kind = Reduction::Min; break;
    case c10d::ReduceOp::MAX: kind = Reduction::Max; break;
    default:
      TORCH_CHECK(false, "torch_tp backend: ", op, ": reduce_op ", static_cast<int>(reduce_op.op_),
                  " is not supported (SUM, AVG, PRODUCT, MIN and MAX are)");
  }
  const char* why = nullptr;
  TORCH_CHECK(reduction_supported(kind, dtype, &why), "torch_tp backend: ", op, ": reduce_op ",
              reduction_name(kind), " on dtype ", dtype, " is not supported: ", why);
  return kind;
}

CallHeader make_header(uint64_t seq, OpCode op, const at::Tensor& t, int64_t numel, int64_t root = -1,
                       int64_t reduce = -1) {
  CallHeader header;
  header.seq = seq;
  header.op = static_cast<int32_t>(op);
  header.dtype = static_cast<int32_t>(t.scalar_type());
  header.numel = numel;
  header.root = root;
  header.reduce = reduce;
  if (numel >= 0) {
    header.set_shape(t.sizes());
  }
  return header;
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
  shm_all_reduce(transport, header, acc.data_ptr(), acc.numel(), acc.scalar_type(), folded, size);
  if (leaders != nullptr) {
    std::vector<at::Tensor> one{acc};
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

std::string random_token() {
  std::random_device device;
  const uint64_t value = (static_cast<uint64_t>(device()) << 32) ^ device();
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

} // namespace

size_t buffer_bytes_from_env() {
  const char* text = std::getenv("TORCH_TP_SHM_BUFFER_BYTES");
  if (text == nullptr || *text == '\0') {
    return kDefaultBufferBytes;
  }
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text, &end, 10);
  // No upper bound here: the /dev/shm free-space check says what fits.
  TORCH_CHECK(errno == 0 && *end == '\0' && text[0] != '-' && value >= kMinBufferBytes,
              "torch_tp backend: TORCH_TP_SHM_BUFFER_BYTES=", text,
              " is not a valid size: it must be a whole number of bytes, at least ", kMinBufferBytes,
              " (default ", kDefaultBufferBytes, ")");
  return static_cast<size_t>(value);
}

std::vector<std::string> exchange_host_keys(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  std::string mine;
  if (const char* key = std::getenv("TORCH_TP_HOST_KEY"); key != nullptr && *key != '\0') {
    mine = key;
  } else {
    char name[HOST_NAME_MAX + 1] = {};
    TORCH_CHECK(gethostname(name, HOST_NAME_MAX) == 0, "torch_tp backend: gethostname failed: ",
                std::strerror(errno));
    mine = name;
  }
  store->set("torch_tp/host/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (const auto r : c10::irange(size)) {
    keys.push_back("torch_tp/host/" + std::to_string(r));
  }
  store->wait(keys, timeout);
  std::vector<std::string> hosts;
  for (const auto& key : keys) {
    const std::vector<uint8_t> host = store->get(key);
    hosts.emplace_back(host.begin(), host.end());
  }
  return hosts;
}

ProcessGroupShm::ProcessGroupShm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Options options)
    : c10d::Backend(rank, size), store_(store), options_(std::move(options)) {
  TORCH_CHECK(static_cast<int>(options_.host_keys.size()) == size, "torch_tp backend: init: ",
              options_.host_keys.size(), " host keys for a group of ", size, " ranks");
  TORCH_CHECK(options_.buffer_bytes >= kMinBufferBytes, "torch_tp backend: init: buffer_bytes=",
              options_.buffer_bytes, " is below the minimum of ", kMinBufferBytes);
  std::vector<std::string> nodes;
  for (const auto& key : options_.host_keys) {
    if (std::find(nodes.begin(), nodes.end(), key) == nodes.end()) {
      nodes.push_back(key);
    }
  }
  num_nodes_ = static_cast<int>(nodes.size());
  int local_rank = 0;
  std::vector<int> local_ranks;
  std::vector<int> local_index(size, -1);  // by group rank: index among local_ranks, or -1 on another node
  for (const auto r : c10::irange(size)) {
    if (options_.host_keys[r] == options_.host_keys[rank]) {
      if (r == rank) {
        local_rank = static_cast<int>(local_ranks.size());
      }
      local_index[r] = static_cast<int>(local_ranks.size());
      local_ranks.push_back(r);
    }
  }
  const bool leader = local_ranks.front() == rank;
  if (num_nodes_ > 1) {
    TORCH_CHECK(options_.gloo_all, "torch_tp backend: init: the group spans ", num_nodes_,
                " nodes but no gloo group over all ranks was given");
    TORCH_CHECK(leader == static_cast<bool>(options_.gloo_leaders), "torch_tp backend: init: rank ", rank,
                (leader ? " leads its node but was given no gloo group of node leaders"
                        : " does not lead its node but was given a gloo group of node leaders"));
  }

  // The token keeps the segment names of concurrent groups (and jobs) apart.
  const std::string token_key = "torch_tp/token";
  if (rank == 0) {
    const std::string token = random_token();
    store_->set(token_key, std::vector<uint8_t>(token.begin(), token.end()));
  }
  store_->wait({token_key}, options_.timeout);
  const std::vector<uint8_t> token = store_->get(token_key);

  transport_ = std::make_unique<ShmTransport>(
      store_, ShmTransport::Options{local_rank, std::move(local_ranks), options_.buffer_bytes, options_.timeout,
                                    std::string(token.begin(), token.end())});
  collectives_ = std::make_unique<WorkQueue>(rank);
  p2p_ = std::make_unique<PointToPoint>(*transport_, std::move(local_index), options_.gloo_all, rank,
                                        options_.timeout);
}

ProcessGroupShm::~ProcessGroupShm() {
  stop("the process group was destroyed");
}

void ProcessGroupShm::stop(const std::string& why) {
  // Calls still queued run out first (a normal shutdown waits for them, as
  // gloo's does); after an abort they fail at their first wait. Then nothing
  // uses the transport any more: unmap the segments now, since Python may keep
  // this object alive after destroy_process_group has shut it down.
  if (collectives_) {
    collectives_->stop();
  }
  if (p2p_) {
    p2p_->stop();
  }
  if (transport_) {
    transport_->abort(why);
    transport_.reset();
  }
}

void ProcessGroupShm::shutdown() {
  stop("the process group was shut down");
}

void ProcessGroupShm::abort() {
  // Fail the waits in progress first, so that stop() does not wait them out.
  if (transport_) {
    transport_->abort("the process group was aborted");
  }
  stop("the process group was aborted");
}

uint64_t ProcessGroupShm::getSequenceNumberForGroup() {
  return seq_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::collective(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                           bool async_op, std::function<void(uint64_t seq)> run) {
  const uint64_t seq = ++seq_;
  if (async_op) {
    return collectives_->push(type, std::move(outputs), [run = std::move(run), seq] { run(seq); });
  }
  return collectives_->run_inline_or_push(type, std::move(outputs), [run = std::move(run), seq] { run(seq); });
}

// ---- all-reduce, reduce, broadcast, barrier -------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  std::vector<at::Tensor> list = tensors;
  c10d::AllreduceCoalescedOptions coalesced;
  coalesced.reduceOp = opts.reduceOp;
  check_count("all_reduce", "tensors", tensors.size(), 1);
  return allreduce_coalesced(list, coalesced);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "all_reduce";
  std::vector<Dense> dense;
  std::vector<Reduction> kinds;
  for (const auto& t : tensors) {
    check_tensor(op, "tensor", t);
    kinds.push_back(from_c10d(op, opts.reduceOp, t.scalar_type()));
    dense.emplace_back(t);
  }
  const int size = size_;
  auto* transport = transport_.get();
  auto leaders = options_.gloo_leaders;  // null except on node leaders
  const bool hierarchical = num_nodes_ > 1;
  return collective(c10d::OpType::ALLREDUCE, tensors, opts.asyncOp, [=](uint64_t seq) {
    for (const auto i : c10::irange(dense.size())) {
      const at::Tensor& t = dense[i].work;
      if (!hierarchical) {
        const CallHeader header =
            make_header(seq, OpCode::AllReduce, t, t.numel(), -1, static_cast<int64_t>(kinds[i]));
        shm_all_reduce(*transport, header, t.data_ptr(), t.numel(), t.scalar_type(), kinds[i], size);
        dense[i].finish();
        continue;
      }
      all_reduce_across_nodes(*transport, leaders.get(), size,
                              make_header(seq, OpCode::AllReduce, t, t.numel(), -1, static_cast<int64_t>(kinds[i])),
                              t, kinds[i]);
      dense[i].finish();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "torch_tp backend: reduce: root rank ", opts.rootRank,
              " is outside the group of ", size_);
  const Reduction kind = from_c10d(op, opts.reduceOp, tensors[0].scalar_type());
  // Only the root's tensor changes: the others reduce into a scratch copy.
  const bool root = rank_ == opts.rootRank;
  Dense dense(tensors[0]);
  at::Tensor scratch = root ? dense.work : dense.work.clone();
  auto* transport = transport_.get();
  auto leaders = options_.gloo_leaders;
  const bool across_nodes = num_nodes_ > 1;
  const int size = size_;
  const int64_t root_rank = opts.rootRank;
  return collective(c10d::OpType::REDUCE, tensors, opts.asyncOp, [=](uint64_t seq) {
    const CallHeader header =
        make_header(seq, OpCode::Reduce, scratch, scratch.numel(), root_rank, static_cast<int64_t>(kind));
    if (across_nodes) {
      all_reduce_across_nodes(*transport, leaders.get(), size, header, scratch, kind);
    } else {
      shm_all_reduce(*transport, header, scratch.data_ptr(), scratch.numel(), scratch.scalar_type(), kind, size);
    }
    if (root) {
      dense.finish();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "torch_tp backend: broadcast: root rank ", opts.rootRank,
              " is outside the group of ", size_);
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::BROADCAST, tensors, opts.asyncOp,
                      [gloo, tensors, opts](uint64_t) mutable { gloo->broadcast(tensors, opts)->wait(); });
  }
  Dense dense(tensors[0]);
  auto* transport = transport_.get();
  const int64_t root = opts.rootRank;
  return collective(c10d::OpType::BROADCAST, tensors, opts.asyncOp, [=](uint64_t seq) {
    const at::Tensor& t = dense.work;
    shm_broadcast(*transport, make_header(seq, OpCode::Broadcast, t, t.numel(), root), t.data_ptr(), t.nbytes(),
                  static_cast<int>(root));
    dense.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::barrier(const c10d::BarrierOptions& opts) {
  auto* transport = transport_.get();
  const bool hierarchical = num_nodes_ > 1;
  auto leaders = options_.gloo_leaders;  // null except on node leaders
  return collective(c10d::OpType::BARRIER, {}, opts.asyncOp, [=](uint64_t seq) {
    CallHeader header;
    header.seq = seq;
    header.op = static_cast<int32_t>(OpCode::Barrier);
    shm_barrier(*transport, header);
    if (hierarchical) {
      // Every node has arrived once its leader passed the leaders' barrier.
      if (leaders) {
        leaders->barrier()->wait();
      }
      shm_barrier(*transport, header);
    }
  });
}

// ---- all-gather, gather, scatter --------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather";
  check_count(op, "input_tensors", inputs.size(), 1);
  check_count(op, "output_tensor_lists", outputs.size(), 1);
  check_count(op, "output_tensor_lists[0]", outputs[0].size(), static_cast<size_t>(size_));
  check_tensor(op, "input", inputs[0]);
  for (const auto& out : outputs[0]) {
    check_like(op, "output_tensor_lists[0][i]", out, inputs[0], inputs[0].numel());
  }
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::ALLGATHER, outputs[0], opts.asyncOp,
                      [gloo, outputs, inputs, opts](uint64_t) mutable {
      gloo->allgather(outputs, inputs, opts)->wait();
    });
  }
  const at::Tensor input = inputs[0].contiguous();
  std::vector<Dense> dense(outputs[0].begin(), outputs[0].end());
  auto* transport = transport_.get();
  return collective(c10d::OpType::ALLGATHER, outputs[0], opts.asyncOp, [=](uint64_t seq) {
    std::vector<void*> targets;
    for (const auto& d : dense) {
      targets.push_back(d.work.data_ptr());
    }
    shm_all_gather(*transport, make_header(seq, OpCode::AllGather, input, input.numel()), input.data_ptr(),
                   input.nbytes(), targets.data());
    for (const auto& d : dense) {
      d.finish();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  check_count(op, "output_tensors", outputs.size(), inputs.size());
  std::vector<at::Tensor> dense_inputs;
  std::vector<Dense> dense_outputs;
  for (const auto i : c10::irange(inputs.size())) {
    check_tensor(op, "input", inputs[i]);
    check_like(op, "output", outputs[i], inputs[i], inputs[i].numel() * size_);
    // gloo's rule: the output is the inputs concatenated along dim 0,
    // [p * n0, n1, ..] (a 0-d input: [p]); the right numel in another shape is
    // refused, not silently filled in a different layout.
    std::vector<int64_t> expected = inputs[i].sizes().vec();
    if (expected.empty()) {
      expected.push_back(size_);
    } else {
      expected[0] *= size_;
    }
    TORCH_CHECK(outputs[i].sizes() == at::IntArrayRef(expected), "torch_tp backend: ", op, ": output has shape ",
                outputs[i].sizes(), " but an input of shape ", inputs[i].sizes(), " over ", size_,
                " ranks needs an output of shape ", at::IntArrayRef(expected),
                " (the inputs concatenated along dim 0)");
    dense_inputs.push_back(inputs[i].contiguous());
    dense_outputs.emplace_back(outputs[i]);
  }
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::_ALLGATHER_BASE, outputs, opts.asyncOp,
                      [gloo, outputs, inputs, opts](uint64_t) mutable {
      for (const auto i : c10::irange(inputs.size())) {
        gloo->_allgather_base(outputs[i], inputs[i], opts)->wait();
      }
    });
  }
  auto* transport = transport_.get();
  const int size = size_;
  return collective(c10d::OpType::_ALLGATHER_BASE, outputs, opts.asyncOp, [=](uint64_t seq) {
    for (const auto i : c10::irange(dense_inputs.size())) {
      const at::Tensor& in = dense_inputs[i];
      auto* base = static_cast<char*>(dense_outputs[i].work.data_ptr());
      std::vector<void*> targets;
      for (const auto r : c10::irange(size)) {
        targets.push_back(base == nullptr ? nullptr : base + r * in.nbytes());
      }
      shm_all_gather(*transport, make_header(seq, OpCode::AllGather, in, in.numel()), in.data_ptr(), in.nbytes(),
                     targets.data());
      dense_outputs[i].finish();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                    std::vector<at::Tensor>& inputs,
                                                                    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  check_count(op, "output_lists", outputs.size(), static_cast<size_t>(size_));
  // outputs[r][i] receives rank r's inputs[i]: one all_gather per input.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto i : c10::irange(inputs.size())) {
    std::vector<std::vector<at::Tensor>> one(1);
    for (const auto r : c10::irange(size_)) {
      check_count(op, "output_lists[r]", outputs[r].size(), inputs.size());
      one[0].push_back(outputs[r][i]);
    }
    std::vector<at::Tensor> in{inputs[i]};
    works.push_back(allgather(one, in, opts));
  }
  // The calls run in order on one queue: the last one's completion is all of them'.
  std::vector<at::Tensor> flat;
  for (const auto& list : outputs) {
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return collective(c10d::OpType::ALLGATHER_COALESCED, flat, opts.asyncOp, [works](uint64_t) {
    for (const auto& work : works) {
      work->wait();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  const char* op = "gather";
  check_count(op, "input_tensors", inputs.size(), 1);
  check_tensor(op, "input", inputs[0]);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "torch_tp backend: gather: root rank ", opts.rootRank,
              " is outside the group of ", size_);
  const bool root = rank_ == opts.rootRank;
  if (root) {
    check_count(op, "output_tensors", outputs.size(), 1);
    check_count(op, "output_tensors[0]", outputs[0].size(), static_cast<size_t>(size_));
    for (const auto& out : outputs[0]) {
      check_like(op, "output_tensors[0][i]", out, inputs[0], inputs[0].numel());
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "torch_tp backend: gather: rank ",
                rank_, " is not the root and must pass no output tensors, got ", outputs.size(), " list(s)");
  }
  std::vector<at::Tensor> result = root ? outputs[0] : std::vector<at::Tensor>{};
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::GATHER, result, opts.asyncOp, [gloo, outputs, inputs, opts](uint64_t) mutable {
      gloo->gather(outputs, inputs, opts)->wait();
    });
  }
  const at::Tensor input = inputs[0].contiguous();
  std::vector<Dense> dense(result.begin(), result.end());
  auto* transport = transport_.get();
  const int size = size_;
  const int64_t root_rank = opts.rootRank;
  return collective(c10d::OpType::GATHER, result, opts.asyncOp, [=](uint64_t seq) {
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
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  check_count(op, "output_tensors", outputs.size(), 1);
  check_tensor(op, "output", outputs[0]);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "torch_tp backend: scatter: root rank ", opts.rootRank,
              " is outside the group of ", size_);
  const bool root = rank_ == opts.rootRank;
  std::vector<at::Tensor> sources;
  if (root) {
    check_count(op, "input_tensors", inputs.size(), 1);
    check_count(op, "input_tensors[0]", inputs[0].size(), static_cast<size_t>(size_));
    for (const auto& in : inputs[0]) {
      check_like(op, "input_tensors[0][i]", in, outputs[0], outputs[0].numel());
      sources.push_back(in.contiguous());
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "torch_tp backend: scatter: rank ",
                rank_, " is not the root and must pass no input tensors, got ", inputs.size(), " list(s)");
  }
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::SCATTER, outputs, opts.asyncOp, [gloo, outputs, inputs, opts](uint64_t) mutable {
      gloo->scatter(outputs, inputs, opts)->wait();
    });
  }
  Dense dense(outputs[0]);
  auto* transport = transport_.get();
  const int size = size_;
  const int64_t root_rank = opts.rootRank;
  return collective(c10d::OpType::SCATTER, outputs, opts.asyncOp, [=](uint64_t seq) {
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
  });
}

// ---- reduce-scatter ---------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  check_count(op, "output_tensors", outputs.size(), 1);
  check_count(op, "input_lists", inputs.size(), 1);
  check_count(op, "input_lists[0]", inputs[0].size(), static_cast<size_t>(size_));
  check_tensor(op, "output", outputs[0]);
  const Reduction kind = from_c10d(op, opts.reduceOp, outputs[0].scalar_type());
  std::vector<at::Tensor> sources;
  for (const auto& in : inputs[0]) {
    check_like(op, "input_lists[0][i]", in, outputs[0], outputs[0].numel());
    sources.push_back(in.contiguous());
  }
  Dense dense(outputs[0]);
  auto* transport = transport_.get();
  const int size = size_;
  if (num_nodes_ > 1) {
    // NOTE [reductions across nodes]: all-reduce the concatenated inputs, keep this rank's piece.
    auto leaders = options_.gloo_leaders;
    const int rank = rank_;
    return collective(c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp, [=](uint64_t seq) {
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
    });
  }
  return collective(c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp, [=](uint64_t seq) {
    const at::Tensor& out = dense.work;
    std::vector<const void*> pointers;
    for (const auto& s : sources) {
      pointers.push_back(s.data_ptr());
    }
    shm_reduce_scatter(*transport,
                       make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kind)),
                       pointers.data(), out.data_ptr(), out.numel(), out.scalar_type(), kind, size);
    dense.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  check_count(op, "output_tensors", outputs.size(), inputs.size());
  std::vector<at::Tensor> sources;
  std::vector<Dense> targets;
  std::vector<Reduction> kinds;
  for (const auto i : c10::irange(inputs.size())) {
    check_tensor(op, "output", outputs[i]);
    check_like(op, "input", inputs[i], outputs[i], outputs[i].numel() * size_);
    kinds.push_back(from_c10d(op, opts.reduceOp, outputs[i].scalar_type()));
    sources.push_back(inputs[i].contiguous());
    targets.emplace_back(outputs[i]);
  }
  auto* transport = transport_.get();
  const int size = size_;
  if (num_nodes_ > 1) {
    // NOTE [reductions across nodes]: all-reduce a copy of the input, keep this rank's piece.
    auto leaders = options_.gloo_leaders;
    const int rank = rank_;
    return collective(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, opts.asyncOp, [=](uint64_t seq) {
      for (const auto i : c10::irange(sources.size())) {
        const at::Tensor& out = targets[i].work;
        reduce_scatter_across_nodes(
            *transport, leaders.get(), size, rank,
            make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kinds[i])),
            sources[i].reshape(-1).clone(), out, kinds[i]);
        targets[i].finish();
      }
    });
  }
  return collective(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, opts.asyncOp, [=](uint64_t seq) {
    for (const auto i : c10::irange(sources.size())) {
      const at::Tensor& out = targets[i].work;
      const auto* base = static_cast<const char*>(sources[i].data_ptr());
      std::vector<const void*> pointers;
      for (const auto r : c10::irange(size)) {
        pointers.push_back(base == nullptr ? nullptr : base + r * out.nbytes());
      }
      shm_reduce_scatter(*transport,
                         make_header(seq, OpCode::ReduceScatter, out, out.numel(), -1, static_cast<int64_t>(kinds[i])),
                         pointers.data(), out.data_ptr(), out.numel(), out.scalar_type(), kinds[i], size);
      targets[i].finish();
    }
  });
}

// ---- all-to-all ---------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_split_sizes,
                                                              std::vector<int64_t>& input_split_sizes,
                                                              const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  check_tensor(op, "input", input);
  check_tensor(op, "output", output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torch_tp backend: ", op, ": output has dtype ",
              output.scalar_type(), " but input has dtype ", input.scalar_type());
  // Rows along dim 0, split as given, or evenly when no splits are given.
  auto splits = [&](const char* arg, const at::Tensor& t, const std::vector<int64_t>& given) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (given.empty()) {
      TORCH_CHECK(rows % size_ == 0, "torch_tp backend: ", op, ": ", arg, ".size(0)=", rows,
                  " must divide evenly over ", size_, " ranks when no split sizes are given");
      return std::vector<int64_t>(size_, rows / size_);
    }
    check_count(op, arg == std::string("input") ? "input_split_sizes" : "output_split_sizes", given.size(),
                static_cast<size_t>(size_));
    int64_t total = 0;
    for (const auto s : given) {
      TORCH_CHECK(s >= 0, "torch_tp backend: ", op, ": split sizes must be >= 0, got ", given);
      total += s;
    }
    TORCH_CHECK(total == rows, "torch_tp backend: ", op, ": ", arg, " split sizes ", given, " sum to ", total,
                " but ", arg, ".size(0)=", rows);
    return given;
  };
  const std::vector<int64_t> in_splits = splits("input", input, input_split_sizes);
  const std::vector<int64_t> out_splits = splits("output", output, output_split_sizes);
  const int64_t in_row = input.dim() == 0 || input.size(0) == 0 ? 0 : input.numel() / input.size(0);
  const int64_t out_row = output.dim() == 0 || output.size(0) == 0 ? 0 : output.numel() / output.size(0);
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    std::vector<at::Tensor> result{output};
    return collective(c10d::OpType::ALLTOALL_BASE, result, opts.asyncOp,
                      [gloo, output, input, output_split_sizes, input_split_sizes, opts](uint64_t) mutable {
                        gloo->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)->wait();
                      });
  }
  const at::Tensor source = input.contiguous();
  Dense dense(output);
  auto* transport = transport_.get();
  const int size = size_;
  return collective(c10d::OpType::ALLTOALL_BASE, {output}, opts.asyncOp, [=](uint64_t seq) {
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
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  check_count(op, "output_tensors", outputs.size(), static_cast<size_t>(size_));
  check_count(op, "input_tensors", inputs.size(), static_cast<size_t>(size_));
  std::vector<at::Tensor> sources;
  std::vector<Dense> targets;
  for (const auto r : c10::irange(size_)) {
    check_tensor(op, "input_tensors[i]", inputs[r]);
    check_tensor(op, "output_tensors[i]", outputs[r]);
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "torch_tp backend: ", op, ": every input and output tensor must have dtype ",
                inputs[0].scalar_type(), ", got input ", inputs[r].scalar_type(), " and output ",
                outputs[r].scalar_type(), " at index ", r);
    sources.push_back(inputs[r].contiguous());
    targets.emplace_back(outputs[r]);
  }
  if (num_nodes_ > 1) {
    auto gloo = options_.gloo_all;
    return collective(c10d::OpType::ALLTOALL, outputs, opts.asyncOp, [gloo, outputs, inputs, opts](uint64_t) mutable {
      gloo->alltoall(outputs, inputs, opts)->wait();
    });
  }
  auto* transport = transport_.get();
  const int size = size_;
  return collective(c10d::OpType::ALLTOALL, outputs, opts.asyncOp, [=](uint64_t seq) {
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
  });
}

// ---- send / recv (NOTE [send and recv] in p2p.cpp) -----------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  const char* op = "send";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  TORCH_CHECK(dst_rank >= 0 && dst_rank < size_ && dst_rank != rank_, "torch_tp backend: send: dst rank ", dst_rank,
              " must be another rank of the group of ", size_);
  return p2p_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  const char* op = "recv";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  TORCH_CHECK(src_rank >= 0 && src_rank < size_ && src_rank != rank_, "torch_tp backend: recv: src rank ", src_rank,
              " must be another rank of the group of ", size_);
  return p2p_->recv(tensors, src_rank, tag);
}

} // namespace torch_tp::backend
