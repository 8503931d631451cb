// Python entry points of the sharded linears for the modules' plain-tensor
// path: torch_tp._C._column_parallel_linear and _row_parallel_linear.
//
// NOTE [calling the sharded linears from the modules]
// A torch.ops.torch_tp.<op>(...) call from Python does much work on top of
// the kernel: OpOverloadPacket.__call__ is a Python
// frame, the overload is picked among the packet's, and the call is boxed (the
// arguments parsed against the schema into a stack of IValues). A decode step
// of a TP model calls its linears' ops once per linear and token from the
// modules' plain-tensor path (NOTE [plain tensors in the layouts the plan
// declares] in torch_tp/parallel/style.py), 57 times a token in the example's
// 8-layer model. These entries make that call the way torch's generated
// bindings make theirs: METH_FASTCALL, the tensors unpacked in place, one
// typed dispatcher call (the one torch_tp's C++ API makes, csrc/ops/ops.cpp)
// with the GIL released, as torch.ops releases it. The op is dispatched as
// before, so autograd, autocast, the profiler, TorchDispatchModes and
// subclasses' __torch_dispatch__ all see it.
//
// What only the Python-level call honours is __torch_function__: when a
// TorchFunctionMode is on, or an argument is a tensor subclass or not a
// tensor at all, the entry hands its arguments to torch.ops as they are, so
// the result, and any error, is torch.ops'. Dynamo does not trace C
// functions; torch_tp/parallel/style.py gives it the torch.ops call in their place
// (torch.compiler.substitute_in_graph).

#include <torch_tp/ops.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/python_numbers.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

namespace py = pybind11;

namespace torch_tp::python {
namespace {

// x, weight, bias and group_name, the arguments both linears start with: whether
// the entry can pass them to the dispatcher itself. With no TorchFunctionMode
// on, the tensors must be torch.Tensor or nn.Parameter, not a subclass (whose
// __torch_function__ only torch.ops would call); bias may be None.
bool takes_linear_args(PyObject* const* args) {
  return !at::impl::torch_function_mode_enabled() && THPVariable_CheckExact(args[0]) &&
         THPVariable_CheckExact(args[1]) && (args[2] == Py_None || THPVariable_CheckExact(args[2])) &&
         PyUnicode_Check(args[3]);
}

std::optional<at::Tensor> optional_tensor(PyObject* arg) {
  return arg == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(arg));
}

c10::string_view unpack_str(PyObject* arg) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(arg, &size);
  if (data == nullptr) {
    throw python_error();
  }
  return c10::string_view(data, static_cast<size_t>(size));
}

// The op's result as a Python tensor, called with the GIL released (the op
// may wait for its peers in a collective).
template <typename Call>
PyObject* call_without_gil(const Call& call) {
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;
    out = call();
  }
  return THPVariable_Wrap(std::move(out));
}

// torch.ops.torch_tp.<name>(*args, **kwargs) (vectorcall's layout: `kwnames`
// names the values after the nargs positional ones): whatever the entry does not take itself.
PyObject* call_torch_ops(const char* name, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames = nullptr) {
  const py::object op = py::module_::import("torch").attr("ops").attr("torch_tp").attr(name);
  return PyObject_Vectorcall(op.ptr(), args, static_cast<size_t>(nargs), kwnames);
}

// _column_parallel_linear(x, weight, bias, group_name, *, partial_grad_input=False):
// torch.ops.torch_tp.column_parallel_linear with no gather and no activation,
// called the same way (the keyword is the only one the entry takes itself).
PyObject* column_parallel_linear_entry(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs,
                                      PyObject* kwnames) {
  HANDLE_TH_ERRORS
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  const bool keyword_ok = nkw == 0 ||
      (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "partial_grad_input") == 0 &&
       PyBool_Check(args[nargs]));
  if (nargs != 4 || !keyword_ok || !takes_linear_args(args)) {
    return call_torch_ops("column_parallel_linear", args, nargs, kwnames);
  }
  const std::optional<at::Tensor> bias = optional_tensor(args[2]);
  const c10::string_view group_name = unpack_str(args[3]);
  const bool partial_grad_input = nkw == 1 && args[nargs] == Py_True;
  return call_without_gil([&] {
    return torch_tp::column_parallel_linear(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias,
                                            group_name, std::nullopt, std::nullopt, "none", partial_grad_input);
  });
  END_HANDLE_TH_ERRORS
}

// _row_parallel_linear(x, weight, bias, group_name, scatter_dim): torch.ops.torch_tp.row_parallel_linear.
PyObject* row_parallel_linear_entry(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 5 || !takes_linear_args(args) || !(args[4] == Py_None || THPUtils_checkLong(args[4]))) {
    return call_torch_ops("row_parallel_linear", args, nargs);
  }
  const std::optional<at::Tensor> bias = optional_tensor(args[2]);
  const c10::string_view group_name = unpack_str(args[3]);
  const std::optional<int64_t> scatter_dim =
      args[4] == Py_None ? std::nullopt : std::optional<int64_t>(THPUtils_unpackLong(args[4]));
  return call_without_gil([&] {
    return torch_tp::row_parallel_linear(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias, group_name,
                                         scatter_dim);
  });
  END_HANDLE_TH_ERRORS
}

PyMethodDef linear_entry_methods[] = {
    {"_column_parallel_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(column_parallel_linear_entry)),
     METH_FASTCALL | METH_KEYWORDS,
     "_column_parallel_linear(x, weight, bias, group_name, *, partial_grad_input=False): "
     "torch.ops.torch_tp.column_parallel_linear without torch.ops' Python call (NOTE [calling the sharded linears "
     "from the modules] in csrc/python/linear_entry.cpp)"},
    {"_row_parallel_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(row_parallel_linear_entry)),
     METH_FASTCALL,
     "_row_parallel_linear(x, weight, bias, group_name, scatter_dim): torch.ops.torch_tp.row_parallel_linear "
     "without torch.ops' Python call"},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

void init_linear_entries(py::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), linear_entry_methods) != 0) {
    throw py::error_already_set();
  }
}

} // namespace torch_tp::python
