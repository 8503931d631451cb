#pragma once
// How the CPU row loops of the fused kernels (norm.cpp, cross_entropy.cpp)
// read and write an element of a tensor, in its math type opmath_t: float and
// double as themselves; bfloat16 as its bits, widened by a shift and rounded
// to nearest even (a NaN stored as 0x7FC0), as c10::BFloat16 converts but in
// arithmetic the compiler vectorises, which c10's conversions were not (the
// fused RMSNorm's bfloat16 forward ran several times float32's time through
// them).
// float16 has no such path: its conversions are bit arithmetic that did not
// vectorise here, so the fused kernels leave it to ATen's compositions.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cstdint>

namespace torch_tp {

template <typename scalar_t>
struct Io {
  using stored = scalar_t;
  using opmath_t = scalar_t;
  static opmath_t load(stored value) { return value; }
  static stored store(opmath_t value) { return value; }
};

template <>
struct Io<c10::BFloat16> {
  using stored = uint16_t;
  using opmath_t = float;
  static float load(uint16_t bits) { return c10::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
  static uint16_t store(float value) {
    const uint32_t u = c10::bit_cast<uint32_t>(value);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return value != value ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
};

// The data of a tensor of scalar_t as the row loops store it (null for an undefined tensor).
template <typename scalar_t>
const typename Io<scalar_t>::stored* stored_data(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const typename Io<scalar_t>::stored*>(t.const_data_ptr<scalar_t>()) : nullptr;
}

template <typename scalar_t>
typename Io<scalar_t>::stored* mutable_stored_data(const at::Tensor& t) {
  return reinterpret_cast<typename Io<scalar_t>::stored*>(t.mutable_data_ptr<scalar_t>());
}

// at::parallel_for's grain for loops over rows of n elements: about GRAIN_SIZE
// elements a chunk, at least one row.
inline int64_t row_grain(int64_t n) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(n, 1));
}

} // namespace torch_tp
