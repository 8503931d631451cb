// The unwrap of a DTensor parameter for a torch_tp forward, as one C++ autograd
// node (NOTE [unwrapping a parameter] in torch_tp/parallel/_params.py).
//
// NOTE [the parameter unwrap in C++]
// Every forward of a parallelized module reads each DTensor parameter's local
// tensor, and its gradient must come back to the parameter as a DTensor with
// the parameter's spec. DTensor.to_local() does that through two autograd
// Functions with Python forwards and backwards (and, while loss_parallel() has
// DTensor's __torch_function__ on, a detour through it): Python work per
// parameter, forward and backward, which a model of many small parameters pays
// on every step. Here the forward is one call: the output aliases the local
// tensor (a new TensorImpl on the same storage and version counter, as
// detach() makes) and gets a LocalParameterBackward node whose next edge is the
// parameter's own gradient edge (its AccumulateGrad, or its grad_fn when it is
// not a leaf). The backward makes the gradient DTensor with one Python call,
// `new_grad(grad, spec)` (DTensor's constructor, no autograd node), or under
// create_graph `differentiable_grad(grad, spec)` (from_local, which records
// one), and hands it to that edge: AccumulateGrad, hooks and DDP see the
// gradient DTensor as they would from to_local()'s backward. Pybind11
// functions see no __torch_function__, so loss_parallel() costs the unwrap
// nothing.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

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
  ~PythonRefs() {
    py::gil_scoped_acquire gil;
    new_grad = py::object();
    differentiable_grad = py::object();
    spec = py::object();
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
    const bool create_graph = at::GradMode::is_enabled();
    // The local tensor is contiguous, and so is its .grad (NOTE [unwrapping a parameter]).
    const at::Tensor local_grad = create_graph ? grads[0] : grads[0].contiguous();
    at::Tensor grad;
    {
      py::gil_scoped_acquire gil;
      try {
        const py::object& make = create_graph ? refs_->differentiable_grad : refs_->new_grad;
        grad = make(local_grad, refs_->spec).cast<at::Tensor>();
      } catch (py::error_already_set& e) {
        TORCH_CHECK(false, "torch_tp: making a parameter's gradient DTensor failed: ", e.what());
      }
    }
    return {std::move(grad)};
  }

 private:
  std::unique_ptr<PythonRefs> refs_;
};

// `param` (a DTensor), `local` (its local tensor) -> `local` itself when no
// gradient is needed (grad mode off, or `param` does not require grad), else an
// alias of `local` whose gradient reaches `param` as `new_grad(grad, spec)`, or
// `differentiable_grad(grad, spec)` under create_graph.
at::Tensor local_parameter(const at::Tensor& param, const at::Tensor& local, py::object spec, py::object new_grad,
                           py::object differentiable_grad) {
  if (!at::GradMode::is_enabled() || !param.requires_grad()) {
    return local;
  }
  // A fresh alias with its own edge to `param`. The local tensor may itself be part of a
  // graph (torch's DDP makes its DTensor views with from_local of its parameters); the
  // gradient reaches it through `param`'s own grad_fn.
  at::Tensor out = local.detach();
  NodePtr node = make_node<LocalParameterBackward>(
      std::unique_ptr<PythonRefs>(new PythonRefs{std::move(new_grad), std::move(differentiable_grad), std::move(spec)}));
  node->set_next_edges(torch::autograd::collect_next_edges(param));
  torch::autograd::set_history(out, node);
  return out;
}

} // namespace

void init_parameters(py::module_& m) {
  m.def("_local_parameter", &local_parameter, py::arg("param"), py::arg("local"), py::arg("spec"),
        py::arg("new_grad"), py::arg("differentiable_grad"),
        "A DTensor parameter's local tensor: as it is when no gradient is needed, else an autograd alias whose "
        "gradient reaches the parameter as new_grad(grad, spec), or differentiable_grad(grad, spec) under "
        "create_graph (NOTE [the parameter unwrap in C++] in "
        "csrc/python/parameters.cpp).");
}

} // namespace torch_tp::python
