// The unwrap of a DTensor parameter for a torch_tp forward, as one C++ autograd
// node (NOTE [unwrapping a parameter] in torch_tp/parallel/_params.py).
//
// NOTE [the parameter unwrap in C++]
// Every forward of a parallelized module reads each DTensor parameter's local
// tensor, and its gradient must come back to the parameter as a DTensor with
// the parameter's spec. An autograd.Function does that with a Python forward
// and a Python backward (two Python frames, a ctx object, the tuple plumbing of
// PyNode), and, while loss_parallel() has DTensor's __torch_function__ on,
// Function.apply on a DTensor also detours through it: Python work per
// parameter and step, which a model of many small parameters pays 2 x params
// times per step. Here the forward is one call: the output aliases the local
// tensor (a new TensorImpl on the same storage and version counter, as
// detach() makes) and gets a LocalParameterBackward node whose next edge is the
// parameter's own gradient edge (its AccumulateGrad, or its grad_fn when it is
// not a leaf). The backward makes the gradient DTensor with one Python call:
// `new_grad(grad, spec)`, DTensor's constructor with no autograd node, or under
// create_graph `differentiable_grad(grad, spec)` (from_local, which records
// one). The node makes that choice and the gradient contiguous itself, so
// new_grad can be a partial of DTensor's C-level __new__ and the call runs no
// Python frame. In the backward, between GEMMs that evict the interpreter from
// the caches, frames are dear: the earlier two-frame Python wrapper cost a
// gradient in the example's step many times what it cost in a warm loop, and
// dropping its frames shortened the backward (paired backward times).
// Pybind11 functions see no
// __torch_function__, so loss_parallel() costs the unwrap nothing.
//
// NOTE [the gradient straight to .grad]
// The parameter's AccumulateGrad would then take that DTensor as .grad by
// detaching it, and a DTensor's detach runs DTensor's Python dispatch and
// builds a second DTensor: one more Python round trip per parameter and step.
// When AccumulateGrad would do nothing else, the node sets .grad itself and
// passes AccumulateGrad an undefined gradient, which it ignores. That is when
//   - the backward runs every node (no inputs= and not autograd.grad: the
//     graph task's exec_info is empty), so nothing captures the gradient;
//   - the parameter is a leaf whose .grad is None and that requires grad;
//   - no hook of any kind is on the parameter or its AccumulateGrad
//     (register_hook, post-accumulate-grad hooks, retain_grad, DDP's);
//   - there is no create_graph, and the gradient is on the CPU. On CUDA the
//     engine syncs the streams AccumulateGrad ran on at the end of the
//     backward; keeping the .grad write on that node keeps that guarantee.
// The .grad it sets is what AccumulateGrad's "steal" case sets: the fresh
// gradient DTensor, with the parameter's layout (its spec). Anything else
// (accumulating into an existing .grad, hooks, inputs=) takes AccumulateGrad.
// One hook is allowed: the recording hook of a sequence-parallel parameter,
// whose gradient arrives as Partial sums (NOTE [partial gradients of
// sequence-parallel parameters] in torch_tp/parallel/_replicated_grad.py).
// Such a node holds `take_partial`, which does what that hook would and says
// whether it is the parameter's only hook; the node then sets .grad itself.
//
// NOTE [gradient DTensors made together]
// Made one at a time, each gradient DTensor's constructor runs cold in its
// node, and with it the rest of its Python section: the GEMMs between two
// parameters' nodes evict the interpreter and DTensor's objects. So the first
// node of a backward that sets .grad itself makes the gradient DTensors of
// every such node of the graph task at once, in one GIL section, where the
// interpreter stays warm from one to the next.
// Each wraps an empty placeholder of the parameter's dtype and device as its
// local tensor; a Partial gradient's node calls `take_partial` then. When a
// node runs, its placeholder takes the gradient's storage, sizes and strides
// (on the TensorImpl, as set_ would, without the dispatcher and with no Python,
// a fraction of set_'s cost) and the DTensor becomes .grad. The
// first node finds the others in a list of the unwrap nodes forwards made (weak
// references, below), keeping those in the graph task's node set (the engine
// fills it before it runs any node). A node
// whose conditions no longer hold when it runs (its parameter got a .grad from
// another node meanwhile, a hook was added) takes the path above, and its made
// DTensor is dropped unused. With the two ways alternated in one process,
// the backward is shorter this way.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_tp::python {
namespace {

// A node's pointer type: a shared_ptr before torch 2.14, an intrusive_ptr since
// (taken from the function, as csrc/ddp/reducer.cpp does, so both build).
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// Python objects a node holds; the node may be destroyed by a thread without
// the GIL (the autograd engine releases it during backward), so the references
// are dropped with the GIL held.
struct PythonRefs {
  py::object new_grad;
  py::object differentiable_grad;
  py::object spec;
  py::object take_partial;  // None unless the gradient is Partial sums (NOTE [the gradient straight to .grad])
  // NOTE [gradient DTensors made together]: the gradient DTensor made ahead, and its local tensor.
  at::Tensor made_grad;
  at::Tensor placeholder;
  ~PythonRefs() {
    py::gil_scoped_acquire gil;
    new_grad = py::object();
    differentiable_grad = py::object();
    spec = py::object();
    take_partial = py::object();
    made_grad = at::Tensor();
    placeholder = at::Tensor();
  }
};

class LocalParameterBackward : public torch::autograd::Node {
 public:
  explicit LocalParameterBackward(std::unique_ptr<PythonRefs> refs) : refs_(std::move(refs)) {}

  std::string name() const override {
    return "torch_tp::LocalParameterBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_INTERNAL_ASSERT(grads.size() == 1);
    if (!grads[0].defined()) {
      return {at::Tensor()};
    }
    auto* accumulator = sole_accumulator();
    if (accumulator != nullptr) {
      make_graph_task_gradients();
      if (refs_->made_grad.defined()) {  // NOTE [gradient DTensors made together]
        // The placeholder takes the gradient's storage and layout, as set_ would without
        // the dispatcher: no one has seen the placeholder's (empty) contents.
        const at::Tensor local_grad = grads[0].contiguous();
        c10::TensorImpl* local = refs_->placeholder.unsafeGetTensorImpl();
        local->set_storage_keep_dtype(local_grad.storage());
        local->set_sizes_and_strides(local_grad.sizes(), local_grad.strides(), local_grad.storage_offset());
        refs_->placeholder = at::Tensor();  // the DTensor holds it
        accumulator->variable.mutable_grad() = std::move(refs_->made_grad);
        return {at::Tensor()};
      }
    }
    const bool create_graph = at::GradMode::is_enabled();
    // The local tensor is contiguous, and so is its .grad (NOTE [unwrapping a parameter]).
    const at::Tensor local_grad = create_graph ? grads[0] : grads[0].contiguous();
    at::Tensor grad;
    {
      py::gil_scoped_acquire gil;
      try {
        const py::object& make = create_graph ? refs_->differentiable_grad : refs_->new_grad;
        grad = make(local_grad, refs_->spec).cast<at::Tensor>();
        if (accumulator != nullptr && !refs_->take_partial.is_none() &&
            !refs_->take_partial(accumulator->variable).cast<bool>()) {
          accumulator = nullptr;
        }
      } catch (py::error_already_set& e) {
        TORCH_CHECK(false, "torch_tp: making a parameter's gradient DTensor failed: ", e.what());
      }
    }
    if (accumulator != nullptr) {
      accumulator->variable.mutable_grad() = std::move(grad);
      return {at::Tensor()};
    }
    return {std::move(grad)};
  }

 private:
  // The parameter's AccumulateGrad when this node may set .grad in its place,
  // else nullptr (NOTE [the gradient straight to .grad]). The gradient is on the
  // parameter's device: its local tensor's, which the engine checks it against.
  torch::autograd::AccumulateGrad* sole_accumulator() const {
    if (at::GradMode::is_enabled()) {
      return nullptr;
    }
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    if (exec_info == nullptr || !exec_info->empty()) {
      return nullptr;
    }
    auto* accumulator = dynamic_cast<torch::autograd::AccumulateGrad*>(next_edge(0).function.get());
    if (accumulator == nullptr) {
      return nullptr;
    }
    const at::Tensor& param = accumulator->variable;
    // A Partial gradient's node leaves the tensor hooks to take_partial, which checks them.
    const bool tensor_hooked = refs_->take_partial.is_none() && !accumulator->tensor_pre_hooks().empty();
    const bool hooked = !accumulator->pre_hooks().empty() || !accumulator->post_hooks().empty() ||
        tensor_hooked || !accumulator->retains_grad_hooks().empty() ||
        accumulator->tensor_post_acc_grad_hooks() != nullptr;
    if (hooked || !param.defined() || !param.device().is_cpu() || !param.requires_grad() || param.grad().defined()) {
      return nullptr;
    }
    return accumulator;
  }

  // NOTE [gradient DTensors made together]: once per graph task, on its first
  // node that sets .grad itself, for every such node of the task.
  static void make_graph_task_gradients();

  // The gradient DTensor over an empty placeholder, for `param` (GIL held); none when
  // take_partial says the parameter's hooks are not its own alone.
  void make_gradient(const at::Tensor& param) {
    if (!refs_->take_partial.is_none() && !refs_->take_partial(param).cast<bool>()) {
      return;
    }
    refs_->placeholder = at::empty({0}, param.options().requires_grad(false));
    refs_->made_grad = refs_->new_grad(refs_->placeholder, refs_->spec).cast<at::Tensor>();
  }

  std::unique_ptr<PythonRefs> refs_;
};

// The unwrap nodes that forwards made and no backward has made gradients for
// yet (NOTE [gradient DTensors made together]), as weak references: a forward
// whose graph is dropped without a backward leaves expired ones, pruned as the
// list grows. Nodes of a forward whose backward runs later (a pipeline's next
// micro-batch) stay listed until theirs does.
template <typename P>
struct WeakOf;
template <typename T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T, typename N>
struct WeakOf<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};
using WeakNodePtr = typename WeakOf<NodePtr>::type;

struct UnmadeNodes {
  std::mutex mutex;
  std::vector<WeakNodePtr> nodes;  // guarded by mutex, as is:
  size_t prune_at = 64;
};

// Never destroyed: at exit, releasing a node would take the GIL of a finalized interpreter.
UnmadeNodes& unmade() {
  static auto* const list = new UnmadeNodes();
  return *list;
}

// Entries leave the list under its mutex and are released after it: releasing
// the last reference to a node destroys it, which takes the GIL (PythonRefs).
void list_unmade(const NodePtr& node) {
  UnmadeNodes& list = unmade();
  std::vector<WeakNodePtr> released;
  std::lock_guard<std::mutex> lock(list.mutex);
  if (list.nodes.size() >= list.prune_at) {
    const auto expired =
        std::partition(list.nodes.begin(), list.nodes.end(), [](const WeakNodePtr& w) { return !w.expired(); });
    released.assign(std::make_move_iterator(expired), std::make_move_iterator(list.nodes.end()));
    list.nodes.erase(expired, list.nodes.end());
    list.prune_at = std::max<size_t>(64, 2 * list.nodes.size());
  }
  list.nodes.emplace_back(node);
}

void LocalParameterBackward::make_graph_task_gradients() {
  thread_local int made_for_task = -1;
  const int task = torch::autograd::get_current_graph_task_id();
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (task == made_for_task || nodes == nullptr) {
    return;
  }
  made_for_task = task;
  // This backward's nodes, taken off the list, with strong references while their gradients
  // are made; what leaves the list is released after its mutex (list_unmade says why).
  std::vector<std::pair<NodePtr, torch::autograd::AccumulateGrad*>> todo;
  std::vector<WeakNodePtr> released;
  std::vector<NodePtr> others;
  {
    UnmadeNodes& list = unmade();
    std::lock_guard<std::mutex> lock(list.mutex);
    auto kept = list.nodes.begin();
    for (auto& weak : list.nodes) {
      NodePtr node = weak.lock();
      if (node && nodes->count(node.get()) == 0) {
        others.push_back(std::move(node));
        if (&*kept != &weak) {
          *kept = std::move(weak);
        }
        ++kept;
        continue;
      }
      released.push_back(std::move(weak));
      auto* unwrap = static_cast<LocalParameterBackward*>(node.get());
      auto* accumulator = node ? unwrap->sole_accumulator() : nullptr;
      if (accumulator != nullptr) {
        todo.emplace_back(std::move(node), accumulator);
      } else if (node) {
        others.push_back(std::move(node));
      }
    }
    list.nodes.erase(kept, list.nodes.end());
  }
  if (todo.empty()) {
    return;
  }
  py::gil_scoped_acquire gil;
  try {
    for (auto& [node, accumulator] : todo) {
      static_cast<LocalParameterBackward*>(node.get())->make_gradient(accumulator->variable);
    }
  } catch (py::error_already_set& e) {
    TORCH_CHECK(false, "torch_tp: making a parameter's gradient DTensor failed: ", e.what());
  }
}

// `param` (a DTensor), `local` (its local tensor) -> `local` itself when no
// gradient is needed (grad mode off, or `param` does not require grad), else an
// alias of `local` whose gradient reaches `param` as `new_grad(grad, spec)`, or
// `differentiable_grad(grad, spec)` under create_graph; `take_partial`: None, or
// for Partial gradients as NOTE [the gradient straight to .grad] says.
at::Tensor local_parameter(const at::Tensor& param, const at::Tensor& local, py::object spec, py::object new_grad,
                           py::object differentiable_grad, py::object take_partial) {
  if (!at::GradMode::is_enabled() || !param.requires_grad()) {
    return local;
  }
  // A fresh alias with its own edge to `param`. The local tensor may itself be part of a
  // graph (torch's DDP makes its DTensor views with from_local of its parameters); the
  // gradient reaches it through `param`'s own grad_fn.
  at::Tensor out = local.detach();
  NodePtr node = make_node<LocalParameterBackward>(
      std::unique_ptr<PythonRefs>(new PythonRefs{std::move(new_grad), std::move(differentiable_grad), std::move(spec),
                                                 std::move(take_partial), at::Tensor(), at::Tensor()}));
  node->set_next_edges(torch::autograd::collect_next_edges(param));
  torch::autograd::set_history(out, node);
  list_unmade(node);
  return out;
}

} // namespace

void init_parameters(py::module_& m) {
  m.def("_local_parameter", &local_parameter, py::arg("param"), py::arg("local"), py::arg("spec"),
        py::arg("new_grad"), py::arg("differentiable_grad"), py::arg("take_partial") = py::none(),
        "A DTensor parameter's local tensor: as it is when no gradient is needed, else an autograd alias whose "
        "gradient reaches the parameter as new_grad(grad, spec), or differentiable_grad(grad, spec) under "
        "create_graph (NOTE [the parameter unwrap in C++] in "
        "csrc/python/parameters.cpp); take_partial(param) -> bool for a gradient of Partial sums (NOTE [the "
        "gradient straight to .grad]).");
}

} // namespace torch_tp::python
