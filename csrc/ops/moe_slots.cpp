// The two ends of HF's AllToAllEP pair over the (token, slot) rows: row i
// of the T*K rows is the pair order[i] = t*K + k (order sorts the pairs by
// expert). moe_token_dispatch starts with the gather
//   _moe_slot_rows:  rows[i] = hidden[order[i] / K]                    -> [T*K, H],
// and moe_token_combine ends with the weighted sum over each token's slots
//   _moe_slot_sum:   out[t] = sum_k w[t, k] * rows[i : order[i] = t*K + k]  -> [T, H].
// The gather's backward is the sum with unit weights; the sum's backward is
// taken where the expert rows are (moe_slot_exchange.cpp, which also runs
// both passes inside the exchanges where it can). These are the passes for
// where it cannot.
//
// NOTE [one pass over the slots]
// In ATen the sum is a product (a fresh [T*K, H]), a zeroed [T, H] and an
// index_add: passes over the rows where one does. On the CPU (float32,
// float64, bfloat16) each output row of the sum is written once from its K
// rows, found through the inverse of order. Elsewhere (CUDA, float16) the
// ATen composition runs. The gather itself is index_select everywhere.

#include "ops/common.h"
#include "ops/cpu_isa.h"
#include "ops/row_io.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/SymBool.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <vector>

namespace torch_tp {
namespace {

constexpr const char* kOp = "torch_tp::moe_token_combine";

// rows [N, H], order [N] int64, weights [T, K] of rows' dtype and device, N = T*K.
void check_slot_sum_args(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& weights) {
  check_defined(kOp, "rows", rows);
  check_defined(kOp, "order", order);
  check_defined(kOp, "top_k_weights", weights);
  TORCH_CHECK(rows.dim() == 2, kOp, ": the combined rows must be [T*K, H], got shape ", rows.sym_sizes());
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong, kOp,
              ": order must be 1-D int64 (moe_token_dispatch's), got ", order.scalar_type(), " of shape ",
              order.sym_sizes());
  TORCH_CHECK(weights.dim() == 2, kOp, ": top_k_weights must be [T, K], got shape ", weights.sym_sizes());
  TORCH_CHECK(weights.scalar_type() == rows.scalar_type() && weights.device() == rows.device(), kOp,
              ": top_k_weights (", weights.scalar_type(), " on ", weights.device(), ") must match the rows (",
              rows.scalar_type(), " on ", rows.device(), ")");
  TORCH_SYM_CHECK(order.sym_size(0).sym_eq(weights.sym_numel()), kOp, ": top_k_weights has shape ",
                  weights.sym_sizes(), " (T*K=", weights.sym_numel(), ") but order has ", order.sym_size(0),
                  " entries");
  TORCH_SYM_CHECK(rows.sym_size(0).sym_eq(order.sym_size(0)), kOp, ": ", rows.sym_size(0),
                  " rows came back but order has ", order.sym_size(0), " entries");
}

bool fuses(const at::Tensor& rows) {
  const auto dtype = rows.scalar_type();
  return rows.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16);
}

// position[order[i]] = i, checking that order is a permutation of [0, N).
std::vector<int64_t> inverse_of(const at::Tensor& order) {
  const at::Tensor o = order.contiguous();
  const int64_t n = o.numel();
  const int64_t* data = o.const_data_ptr<int64_t>();
  std::vector<int64_t> position(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = data[i];
    TORCH_CHECK_INDEX(slot >= 0 && slot < n && position[slot] < 0, kOp,
                      ": order must be a permutation of [0, T*K=", n, ") (moe_token_dispatch's); entry ", i,
                      " is ", slot, slot >= 0 && slot < n ? ", a repeat" : ", out of range");
    position[slot] = i;
  }
  return position;
}

template <typename scalar_t>
struct SlotRows {
  using IO = Io<scalar_t>;
  using T = typename IO::stored;
  using opmath_t = typename IO::opmath_t;

  // Tokens [begin, end): out[t] = sum_k w[t*K+k] * rows[position[t*K+k]].
  struct Sum {
    static void run(const T* rows, const int64_t* position, const T* w, T* out, int64_t begin, int64_t end,
                    int64_t k_slots, int64_t h) {
      std::vector<opmath_t> acc(static_cast<size_t>(h));
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t k = 0; k < k_slots; ++k) {
          const int64_t slot = t * k_slots + k;
          const opmath_t wk = IO::load(w[slot]);
          const T* r = rows + position[slot] * h;
          if (k == 0) {
#pragma omp simd
            for (int64_t j = 0; j < h; ++j) {
              acc[j] = wk * IO::load(r[j]);
            }
          } else {
#pragma omp simd
            for (int64_t j = 0; j < h; ++j) {
              acc[j] += wk * IO::load(r[j]);
            }
          }
        }
        T* o = out + t * h;
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) {
          o[j] = IO::store(k_slots > 0 ? acc[j] : opmath_t(0));
        }
      }
    }
  };
};

at::Tensor slot_sum_composite(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& weights) {
  const at::Tensor token = at::div(order, c10::Scalar(weights.sym_size(1)), "floor");
  const at::Tensor w = weights.reshape({-1}).index_select(0, order);
  return at::zeros_symint({weights.sym_size(0), rows.sym_size(1)}, rows.options())
      .index_add(0, token, rows * w.unsqueeze(1));
}

at::Tensor slot_sum_kernel(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& weights) {
  check_slot_sum_args(rows, order, weights);
  if (!fuses(rows)) {
    return slot_sum_composite(rows, order, weights);
  }
  const std::vector<int64_t> position = inverse_of(order);
  const at::Tensor r = rows.contiguous();
  const at::Tensor w = weights.contiguous();
  const int64_t tokens = w.size(0);
  const int64_t k_slots = w.size(1);
  const int64_t h = r.size(1);
  at::Tensor out = at::empty({tokens, h}, r.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, r.scalar_type(), kOp, [&] {
    const auto loop = isa_entry<typename SlotRows<scalar_t>::Sum>(widest_cpu_isa());
    at::parallel_for(0, tokens, row_grain(h * k_slots), [&](int64_t begin, int64_t end) {
      loop(stored_data<scalar_t>(r), position.data(), stored_data<scalar_t>(w), mutable_stored_data<scalar_t>(out),
           begin, end, k_slots, h);
    });
  });
  return out;
}

at::Tensor slot_sum_meta(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& weights) {
  check_slot_sum_args(rows, order, weights);
  return at::empty_symint({weights.sym_size(0), rows.sym_size(1)}, rows.options());
}

// --------------------------------------------------------------- the gather

// hidden [T, H], order [T*K] int64; returns K.
int64_t check_slot_rows_args(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k) {
  constexpr const char* op = "torch_tp::moe_token_dispatch";
  check_defined(op, "hidden", hidden);
  check_defined(op, "order", order);
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [T, H], got shape ", hidden.sym_sizes());
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong, op, ": order must be 1-D int64, got ",
              order.scalar_type(), " of shape ", order.sym_sizes());
  TORCH_CHECK(top_k >= 1, op, ": top_k must be positive, got ", top_k);
  TORCH_SYM_CHECK(order.sym_size(0).sym_eq(hidden.sym_size(0) * top_k), op, ": order has ", order.sym_size(0),
                  " entries but hidden has T=", hidden.sym_size(0), " rows of top_k=", top_k, " slots");
  return top_k;
}

at::Tensor slot_rows_kernel(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k) {
  check_slot_rows_args(hidden, order, top_k);
  return hidden.index_select(0, at::div(order, c10::Scalar(top_k), "floor"));
}

at::Tensor slot_rows_meta(const at::Tensor& hidden, const at::Tensor& order, int64_t top_k) {
  check_slot_rows_args(hidden, order, top_k);
  return at::empty_symint({order.sym_size(0), hidden.sym_size(1)}, hidden.options());
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CPU, m) {
  m.impl("_moe_slot_rows", slot_rows_kernel);
  m.impl("_moe_slot_sum", slot_sum_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("_moe_slot_rows", slot_rows_kernel);
  m.impl("_moe_slot_sum", slot_sum_kernel);
}

TORCH_LIBRARY_IMPL(torch_tp, Meta, m) {
  m.impl("_moe_slot_rows", slot_rows_meta);
  m.impl("_moe_slot_sum", slot_sum_meta);
}

// Called below autograd only, by moe_slot_exchange.cpp's differentiable ops.
TORCH_LIBRARY_IMPL(torch_tp, Autograd, m) {
  m.impl("_moe_slot_rows", torch::autograd::autogradNotImplementedFallback());
  m.impl("_moe_slot_sum", torch::autograd::autogradNotImplementedFallback());
}

} // namespace torch_tp
