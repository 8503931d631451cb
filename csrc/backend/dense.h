#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace torch_tp::backend {

// A contiguous tensor to operate on, standing in for `target`; finish()
// copies the result back when they differ.
struct Dense {
  at::Tensor target;
  at::Tensor work;
  explicit Dense(const at::Tensor& t) : target(t), work(t.contiguous()) {}
  void finish() const {
    if (!work.is_same(target)) {
      target.copy_(work);
    }
  }
};

// NOTE [what a backend's threads may hold]
// Tensors handed to another engine's collective (gloo, NCCL, or the torch_tp
// backend's own worker, async_op=True) are released on that engine's thread,
// after the caller's wait returned. Releasing a tensor Python has seen may
// run Python code: while C++ holds further references, a TensorImpl owns its
// PyObject, and dropping to the last reference gives it back, under the GIL.
// At interpreter exit the groups outlive destroy_process_group (DeviceMesh
// keeps them, and gloo's shutdown stops no thread), so a gloo worker that
// releases the last collective's tensors late asks for the GIL while Python
// finalizes; CPython ends that thread with pthread_exit, whose unwinding
// through gloo's noexcept loop aborts the process ("terminate called without
// an active exception"; torch's decref checks Py_IsInitialized, not
// Py_IsFinalizing). So engines get these aliases: a new TensorImpl over the
// same storage, which no Python object ever wraps. Writes through it land in
// the caller's tensor; no version counter is bumped, as none was before.
inline at::Tensor alias_for_backend(const at::Tensor& t) {
  return t.defined() ? t.variable_data() : t;
}

inline std::vector<at::Tensor> alias_for_backend(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> aliases;
  aliases.reserve(tensors.size());
  for (const auto& t : tensors) {
    aliases.push_back(alias_for_backend(t));
  }
  return aliases;
}

inline std::vector<std::vector<at::Tensor>> alias_for_backend(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> aliases;
  aliases.reserve(lists.size());
  for (const auto& list : lists) {
    aliases.push_back(alias_for_backend(list));
  }
  return aliases;
}

} // namespace torch_tp::backend
