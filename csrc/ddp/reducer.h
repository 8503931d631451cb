#pragma once
// DDP-style gradient bucketing: the reducer behind torch_tp.DistributedDataParallel.
//
// The reducer owns flat per-bucket gradient buffers. A post-hook on every
// parameter's AccumulateGrad node copies the freshly accumulated gradient into
// its bucket (divided by the world size), and a bucket's all-reduce starts as
// soon as its last gradient is in, in bucket order, while the rest of the
// backward runs. A callback queued on the autograd engine waits for every
// bucket at the end of backward and writes the averaged gradients back to
// `.grad` (or leaves `.grad` a view into the bucket). torch's
// c10d::Reducer (torch/csrc/distributed/c10d/reducer.cpp) is the reference;
// see NOTE [bitwise agreement with torch DDP] in reducer.cpp for what is
// matched exactly and why.
//
// This header is deliberately light (no autograd or c10d headers): the
// implementation lives behind the abstract Reducer, made by make_reducer().

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_tp::ddp {

// torch's defaults (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES and
// DistributedDataParallel's bucket_cap_mb=25).
constexpr int64_t kDefaultFirstBucketBytes = 1024 * 1024;
constexpr int64_t kDefaultBucketBytesCap = 25 * 1024 * 1024;

// Buckets as lists of tensor indices, and the size limit each bucket was cut at.
struct BucketAssignment {
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> size_limits;
};

// Groups `tensors` into buckets per (dtype, device): tensors are taken in
// `order` (indices into `tensors`; empty means 0..n-1), a bucket is closed as
// soon as its bytes reach its limit, and the limits of one (dtype, device) are
// `size_limits` in turn, the last one repeating (so {1 MiB, 25 MiB} gives a
// first bucket of about 1 MiB and 25 MiB ones after it). Without `order` the
// buckets are sorted by their smallest index; with it they stay in the order
// they were closed (then the order is the gradient-ready order). The same
// contract as torch.distributed._compute_bucket_assignment_by_size for dense tensors.
BucketAssignment compute_bucket_assignment(const std::vector<at::Tensor>& tensors,
                                           const std::vector<size_t>& size_limits,
                                           const std::vector<int64_t>& order = {});

// The built-in communication hooks (torch's default_hooks, run in C++).
enum class BuiltinCommHook {
  kAllReduce,     // default_hooks.allreduce_hook: divide the bucket, sum all-reduce
  kFp16Compress,  // default_hooks.fp16_compress_hook: all-reduce a float16 copy
  kBf16Compress,  // default_hooks.bf16_compress_hook: all-reduce a bfloat16 copy
  // torch DDP's mixed_precision hook (_reducer_allreduce_and_upcast_hook):
  // all-reduce a copy in ReducerOptions::reduce_dtype, divide after. Set by
  // ReducerOptions::mixed_precision, never registered by name.
  kMixedPrecision,
};

// What a user communication hook sees: torch.distributed.GradBucket's fields.
struct GradBucket {
  size_t index;
  size_t num_buckets;
  at::Tensor buffer;                   // flat, the bucket's gradients undivided
  std::vector<at::Tensor> parameters;  // in bucket order
  std::vector<int64_t> offsets;        // of each parameter's gradient in `buffer`
  std::vector<int64_t> lengths;
};

// A reduction in flight: blocks until done and returns the reduced flat buffer
// (same number of elements as the bucket).
using PendingReduction = std::function<at::Tensor()>;
// A user hook: starts the reduction of one bucket.
using CommHook = std::function<PendingReduction(GradBucket&)>;

struct ReducerOptions {
  int64_t bucket_bytes_cap = kDefaultBucketBytesCap;
  int64_t first_bucket_bytes_cap = kDefaultFirstBucketBytes;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // DistributedDataParallel(mixed_precision=...): reduce the buckets with
  // BuiltinCommHook::kMixedPrecision, in `reduce_dtype` (the bucket's own
  // dtype when unset). A user comm hook can then not be registered, as in torch.
  bool mixed_precision = false;
  std::optional<c10::ScalarType> reduce_dtype;
};

class Reducer {
 public:
  virtual ~Reducer() = default;

  // Before each forward whose backward will be synchronized: raises if the
  // previous synchronized backward never finished, and rebuilds the buckets
  // in gradient-ready order once, after the first synchronized backward
  // (rank 0's order, broadcast, so every rank builds the same buckets).
  virtual void prepare_for_forward() = 0;
  // After that forward: the hooks fire in the coming backward. With
  // find_unused_parameters, `outputs` are searched for the parameters the
  // autograd graph does not reach; they are marked ready at the first hook.
  virtual void prepare_for_backward(const std::vector<at::Tensor>& outputs) = 0;

  // Divide the gradients of the next synchronized backward by `divisor`
  // instead of the group size (join(divide_by_initial_world_size=False): the
  // number of ranks still training). As torch's div_factor, it applies where
  // the reducer divides (no comm hook); the hooks divide by the group size.
  virtual void set_divisor(int64_t divisor) = 0;
  // On a rank that has run out of inputs under DistributedDataParallel.join():
  // issue the collectives of a synchronized backward with zero gradients, in
  // the current bucket order (through the comm hook, if any), then the
  // used-parameter map's all-reduce (find_unused_parameters or static_graph),
  // and wait for them. The rank's own gradients are not touched.
  virtual void join_backward() = 0;

  virtual void register_builtin_comm_hook(BuiltinCommHook hook) = 0;
  virtual void register_comm_hook(CommHook hook) = 0;

  // The current buckets, as parameter indices in bucket order.
  virtual std::vector<std::vector<size_t>> bucket_indices() const = 0;
  // Parameter indices in the order their gradients became ready in the last
  // synchronized backward.
  virtual std::vector<int64_t> grad_ready_order() const = 0;
  virtual bool has_rebuilt_buckets() const = 0;
};

// `params`: the parameters to reduce, deduplicated, in registration order;
// `names`: their qualified names (for error messages). The group is looked up
// by name in c10d's registry, as the ops do.
std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                      const std::string& group_name, const ReducerOptions& options);

// Broadcasts `tensors` in place from group rank `src`, coalesced into flat
// buffers of at most `bucket_bytes` per (dtype, device).
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& group_name, int64_t src,
                         int64_t bucket_bytes);

} // namespace torch_tp::ddp
