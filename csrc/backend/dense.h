#pragma once

#include <ATen/core/Tensor.h>

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

} // namespace torch_tp::backend
