#pragma once
// The five reductions, one enum for the whole library: the ops take them by
// name, as torch's functional collectives spell them ("sum", "avg", "product",
// "min", "max"), and the shared-memory backend folds them (reduce_kernels.h).
// The translations to and from the outside sit where the outside is met:
// parse_reduction and to_c10d in ops/common.h, from_c10d in the backend.

#include <cstdint>

namespace torch_tp {

enum class Reduction : uint8_t { Sum, Avg, Product, Min, Max };

// The name the ops take and the errors print.
const char* reduction_name(Reduction reduction);

} // namespace torch_tp
