#include "backend/process_group_shm.h"

#include "backend/collectives.h"
#include "backend/p2p.h"
#include "backend/reduce_kernels.h"
#include "backend/shm_transport.h"
#include "backend/work_queue.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
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

void check_root(const char* op, int64_t root, int size) {
  TORCH_CHECK(root >= 0 && root < size, "torch_tp backend: ", op, ": root rank ", root, " is outside the group of ",
              size);
}

void check_like(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref, int64_t numel) {
  check_tensor(op, arg, t);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "torch_tp backend: ", op, ": ", arg, " has dtype ",
              t.scalar_type(), " but the input has dtype ", ref.scalar_type());
  TORCH_CHECK(t.numel() == numel, "torch_tp backend: ", op, ": ", arg, " must have ", numel, " elements, got ",
              t.numel(), " (sizes ", t.sizes(), ")");
}

// The direct calls' tensors are [outer, rows, inner], the pieces along dim 1
// (<torch_tp/direct_collectives.h>); c10d's concatenate along dim 0.
void check_direct_call_dims(const char* op, const char* arg, const at::Tensor& t, int64_t concat_dim) {
  TORCH_CHECK(concat_dim == 0 || t.dim() == 3, "torch_tp backend: ", op, ": a direct call's ", arg,
              " must be 3-d [outer, rows, inner], got shape ", t.sizes());
}

// `outer` of Collectives' calls: 1 along dim 0, the leading size along dim 1
// (every tensor of a direct call is one call's, so the first tells).
int64_t outer_blocks(const std::vector<at::Tensor>& tensors, int64_t concat_dim) {
  return concat_dim == 0 || tensors.empty() ? 1 : tensors[0].size(0);
}

// The tensor list of a rooted call (gather's outputs, scatter's inputs): on
// the root one list of a tensor per rank, each like `ref`; elsewhere none.
void check_root_list(const char* op, const char* arg, const std::vector<std::vector<at::Tensor>>& lists,
                     const at::Tensor& ref, bool root, int rank, int size) {
  if (!root) {
    TORCH_CHECK(lists.empty() || (lists.size() == 1 && lists[0].empty()), "torch_tp backend: ", op, ": rank ", rank,
                " is not the root and must pass no ", arg, ", got ", lists.size(), " list(s)");
    return;
  }
  check_count(op, arg, lists.size(), 1);
  const std::string each = c10::str(arg, "[0]");
  check_count(op, each.c_str(), lists[0].size(), static_cast<size_t>(size));
  const std::string element = c10::str(arg, "[0][i]");
  for (const auto& t : lists[0]) {
    check_like(op, element.c_str(), t, ref, ref.numel());
  }
}

void check_reduction(const char* op, Reduction kind, at::ScalarType dtype) {
  const char* why = nullptr;
  TORCH_CHECK(reduction_supported(kind, dtype, &why), "torch_tp backend: ", op, ": reduce_op ",
              reduction_name(kind), " on dtype ", dtype, " is not supported: ", why);
}

// c10d's name of a reduce_op the backend does not fold.
const char* unsupported_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "an unknown reduce_op";
  }
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
      TORCH_CHECK(false, "torch_tp backend: ", op, ": reduce_op ", unsupported_name(reduce_op.op_), " (",
                  static_cast<int>(reduce_op.op_), ") is not supported (SUM, AVG, PRODUCT, MIN and MAX are)");
  }
  check_reduction(op, kind, dtype);
  return kind;
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
  const int num_nodes = static_cast<int>(nodes.size());
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
  if (num_nodes > 1) {
    TORCH_CHECK(options_.gloo_all, "torch_tp backend: init: the group spans ", num_nodes,
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
  // The one place that tells one node from several: every collective below
  // goes to the layer picked here.
  if (num_nodes > 1) {
    collectives_ = multi_node_collectives(*transport_, rank, size, options_.gloo_all, options_.gloo_leaders);
  } else {
    collectives_ = node_collectives(*transport_, rank, size);
  }
  // NOTE [async calls without a core to run on]: inside one node the worker
  // overlaps an op's collective with its GEMM only on a core of its own.
  // Across nodes it also overlaps gloo's network time, so it always runs.
  overlaps_async_calls_ = num_nodes > 1 || transport_->ranks_have_spare_cores();
  queue_ = std::make_shared<WorkQueue>(rank);
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
  if (queue_) {
    queue_->stop();
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
    return queue_->push(type, std::move(outputs), [run = std::move(run), seq] { run(seq); });
  }
  return queue_->run_inline_or_push(type, std::move(outputs), [run = std::move(run), seq] { run(seq); });
}

void ProcessGroupShm::call_now(const char* name, const Run& run) {
  // What c10d's op would have shown in a profiler trace (NOTE [direct calls from the ops]).
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  const uint64_t seq = ++seq_;
  queue_->run_now([&run, seq] { run(seq); });  // returns once it ran: `run` outlives the call
}

// ---- all-reduce, reduce, broadcast, barrier -------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  check_count(op, "tensors", tensors.size(), 1);
  const at::Tensor& t = tensors[0];
  if (t.is_contiguous()) {
    // The common case, reduced in place: no dense copy to make and write back,
    // and a 4 KiB call's bookkeeping is a good part of its time (NOTE
    // [synchronous calls run inline] in work_queue.h).
    check_tensor(op, "tensor", t);
    const Reduction kind = from_c10d(op, opts.reduceOp, t.scalar_type());
    return collective(c10d::OpType::ALLREDUCE, tensors, opts.asyncOp, collectives_->all_reduce_into(t, t, kind));
  }
  std::vector<at::Tensor> list = tensors;
  c10d::AllreduceCoalescedOptions coalesced;
  coalesced.reduceOp = opts.reduceOp;
  coalesced.timeout = opts.timeout;
  coalesced.asyncOp = opts.asyncOp;  // a synchronous call runs inline (NOTE in work_queue.h)
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
  return collective(c10d::OpType::ALLREDUCE, tensors, opts.asyncOp,
                    collectives_->all_reduce(std::move(dense), std::move(kinds)));
}

void ProcessGroupShm::all_reduce_now(const at::Tensor& input, const at::Tensor& output,
                                     const c10d::ReduceOp& reduce_op) {
  const char* op = "all_reduce";
  check_tensor(op, "input", input);
  check_like(op, "output", output, input, input.numel());
  TORCH_CHECK(output.is_contiguous(), "torch_tp backend: ", op, ": output must be contiguous, got strides ",
              output.strides());
  const Reduction kind = from_c10d(op, reduce_op, input.scalar_type());
  call_now("torch_tp_backend::all_reduce", collectives_->all_reduce_into(input.contiguous(), output, kind));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  check_root(op, opts.rootRank, size_);
  const Reduction kind = from_c10d(op, opts.reduceOp, tensors[0].scalar_type());
  // Only the root's tensor changes: the others reduce into a scratch copy.
  const bool root = rank_ == opts.rootRank;
  Dense dense(tensors[0]);
  at::Tensor scratch = root ? dense.work : dense.work.clone();
  return collective(c10d::OpType::REDUCE, tensors, opts.asyncOp,
                    collectives_->reduce(std::move(dense), std::move(scratch), kind, opts.rootRank));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  check_count(op, "tensors", tensors.size(), 1);
  check_tensor(op, "tensor", tensors[0]);
  check_root(op, opts.rootRank, size_);
  return collective(c10d::OpType::BROADCAST, tensors, opts.asyncOp, collectives_->broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::barrier(const c10d::BarrierOptions& opts) {
  return collective(c10d::OpType::BARRIER, {}, opts.asyncOp, collectives_->barrier());
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
  return collective(c10d::OpType::ALLGATHER, outputs[0], opts.asyncOp,
                    collectives_->all_gather(outputs, inputs, opts));
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
  return collective(c10d::OpType::_ALLGATHER_BASE, outputs, opts.asyncOp,
                    all_gather_into_tensor_run(outputs, inputs, opts, -1, 0));
}

void ProcessGroupShm::all_gather_now(const at::Tensor& input, const at::Tensor& output, int64_t dim) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  call_now("torch_tp_backend::all_gather_into_tensor",
           all_gather_into_tensor_run(outputs, inputs, c10d::AllgatherOptions(), dim, 1));
}

Run ProcessGroupShm::all_gather_into_tensor_run(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                const c10d::AllgatherOptions& opts, int64_t dim, int64_t concat_dim) {
  const char* op = "all_gather_into_tensor";
  check_count(op, "output_tensors", outputs.size(), inputs.size());
  for (const auto i : c10::irange(inputs.size())) {
    check_tensor(op, "input", inputs[i]);
    check_direct_call_dims(op, "input", inputs[i], concat_dim);
    check_like(op, "output", outputs[i], inputs[i], inputs[i].numel() * size_);
    // gloo's rule: the output is the inputs concatenated along dim 0,
    // [p * n0, n1, ..] (a 0-d input: [p]); the right numel in another shape is
    // refused, not silently filled in a different layout. The direct calls
    // concatenate along dim 1 of [outer, n, inner].
    std::vector<int64_t> expected = inputs[i].sizes().vec();
    if (expected.empty()) {
      expected.push_back(size_);
    } else {
      expected[concat_dim] *= size_;
    }
    TORCH_CHECK(outputs[i].sizes() == at::IntArrayRef(expected), "torch_tp backend: ", op, ": output has shape ",
                outputs[i].sizes(), " but an input of shape ", inputs[i].sizes(), " over ", size_,
                " ranks needs an output of shape ", at::IntArrayRef(expected), " (the inputs concatenated along dim ",
                concat_dim, ")");
  }
  const int64_t outer = outer_blocks(inputs, concat_dim);
  if (concat_dim == 1 && outer == 1) {  // one run: c10d's layout, [p * n, inner] along dim 0
    std::vector<at::Tensor> rows_out{outputs[0][0]};
    std::vector<at::Tensor> rows_in{inputs[0][0]};
    return collectives_->all_gather_into_tensor(rows_out, rows_in, opts, dim, 1);
  }
  return collectives_->all_gather_into_tensor(outputs, inputs, opts, dim, outer);
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
  check_root(op, opts.rootRank, size_);
  const bool root = rank_ == opts.rootRank;
  check_root_list(op, "output_tensors", outputs, inputs[0], root, rank_, size_);
  std::vector<at::Tensor> result = root ? outputs[0] : std::vector<at::Tensor>{};
  return collective(c10d::OpType::GATHER, result, opts.asyncOp, collectives_->gather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  check_count(op, "output_tensors", outputs.size(), 1);
  check_tensor(op, "output", outputs[0]);
  check_root(op, opts.rootRank, size_);
  check_root_list(op, "input_tensors", inputs, outputs[0], rank_ == opts.rootRank, rank_, size_);
  return collective(c10d::OpType::SCATTER, outputs, opts.asyncOp, collectives_->scatter(outputs, inputs, opts));
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
  return collective(c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp,
                    collectives_->reduce_scatter(std::move(sources), Dense(outputs[0]), kind));
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
  std::vector<Reduction> kinds;
  for (const auto& output : outputs) {
    check_tensor(op, "output", output);
    kinds.push_back(from_c10d(op, opts.reduceOp, output.scalar_type()));
  }
  return collective(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, opts.asyncOp,
                    reduce_scatter_tensor_run(outputs, inputs, std::move(kinds), -1, 0));
}

void ProcessGroupShm::reduce_scatter_now(const at::Tensor& input, const at::Tensor& output,
                                         const c10d::ReduceOp& reduce_op, int64_t dim) {
  const char* op = "reduce_scatter_tensor";
  check_tensor(op, "output", output);
  const Reduction kind = from_c10d(op, reduce_op, output.scalar_type());
  call_now("torch_tp_backend::reduce_scatter_tensor",
           reduce_scatter_tensor_run({output}, {input}, {kind}, dim, 1));
}

// kinds[i] is checked against outputs[i]'s dtype.
Run ProcessGroupShm::reduce_scatter_tensor_run(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs, std::vector<Reduction> kinds,
                                               int64_t dim, int64_t concat_dim) {
  const char* op = "reduce_scatter_tensor";
  std::vector<at::Tensor> sources;
  std::vector<Dense> targets;
  for (const auto i : c10::irange(inputs.size())) {
    check_like(op, "input", inputs[i], outputs[i], outputs[i].numel() * size_);
    if (concat_dim == 1) {  // input [outer, p * n, inner] -> output [outer, n, inner]
      check_direct_call_dims(op, "output", outputs[i], concat_dim);
      std::vector<int64_t> expected = outputs[i].sizes().vec();
      expected[1] *= size_;
      TORCH_CHECK(inputs[i].sizes() == at::IntArrayRef(expected), "torch_tp backend: ", op, ": input has shape ",
                  inputs[i].sizes(), " but an output of shape ", outputs[i].sizes(), " over ", size_,
                  " ranks needs an input of shape ", at::IntArrayRef(expected), " (the pieces along dim 1)");
    }
    sources.push_back(inputs[i].contiguous());
    targets.emplace_back(outputs[i]);
  }
  return collectives_->reduce_scatter_tensor(std::move(sources), std::move(targets), std::move(kinds), dim,
                                             outer_blocks(outputs, concat_dim));
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
  return collective(c10d::OpType::ALLTOALL_BASE, {output}, opts.asyncOp,
                    collectives_->all_to_all_single(output, input, output_split_sizes, input_split_sizes, out_splits,
                                                    in_splits, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  check_count(op, "output_tensors", outputs.size(), static_cast<size_t>(size_));
  check_count(op, "input_tensors", inputs.size(), static_cast<size_t>(size_));
  for (const auto r : c10::irange(size_)) {
    check_tensor(op, "input_tensors[i]", inputs[r]);
    check_tensor(op, "output_tensors[i]", outputs[r]);
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "torch_tp backend: ", op, ": every input and output tensor must have dtype ",
                inputs[0].scalar_type(), ", got input ", inputs[r].scalar_type(), " and output ",
                outputs[r].scalar_type(), " at index ", r);
  }
  return collective(c10d::OpType::ALLTOALL, outputs, opts.asyncOp, collectives_->all_to_all(outputs, inputs, opts));
}

bool ProcessGroupShm::all_to_all_pieces_now(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                                            const std::vector<int64_t>& recv_rows, AllToAllPieces& pieces) {
  const char* op = "all_to_all_single";
  check_tensor(op, "rows", rows);
  check_count(op, "send_rows", send_rows.size(), static_cast<size_t>(size_));
  check_count(op, "recv_rows", recv_rows.size(), static_cast<size_t>(size_));
  Run run = collectives_->all_to_all_pieces(rows, send_rows, recv_rows, pieces);
  if (!run) {
    return false;
  }
  call_now("torch_tp_backend::all_to_all_single", run);
  return true;
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
