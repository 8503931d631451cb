// Python bindings of the DDP reducer (csrc/ddp/reducer.h), used by torch_tp/ddp.py.
// Everything here is argument plumbing; the only logic is running a Python
// communication hook: the hook is called with the GIL held and returns a
// torch.futures.Future, which the reducer waits on (GIL held again) at the
// end of backward.

#include "ddp/reducer.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <string>

namespace py = pybind11;

namespace torch_tp::python {
namespace {

// A Python object owned from C++ code that may run without the GIL (the
// autograd engine's threads): released with the GIL held.
std::shared_ptr<py::object> hold(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// `hook(bucket)` -> torch.futures.Future whose value is the reduced flat
// buffer (or a one-element list of it, as the c10d collectives' futures hold).
ddp::CommHook python_comm_hook(py::function hook) {
  auto callable = hold(std::move(hook));
  return [callable](ddp::GradBucket& bucket) -> ddp::PendingReduction {
    py::gil_scoped_acquire gil;
    std::shared_ptr<py::object> future;
    try {
      future = hold((*callable)(bucket));
    } catch (py::error_already_set& e) {
      TORCH_CHECK(false, "torch_tp.DistributedDataParallel: the communication hook raised on bucket ", bucket.index,
                  ": ", e.what());
    }
    TORCH_CHECK(py::hasattr(*future, "wait"), "torch_tp.DistributedDataParallel: the communication hook must return "
                "a torch.futures.Future, got ", std::string(py::repr(*future)));
    return [future]() -> at::Tensor {
      py::gil_scoped_acquire gil;
      try {
        py::object value = future->attr("wait")();
        if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
          value = value[py::int_(0)];
        }
        return value.cast<at::Tensor>();
      } catch (py::error_already_set& e) {
        TORCH_CHECK(false, "torch_tp.DistributedDataParallel: the communication hook's future failed: ", e.what());
      } catch (py::cast_error&) {
        TORCH_CHECK(false, "torch_tp.DistributedDataParallel: the communication hook's future must hold a Tensor");
      }
    };
  };
}

ddp::BuiltinCommHook parse_builtin(const std::string& name) {
  if (name == "allreduce") {
    return ddp::BuiltinCommHook::kAllReduce;
  }
  if (name == "fp16_compress") {
    return ddp::BuiltinCommHook::kFp16Compress;
  }
  if (name == "bf16_compress") {
    return ddp::BuiltinCommHook::kBf16Compress;
  }
  TORCH_CHECK(false, "torch_tp.DistributedDataParallel: unknown built-in comm hook '", name,
              "'; expected 'allreduce', 'fp16_compress' or 'bf16_compress'");
}

} // namespace

void init_ddp(py::module_& m) {
  py::class_<ddp::GradBucket>(m, "_GradBucket", "torch.distributed.GradBucket's interface, for comm hooks")
      .def("index", [](const ddp::GradBucket& b) { return b.index; })
      .def("buffer", [](const ddp::GradBucket& b) { return b.buffer; })
      .def("set_buffer", [](ddp::GradBucket& b, const at::Tensor& buffer) { b.buffer = buffer; })
      .def("is_last", [](const ddp::GradBucket& b) { return b.index + 1 == b.num_buckets; })
      .def("parameters", [](const ddp::GradBucket& b) { return b.parameters; })
      .def("gradients", [](const ddp::GradBucket& b) {
        std::vector<at::Tensor> views;
        for (size_t i = 0; i < b.parameters.size(); ++i) {
          views.push_back(b.buffer.narrow(0, b.offsets[i], b.lengths[i]).view(b.parameters[i].sizes()));
        }
        return views;
      });

  py::class_<ddp::Reducer>(m, "_Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names, const std::string& group_name,
                       int64_t bucket_bytes_cap, int64_t first_bucket_bytes_cap, bool find_unused_parameters,
                       bool gradient_as_bucket_view, bool static_graph, bool mixed_precision,
                       std::optional<at::ScalarType> reduce_dtype) {
             ddp::ReducerOptions options;
             options.bucket_bytes_cap = bucket_bytes_cap;
             options.first_bucket_bytes_cap = first_bucket_bytes_cap;
             options.find_unused_parameters = find_unused_parameters;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.static_graph = static_graph;
             options.mixed_precision = mixed_precision;
             options.reduce_dtype = reduce_dtype;
             return ddp::make_reducer(std::move(params), std::move(names), group_name, options);
           }),
           py::arg("params"), py::arg("names"), py::arg("group_name"), py::arg("bucket_bytes_cap"),
           py::arg("first_bucket_bytes_cap"), py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"),
           py::arg("static_graph"), py::arg("mixed_precision") = false, py::arg("reduce_dtype") = py::none())
      .def("prepare_for_forward", &ddp::Reducer::prepare_for_forward, py::call_guard<py::gil_scoped_release>())
      .def("prepare_for_backward", &ddp::Reducer::prepare_for_backward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_divisor", &ddp::Reducer::set_divisor, py::arg("divisor"))
      .def("join_backward", &ddp::Reducer::join_backward, py::call_guard<py::gil_scoped_release>())
      .def("register_builtin_comm_hook",
           [](ddp::Reducer& r, const std::string& name) { r.register_builtin_comm_hook(parse_builtin(name)); })
      .def("register_comm_hook",
           [](ddp::Reducer& r, py::function hook) { r.register_comm_hook(python_comm_hook(std::move(hook))); })
      .def("bucket_indices", &ddp::Reducer::bucket_indices)
      .def("grad_ready_order", &ddp::Reducer::grad_ready_order)
      .def("has_rebuilt_buckets", &ddp::Reducer::has_rebuilt_buckets);

  m.def(
      "_compute_bucket_assignment_by_size",
      [](const std::vector<at::Tensor>& tensors, const std::vector<size_t>& size_limits,
         const std::vector<int64_t>& order) {
        auto result = ddp::compute_bucket_assignment(tensors, size_limits, order);
        return py::make_tuple(result.buckets, result.size_limits);
      },
      py::arg("tensors"), py::arg("size_limits"), py::arg("order") = std::vector<int64_t>{},
      "Bucket assignment as torch.distributed._compute_bucket_assignment_by_size computes it");
  m.def("_broadcast_coalesced", &ddp::broadcast_coalesced, py::arg("tensors"), py::arg("group_name"),
        py::arg("src"), py::arg("bucket_bytes"), py::call_guard<py::gil_scoped_release>(),
        "Broadcast tensors in place from group rank src, coalesced into flat buffers");
}

} // namespace torch_tp::python
