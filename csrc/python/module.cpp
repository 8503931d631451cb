// torch_tp._C: importing it loads libtorch_tp.so (a link dependency), whose
// static initialisers register the torch_tp ops with the dispatcher. The module
// carries the bindings of the DDP reducer (ddp.cpp), the
// constructor of the "torch_tp" process-group backend (backend.cpp) and the
// unwrap of DTensor parameters for the forwards (parameters.cpp).

#include <pybind11/pybind11.h>

namespace torch_tp::python {
void init_ddp(pybind11::module_& m);
void init_backend(pybind11::module_& m);
void init_parameters(pybind11::module_& m);
} // namespace torch_tp::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_tp native library: registers torch.ops.torch_tp.*, the DDP reducer, the torch_tp backend "
           "and the parameter unwrap";
  torch_tp::python::init_ddp(m);
  torch_tp::python::init_backend(m);
  torch_tp::python::init_parameters(m);
}
