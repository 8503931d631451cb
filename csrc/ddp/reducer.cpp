#include "ddp/reducer.h"

#include "ops/common.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <utility>

// NOTE [bitwise agreement with torch DDP]
// On the same backend, bucket layout and inputs, the averaged gradients are
// bitwise torch DDP's. What that takes:
//  * the same flat buffers: the same initial assignment (one bucket holding
//    every parameter in registration order for the first iteration, unless
//    find_unused_parameters, which starts from 1 MiB / bucket_cap_mb buckets
//    in reverse registration order), and the same rebuild after the first
//    synchronized backward (gradient-ready order, caps {first, cap}), because
//    a ring all-reduce sums an element in an order that depends on where it
//    lies in the buffer;
//  * the same division: the gradient is multiplied by a wrapped scalar
//    1/world_size while it is copied into the bucket (at::mul_out), not
//    divided afterwards; with a comm hook the copy is plain and the hook
//    divides, as torch's default hooks do;
//  * the same write-back: copy into an existing .grad, or a clone that obeys
//    the gradient layout contract.

namespace torch_tp::ddp {
namespace {

constexpr const char* kOp = "torch_tp.DistributedDataParallel";

// The grad accumulator's pointer type: a shared_ptr before torch 2.14, an
// intrusive_ptr since; taken from the function so both build.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

struct BucketKey {
  c10::ScalarType dtype;
  c10::Device device;
  bool operator==(const BucketKey& other) const { return dtype == other.dtype && device == other.device; }
};

// A view of `flat` shaped like `param`: the param's own strides when it is
// dense (AccumulateGrad makes gradients with them, so copies in and out are
// straight), contiguous otherwise. torch's "gradient layout contract".
at::Tensor view_like(const at::Tensor& flat, const at::Tensor& param, int64_t offset) {
  if (param.is_non_overlapping_and_dense()) {
    return flat.as_strided(param.sizes(), param.strides(), offset);
  }
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

class ReducerImpl;

// Runs after AccumulateGrad has stored the parameter's gradient in `.grad`.
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(ReducerImpl* reducer, size_t index) : reducer_(reducer), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override;

 private:
  ReducerImpl* reducer_;
  size_t index_;
};

struct Bucket {
  std::vector<size_t> params;  // parameter indices
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  at::Tensor buffer;               // flat gradients of every parameter in the bucket
  std::vector<at::Tensor> views;   // one per parameter, into `buffer`
  size_t pending = 0;              // gradients still to come in this backward
  PendingReduction reduction;      // set once the bucket's reduction started
};

struct Locator {
  size_t bucket;
  size_t slot;
};

class ReducerImpl final : public Reducer {
 public:
  ReducerImpl(std::vector<at::Tensor> params, std::vector<std::string> names, const std::string& group_name,
              const ReducerOptions& options)
      : params_(std::move(params)),
        names_(std::move(names)),
        group_(resolve_group(kOp, group_name)),
        options_(options),
        world_size_(group_->getSize()),
        divisor_(world_size_) {
    TORCH_CHECK(!params_.empty(), kOp, ": no parameter requires a gradient; there is nothing to reduce");
    TORCH_CHECK(names_.size() == params_.size(), kOp, ": ", names_.size(), " names for ", params_.size(),
                " parameters");
    TORCH_CHECK(options_.bucket_bytes_cap > 0 && options_.first_bucket_bytes_cap > 0, kOp,
                ": bucket_bytes_cap=", options_.bucket_bytes_cap, " and first_bucket_bytes_cap=",
                options_.first_bucket_bytes_cap, " must be positive");
    for (const auto i : c10::irange(params_.size())) {
      const at::Tensor& p = params_[i];
      TORCH_CHECK(p.is_leaf() && p.requires_grad(), kOp, ": parameter '", names_[i],
                  "' must be a leaf tensor that requires grad");
      TORCH_CHECK(!p.is_sparse(), kOp, ": parameter '", names_[i], "' is sparse; sparse gradients are not supported");
    }

    // NOTE [first-iteration buckets] torch starts with one bucket holding
    // every parameter (registration order) unless find_unused_parameters is
    // set without static_graph: before the first backward the order in which
    // gradients arrive is unknown, and a guessed order can launch a bucket's
    // all-reduce early on one rank, interleaving with other collectives in
    // the backward (TP's) differently on different ranks. One bucket waits for
    // every gradient. The buckets are rebuilt in the observed order afterwards.
    std::vector<size_t> limits;
    if (options_.find_unused_parameters && !options_.static_graph) {
      if (options_.first_bucket_bytes_cap < options_.bucket_bytes_cap) {
        limits = {static_cast<size_t>(options_.first_bucket_bytes_cap), static_cast<size_t>(options_.bucket_bytes_cap)};
      } else {
        limits = {static_cast<size_t>(options_.bucket_bytes_cap)};
      }
    } else {
      limits = {static_cast<size_t>(std::numeric_limits<int64_t>::max())};
    }
    // Sorted by smallest index, then reversed: the last-registered parameters,
    // whose gradients come first in backward, go into the first bucket.
    auto assignment = compute_bucket_assignment(params_, limits);
    std::reverse(assignment.buckets.begin(), assignment.buckets.end());
    initialize_buckets(std::move(assignment.buckets));

    // Hooks on the AccumulateGrad nodes. The nodes are held here: a leaf keeps
    // only a weak reference to its accumulator, which autograd would
    // otherwise recreate (without our hook) for every graph.
    accumulators_.reserve(params_.size());
    hook_keys_.reserve(params_.size());
    for (const auto i : c10::irange(params_.size())) {
      NodePtr accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_INTERNAL_ASSERT(accumulator, "no grad accumulator for parameter ", names_[i]);
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i)));
      accumulators_.push_back(std::move(accumulator));
    }
    ready_.assign(params_.size(), false);
    if (tracks_usage()) {
      local_used_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    }
    if (options_.mixed_precision) {
      builtin_hook_ = BuiltinCommHook::kMixedPrecision;
    }
  }

  ~ReducerImpl() override {
    // The module outlives its wrapper: take the hooks off so that a later
    // backward does not call into a destroyed reducer.
    for (const auto i : c10::irange(accumulators_.size())) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }

  void prepare_for_forward() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!has_rebuilt_ && !rebuild_order_.empty()) {
      rebuild_buckets();
    }
  }

  void prepare_for_backward(const std::vector<at::Tensor>& outputs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    expect_hooks_ = true;
    callback_queued_ = false;
    next_bucket_ = 0;
    std::fill(ready_.begin(), ready_.end(), false);
    grad_order_.clear();
    for (auto& bucket : buckets_) {
      bucket.pending = bucket.params.size();
      bucket.reduction = nullptr;
    }
    unused_.clear();
    if (tracks_usage()) {
      local_used_.zero_();
      search_unused_parameters(outputs);
    }
  }

  void set_divisor(int64_t divisor) override {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(divisor >= 1 && divisor <= world_size_, kOp, ": divisor=", divisor,
                " must be between 1 and the group size ", world_size_);
    divisor_ = divisor;
  }

  void join_backward() override {
    std::lock_guard<std::mutex> lock(mutex_);
    // NOTE [joined ranks] The ranks still training all-reduce every bucket,
    // in bucket order, and then the used-parameter map; a joined rank issues
    // the same collectives, contributing zeros (so the sum is over the ranks
    // still training), on buffers of its own: with gradient_as_bucket_view
    // the real buckets are its .grad.
    std::vector<PendingReduction> pending;
    pending.reserve(buckets_.size());
    for (const auto b : c10::irange(buckets_.size())) {
      pending.push_back(start_reduction(b, at::zeros_like(buckets_[b].buffer)));
    }
    c10::intrusive_ptr<c10d::Work> used_work;
    if (tracks_usage()) {
      std::vector<at::Tensor> tensors{at::zeros_like(local_used_).to(params_.front().device())};
      c10::OptionalDeviceGuard guard(tensors.front().device());
      used_work = group_->allreduce(tensors);
    }
    for (auto& reduction : pending) {
      reduction();
    }
    if (used_work) {
      used_work->wait();
    }
    // A rank that joined before its first synchronized backward has no
    // gradient order to offer the bucket rebuild; it offers registration
    // order (torch's _push_all_rebuilt_params), which matters only if it is
    // rank 0, whose order every rank uses.
    if (should_rebuild() && rebuild_order_.empty()) {
      for (const auto i : c10::irange(params_.size())) {
        rebuild_order_.push_back(static_cast<int64_t>(i));
      }
    }
  }

  void register_builtin_comm_hook(BuiltinCommHook hook) override {
    std::lock_guard<std::mutex> lock(mutex_);
    check_no_hook();
    builtin_hook_ = hook;
  }

  void register_comm_hook(CommHook hook) override {
    std::lock_guard<std::mutex> lock(mutex_);
    check_no_hook();
    TORCH_CHECK(hook, kOp, ": register_comm_hook got an empty hook");
    custom_hook_ = std::move(hook);
  }

  std::vector<std::vector<size_t>> bucket_indices() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::vector<size_t>> result;
    result.reserve(buckets_.size());
    for (const auto& bucket : buckets_) {
      result.push_back(bucket.params);
    }
    return result;
  }

  std::vector<int64_t> grad_ready_order() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return grad_order_;
  }

  bool has_rebuilt_buckets() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return has_rebuilt_;
  }

  // Called by ReadyHook from the autograd engine, after AccumulateGrad.
  void autograd_hook(size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Outside a synchronized backward (no_sync, or a backward of a graph made
    // without a DDP forward) the gradient simply stays accumulated in .grad.
    if (!expect_hooks_) {
      return;
    }
    if (tracks_usage() && params_[index].grad().defined()) {
      local_used_.data_ptr<int32_t>()[index] = 1;
    }
    if (!callback_queued_) {
      // NOTE [end of backward] The finalizer is queued at the first hook, not
      // (as torch does) once the last bucket is launched: then a backward that
      // leaves some parameter without a gradient still reaches the finalizer,
      // which names the parameters and raises there, instead of the next
      // forward raising (torch) or the buckets never being reduced.
      callback_queued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
      for (const size_t unused : unused_) {
        mark_ready(unused);
      }
    }
    grad_order_.push_back(static_cast<int64_t>(index));
    mark_ready(index);
  }

 private:
  bool tracks_usage() const { return options_.find_unused_parameters || options_.static_graph; }
  bool should_rebuild() const {
    return !has_rebuilt_ && (options_.static_graph || !options_.find_unused_parameters);
  }
  bool has_hook() const { return builtin_hook_.has_value() || static_cast<bool>(custom_hook_); }

  void check_no_hook() const {
    TORCH_CHECK(!has_hook(), kOp, ": register_comm_hook can only be called once");
  }

  void initialize_buckets(std::vector<std::vector<size_t>> assignment) {
    std::vector<Bucket> buckets;
    buckets.reserve(assignment.size());
    locators_.assign(params_.size(), Locator{0, 0});
    for (const auto b : c10::irange(assignment.size())) {
      Bucket bucket;
      bucket.params = std::move(assignment[b]);
      TORCH_INTERNAL_ASSERT(!bucket.params.empty());
      const at::Tensor& first = params_[bucket.params.front()];
      int64_t offset = 0;
      for (const auto slot : c10::irange(bucket.params.size())) {
        const at::Tensor& p = params_[bucket.params[slot]];
        TORCH_INTERNAL_ASSERT(p.scalar_type() == first.scalar_type() && p.device() == first.device());
        bucket.offsets.push_back(offset);
        bucket.lengths.push_back(p.numel());
        locators_[bucket.params[slot]] = Locator{b, slot};
        offset += p.numel();
      }
      bucket.buffer = at::empty({offset}, first.options().requires_grad(false));
      for (const auto slot : c10::irange(bucket.params.size())) {
        const size_t index = bucket.params[slot];
        bucket.views.push_back(view_like(bucket.buffer, params_[index], bucket.offsets[slot]));
        // A gradient left as a view into the old buckets moves into the new ones.
        if (options_.gradient_as_bucket_view) {
          at::Tensor& grad = params_[index].mutable_grad();
          if (grad.defined() && !grad.is_alias_of(bucket.views.back())) {
            bucket.views.back().copy_(grad);
            grad = bucket.views.back();
          }
        }
      }
      bucket.pending = bucket.params.size();
      buckets.push_back(std::move(bucket));
    }
    buckets_ = std::move(buckets);
  }

  void rebuild_buckets() {
    TORCH_INTERNAL_ASSERT(rebuild_order_.size() == params_.size(), "gradient order of ", rebuild_order_.size(),
                          " parameters for ", params_.size());
    // NOTE [same buckets on every rank] Ranks can see gradients arrive in
    // different orders (threads, data-dependent control flow); buckets that
    // differ between ranks would all-reduce unrelated bytes. Rank 0's order
    // is broadcast and every rank cuts the same buckets from it.
    at::Tensor order = at::tensor(rebuild_order_, at::kLong);
    if (world_size_ > 1) {
      at::Tensor on_device = order.to(params_.front().device());
      std::vector<at::Tensor> tensors{on_device};
      c10::OptionalDeviceGuard guard(on_device.device());
      group_->broadcast(tensors, c10d::BroadcastOptions())->wait();
      order = on_device.cpu();
    }
    std::vector<int64_t> rank0_order(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
    auto assignment = compute_bucket_assignment(
        params_,
        {static_cast<size_t>(options_.first_bucket_bytes_cap), static_cast<size_t>(options_.bucket_bytes_cap)},
        rank0_order);
    initialize_buckets(std::move(assignment.buckets));
    has_rebuilt_ = true;
    rebuild_order_.clear();
  }

  // Parameters whose AccumulateGrad the graph from `outputs` does not reach
  // get no gradient in this backward; they are marked ready at the first hook.
  void search_unused_parameters(const std::vector<at::Tensor>& outputs) {
    std::unordered_set<torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    for (const auto& output : outputs) {
      if (output.defined() && output.grad_fn()) {
        auto* fn = output.grad_fn().get();
        if (seen.insert(fn).second) {
          stack.push_back(fn);
        }
      }
    }
    while (!stack.empty()) {
      torch::autograd::Node* fn = stack.back();
      stack.pop_back();
      for (const auto& edge : fn->next_edges()) {
        torch::autograd::Node* next = edge.function.get();
        if (next != nullptr && seen.insert(next).second) {
          stack.push_back(next);
        }
      }
    }
    for (const auto i : c10::irange(params_.size())) {
      if (seen.count(accumulators_[i].get()) == 0) {
        unused_.push_back(i);
      }
    }
  }

  void mark_ready(size_t index) {
    TORCH_CHECK(!ready_[index], kOp, ": parameter '", names_[index], "' (index ", index,
                ") was marked ready twice in one backward: several autograd hooks fired for it. Common causes: "
                "the parameter is used outside the forward, or in several reentrant backward passes "
                "(checkpointing the same module twice), or find_unused_parameters=True thought it unused "
                "but it received a gradient after all.");
    ready_[index] = true;
    const Locator& at = locators_[index];
    Bucket& bucket = buckets_[at.bucket];
    copy_into_bucket(index, bucket, at.slot);
    if (--bucket.pending == 0) {
      launch_ready_buckets();
    }
  }

  void copy_into_bucket(size_t index, Bucket& bucket, size_t slot) {
    at::Tensor& grad = params_[index].mutable_grad();
    at::Tensor& view = bucket.views[slot];
    if (!grad.defined()) {
      // No gradient here (unused on this rank): contribute zeros.
      view.zero_();
      return;
    }
    TORCH_CHECK(grad.scalar_type() == view.scalar_type() && grad.device() == view.device() &&
                    grad.sizes() == view.sizes(),
                kOp, ": the gradient of '", names_[index], "' is ", grad.toString(), " of shape ", grad.sizes(),
                " but its bucket holds ", view.toString(), " of shape ", view.sizes());
    if (grad.is_alias_of(view)) {
      // gradient_as_bucket_view: AccumulateGrad wrote into the bucket already.
      if (!has_hook()) {
        view.div_(divisor_);
      }
      return;
    }
    if (has_hook()) {
      view.copy_(grad);
    } else {
      // Divide while copying: one pass over the gradient (see NOTE [bitwise
      // agreement with torch DDP] for why a multiplication by a wrapped scalar).
      at::mul_out(view, grad, at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(divisor_)));
    }
    if (options_.gradient_as_bucket_view) {
      grad = view;
    }
  }

  // Buckets are reduced strictly in bucket order, so that every rank issues
  // the same sequence of collectives whatever order its gradients arrive in.
  void launch_ready_buckets() {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
      launch(next_bucket_);
      ++next_bucket_;
    }
    if (next_bucket_ == buckets_.size() && tracks_usage()) {
      // Which parameters got a gradient on some rank: a parameter unused
      // everywhere keeps its .grad untouched (torch's semantics).
      used_map_ = local_used_.to(params_.front().device());
      std::vector<at::Tensor> tensors{used_map_};
      c10::OptionalDeviceGuard guard(used_map_.device());
      used_work_ = group_->allreduce(tensors);
    }
  }

  void launch(size_t b) {
    Bucket& bucket = buckets_[b];
    bucket.reduction = start_reduction(b, bucket.buffer);
  }

  // Starts the reduction of bucket `b`'s layout held in `buffer` (the
  // bucket's own buffer, or zeros for a joined rank).
  PendingReduction start_reduction(size_t b, at::Tensor buffer) {
    const Bucket& bucket = buckets_[b];
    c10::OptionalDeviceGuard guard(buffer.device());
    if (custom_hook_) {
      GradBucket grad_bucket{b, buckets_.size(), buffer, {}, bucket.offsets, bucket.lengths};
      for (const size_t index : bucket.params) {
        grad_bucket.parameters.push_back(params_[index]);
      }
      PendingReduction reduction = custom_hook_(grad_bucket);
      TORCH_CHECK(reduction, kOp, ": the communication hook returned nothing for bucket ", b);
      return reduction;
    }
    at::Tensor wire = buffer;  // what goes over the network
    bool divide_after = false;
    if (builtin_hook_ == BuiltinCommHook::kAllReduce) {
      buffer.div_(world_size_);
    } else if (builtin_hook_ == BuiltinCommHook::kFp16Compress || builtin_hook_ == BuiltinCommHook::kBf16Compress) {
      const auto dtype = builtin_hook_ == BuiltinCommHook::kFp16Compress ? at::kHalf : at::kBFloat16;
      wire = buffer.to(dtype).div_(world_size_);
    } else if (builtin_hook_ == BuiltinCommHook::kMixedPrecision) {
      // As torch's mixed-precision hook: sum in reduce_dtype, then divide.
      if (options_.reduce_dtype) {
        wire = buffer.to(*options_.reduce_dtype);
      }
      divide_after = true;
    }
    std::vector<at::Tensor> tensors{wire};
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = group_->allreduce(tensors);
    } catch (c10::Error& e) {
      e.add_context(c10::str(kOp, ": all-reduce of bucket ", b, " (", wire.numel(), " elements of ",
                             wire.scalar_type(), ") on the ", group_->getBackendName(), " backend of group '",
                             group_->getGroupName(), "' failed"));
      throw;
    }
    const int64_t world_size = world_size_;
    return [work, wire, buffer, divide_after, world_size]() mutable {
      work->wait();
      if (divide_after) {
        wire.div_(world_size);
      }
      if (!wire.is_same(buffer)) {
        buffer.copy_(wire);  // decompress
      }
      return buffer;
    };
  }

  void finalize_backward() {
    std::lock_guard<std::mutex> lock(mutex_);
    callback_queued_ = false;
    if (!expect_hooks_) {
      return;
    }
    expect_hooks_ = false;
    divisor_ = world_size_;  // set_divisor holds for one backward
    if (next_bucket_ < buckets_.size()) {
      raise_unready();
    }
    std::optional<at::Tensor> global_used;  // fetched lazily, only if some parameter was unused here
    for (auto& bucket : buckets_) {
      at::Tensor result = bucket.reduction();
      bucket.reduction = nullptr;
      TORCH_CHECK(result.defined() && result.numel() == bucket.buffer.numel(), kOp,
                  ": the communication hook's result for a bucket of ", bucket.buffer.numel(), " elements has ",
                  result.defined() ? result.numel() : 0, " elements");
      result = result.reshape({-1});
      for (const auto slot : c10::irange(bucket.params.size())) {
        const size_t index = bucket.params[slot];
        bool global_unused = false;
        if (tracks_usage() && local_used_.data_ptr<int32_t>()[index] == 0) {
          if (!global_used) {
            used_work_->wait();
            global_used = used_map_.cpu();
          }
          global_unused = global_used->data_ptr<int32_t>()[index] == 0;
        }
        write_back(index, bucket, slot, result, global_unused);
      }
    }
    if (tracks_usage() && !global_used) {
      used_work_->wait();  // the map's buffer is reused next iteration
    }
    used_work_.reset();
    if (should_rebuild()) {
      rebuild_order_ = grad_order_;
      if (options_.static_graph) {
        // static_graph: parameters unused in this iteration stay unused; they go last.
        for (const size_t unused : unused_) {
          rebuild_order_.push_back(static_cast<int64_t>(unused));
        }
      }
    }
  }

  void write_back(size_t index, Bucket& bucket, size_t slot, const at::Tensor& result, bool global_unused) {
    at::Tensor& grad = params_[index].mutable_grad();
    at::Tensor& view_in = bucket.views[slot];
    const at::Tensor view_out =
        result.is_alias_of(bucket.buffer) && result.data_ptr() == bucket.buffer.data_ptr()
            ? view_in
            : view_like(result, params_[index], bucket.offsets[slot]);
    if (options_.gradient_as_bucket_view) {
      if (!view_out.is_alias_of(view_in)) {
        view_in.copy_(view_out);
      }
      if (global_unused) {
        return;
      }
      if (!grad.defined()) {
        grad = view_in;
      }
      TORCH_CHECK(grad.is_alias_of(view_in), kOp, ": with gradient_as_bucket_view=True the .grad of '",
                  names_[index], "' is no longer a view into its bucket (was it replaced during backward, "
                  "or hooked twice?)");
      return;
    }
    if (global_unused) {
      return;
    }
    if (!grad.defined()) {
      grad = torch::autograd::utils::clone_obey_contract(view_out, params_[index]);
    } else {
      grad.copy_(view_out);
    }
  }

  [[noreturn]] void raise_unready() {
    std::vector<size_t> missing;
    std::string names;
    for (const auto i : c10::irange(params_.size())) {
      if (!ready_[i]) {
        names += (missing.empty() ? "" : ", ") + names_[i];
        missing.push_back(i);
      }
    }
    // The launched buckets' reductions are dropped: their collectives finish
    // on their own (the Work keeps the buffers alive).
    for (auto& bucket : buckets_) {
      bucket.reduction = nullptr;
    }
    const std::string hint =
        options_.find_unused_parameters
            ? "Since `find_unused_parameters=True` is enabled, this likely means that not all `forward` outputs "
              "participate in computing loss. You can fix this by making sure all `forward` function outputs "
              "participate in calculating loss."
            : "You can enable unused parameter detection by passing the keyword argument "
              "`find_unused_parameters=True` to `torch_tp.DistributedDataParallel`, and by making sure all "
              "`forward` function outputs participate in calculating loss.";
    TORCH_CHECK(false, kOp, ": backward finished on rank ", group_->getRank(), " but ", missing.size(),
                " parameter(s) received no gradient, so their buckets could not be reduced. This error "
                "indicates that your module has parameters that were not used in producing loss. ",
                hint, "\nParameters which did not receive grad for rank ", group_->getRank(), ": ", names,
                "\nParameter indices which did not receive grad for rank ", group_->getRank(), ": ",
                c10::ArrayRef<size_t>(missing));
  }

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;
  int64_t world_size_;
  int64_t divisor_;  // what the reducer divides the gradients by (set_divisor)

  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  mutable std::mutex mutex_;
  std::vector<Bucket> buckets_;
  std::vector<Locator> locators_;
  std::optional<BuiltinCommHook> builtin_hook_;
  CommHook custom_hook_;

  // Per synchronized backward.
  bool expect_hooks_ = false;
  bool callback_queued_ = false;
  size_t next_bucket_ = 0;
  std::vector<bool> ready_;
  std::vector<int64_t> grad_order_;
  std::vector<size_t> unused_;
  at::Tensor local_used_;  // int32 [n] on the CPU: 1 where this rank produced a gradient
  at::Tensor used_map_;    // its all-reduced copy
  c10::intrusive_ptr<c10d::Work> used_work_;

  // Bucket rebuild after the first synchronized backward.
  bool has_rebuilt_ = false;
  std::vector<int64_t> rebuild_order_;
};

torch::autograd::variable_list ReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                     const torch::autograd::variable_list& /*inputs*/) {
  reducer_->autograd_hook(index_);
  return outputs;
}

} // namespace

BucketAssignment compute_bucket_assignment(const std::vector<at::Tensor>& tensors,
                                           const std::vector<size_t>& size_limits,
                                           const std::vector<int64_t>& order) {
  TORCH_CHECK(!size_limits.empty(), "compute_bucket_assignment: size_limits must not be empty");
  TORCH_CHECK(order.empty() || order.size() == tensors.size(), "compute_bucket_assignment: order has ",
              order.size(), " indices for ", tensors.size(), " tensors");
  struct Open {
    BucketKey key;
    std::vector<size_t> indices;
    size_t bytes = 0;
    size_t limit_index = 0;  // into size_limits; sticks at the last one
  };
  std::vector<Open> open;  // one per (dtype, device), in order of first appearance
  BucketAssignment result;
  auto close = [&](Open& bucket) {
    result.buckets.push_back(std::move(bucket.indices));
    result.size_limits.push_back(size_limits[bucket.limit_index]);
    bucket.indices.clear();
    bucket.bytes = 0;
  };
  std::vector<bool> seen(tensors.size(), false);
  for (const auto position : c10::irange(tensors.size())) {
    const int64_t index = order.empty() ? static_cast<int64_t>(position) : order[position];
    TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < tensors.size() && !seen[index],
                "compute_bucket_assignment: order[", position, "]=", index,
                " is out of range or repeated for ", tensors.size(), " tensors");
    seen[index] = true;
    const at::Tensor& tensor = tensors[index];
    TORCH_CHECK(!tensor.is_sparse(), "compute_bucket_assignment: tensor ", index,
                " is sparse; sparse gradients are not supported");
    const BucketKey key{tensor.scalar_type(), tensor.device()};
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) { return o.key == key; });
    if (it == open.end()) {
      open.push_back(Open{key, {}, 0, 0});
      it = std::prev(open.end());
    }
    it->indices.push_back(static_cast<size_t>(index));
    it->bytes += static_cast<size_t>(tensor.numel()) * tensor.element_size();
    if (it->bytes >= size_limits[it->limit_index]) {
      // The bucket closes at the limit it was cut at; the next one of this
      // (dtype, device) takes the next limit.
      close(*it);
      it->limit_index = std::min(it->limit_index + 1, size_limits.size() - 1);
    }
  }
  for (auto& bucket : open) {
    if (!bucket.indices.empty()) {
      close(bucket);
    }
  }
  if (order.empty()) {
    // Registration order approximates use order: sort the buckets by their
    // first tensor so that they become ready one after the other.
    std::vector<size_t> permutation(result.buckets.size());
    for (const auto i : c10::irange(permutation.size())) {
      permutation[i] = i;
    }
    auto first = [&](size_t b) { return *std::min_element(result.buckets[b].begin(), result.buckets[b].end()); };
    std::sort(permutation.begin(), permutation.end(), [&](size_t a, size_t b) { return first(a) < first(b); });
    BucketAssignment sorted;
    for (const size_t b : permutation) {
      sorted.buckets.push_back(std::move(result.buckets[b]));
      sorted.size_limits.push_back(result.size_limits[b]);
    }
    return sorted;
  }
  return result;
}

std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                      const std::string& group_name, const ReducerOptions& options) {
  return std::make_unique<ReducerImpl>(std::move(params), std::move(names), group_name, options);
}

void broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& group_name, int64_t src,
                         int64_t bucket_bytes) {
  auto group = resolve_group(kOp, group_name);
  TORCH_CHECK(src >= 0 && src < group->getSize(), kOp, ": broadcast source rank ", src, " is out of range for a group of ",
              group->getSize());
  TORCH_CHECK(bucket_bytes > 0, kOp, ": bucket_bytes=", bucket_bytes, " must be positive");
  if (group->getSize() == 1 || tensors.empty()) {
    return;
  }
  // Flat buffers of one (dtype, device), at most bucket_bytes each (one
  // tensor at least), in the given order on every rank.
  at::NoGradGuard no_grad;
  std::vector<size_t> remaining(tensors.size());
  for (const auto i : c10::irange(tensors.size())) {
    remaining[i] = i;
  }
  while (!remaining.empty()) {
    const at::Tensor& lead = tensors[remaining.front()];
    std::vector<size_t> chunk;
    std::vector<size_t> rest;
    int64_t bytes = 0;
    for (const size_t i : remaining) {
      const at::Tensor& t = tensors[i];
      const int64_t size = t.numel() * static_cast<int64_t>(t.element_size());
      const bool fits = chunk.empty() || bytes + size <= bucket_bytes;
      if (t.scalar_type() == lead.scalar_type() && t.device() == lead.device() && fits && rest.empty()) {
        chunk.push_back(i);
        bytes += size;
      } else {
        rest.push_back(i);
      }
    }
    std::vector<at::Tensor> pieces;
    pieces.reserve(chunk.size());
    for (const size_t i : chunk) {
      pieces.push_back(tensors[i].reshape({-1}));
    }
    at::Tensor flat = at::cat(pieces);
    std::vector<at::Tensor> list{flat};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    c10::OptionalDeviceGuard guard(flat.device());
    group->broadcast(list, opts)->wait();
    int64_t offset = 0;
    for (const size_t i : chunk) {
      at::Tensor t = tensors[i];
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    remaining = std::move(rest);
  }
}

} // namespace torch_tp::ddp
