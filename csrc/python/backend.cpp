// Python binding of the "torch_tp" process-group backend
// (csrc/backend/process_group_shm.h): the constructor torch_tp/backend.py's
// factory calls, after it has exchanged host keys and made the gloo groups a
// multi-node group needs.
//
// c10d's Python types (Store, Backend) are registered by torch with
// c10::intrusive_ptr holders; torch_tp/__init__.py imports torch.distributed
// before this module, so they exist when ProcessGroupShm names Backend as its base.

#include "backend/process_group_shm.h"

#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace torch_tp::python {

void init_backend(py::module_& m) {
  using torch_tp::backend::ProcessGroupShm;
  py::class_<ProcessGroupShm, c10d::Backend, c10::intrusive_ptr<ProcessGroupShm>>(m, "ProcessGroupShm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<std::string> host_keys,
                       std::optional<size_t> buffer_bytes, c10::intrusive_ptr<c10d::Backend> gloo_all,
                       c10::intrusive_ptr<c10d::Backend> gloo_leaders) {
             ProcessGroupShm::Options options;
             options.timeout = timeout;
             options.buffer_bytes = buffer_bytes ? *buffer_bytes : torch_tp::backend::buffer_bytes_from_env();
             options.host_keys = std::move(host_keys);
             options.gloo_all = std::move(gloo_all);
             options.gloo_leaders = std::move(gloo_leaders);
             return c10::make_intrusive<ProcessGroupShm>(store, rank, size, std::move(options));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("host_keys"),
           py::arg("buffer_bytes") = py::none(), py::arg("gloo_all") = py::none(),
           py::arg("gloo_leaders") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("exchange_host_keys", &torch_tp::backend::exchange_host_keys, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
        "Every rank's host key (TORCH_TP_HOST_KEY or the hostname), by rank, exchanged through the store");
}

} // namespace torch_tp::python
