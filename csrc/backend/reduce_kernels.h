#pragma once
// Element-wise reductions over the ranks' buffers, the arithmetic core of the
// shared-memory backend. Every rank that reduces an element folds the inputs
// in rank order, ((in[0] op in[1]) op in[2]) ..., so whichever rank computes
// it, the result is bitwise the same.
//
// NOTE [reduction precision]
// bfloat16 and float16 inputs are widened to float32, folded in float32 and
// rounded once (round to nearest even) when stored: a sum over W ranks then
// carries one rounding instead of W - 1. float32 and float64 fold in their own
// type, integers in their own type with two's-complement wrap-around (as gloo
// does), and bool as logical or (sum, max) / logical and (product, min).
// avg is the folded sum divided once by `avg_divisor`, for floating types only.

#include "backend/reduction.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace torch_tp::backend {

// Whether reduce_inputs supports `kind` on `dtype`; if not, `why` says why.
bool reduction_supported(Reduction kind, c10::ScalarType dtype, const char** why);

// The instruction sets the folds are compiled for (NOTE [runtime ISA dispatch]).
enum class FoldIsa : uint8_t { Baseline, Avx2, Avx512 };
const char* fold_isa_name(FoldIsa isa);
// The variants this CPU runs, widest first; reduce_inputs uses the first.
std::vector<FoldIsa> supported_fold_isas();

// out[i] = fold over r of inputs[r][i], for i < numel. `out` may be one of the
// inputs (same offset): a block is read completely before it is written.
void reduce_inputs(Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs, int n_inputs,
                   int64_t numel, int64_t avg_divisor);

// reduce_inputs on a given variant, which the CPU must run (tests compare them).
void reduce_inputs_with(FoldIsa isa, Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs,
                        int n_inputs, int64_t numel, int64_t avg_divisor);

} // namespace torch_tp::backend
