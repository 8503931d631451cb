#include "backend/reduce_kernels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <type_traits>

// NOTE [portable vectorisation]
// The wheel must run on any x86-64 (or aarch64), so there is no -march=native
// and no intrinsics: the loops below are written so that the compiler's
// auto-vectoriser (this file is built with -O3 -fno-trapping-math) turns them
// into SSE2/NEON code (and AVX2, NOTE [runtime ISA dispatch]).
// The fold works on blocks of kBlock elements held in a local accumulator
// array: the accumulator cannot alias the inputs, so each inner loop is a
// plain streaming loop over two arrays, and the block stays in L1 while the
// W inputs stream through it.

namespace torch_tp::backend {
namespace {

constexpr int64_t kBlock = 1024;

// Widening loads and narrowing stores. bfloat16 is the high half of a float32;
// storing rounds to nearest even and keeps NaN a quiet NaN (c10's rounding).
struct BF16Codec {
  using Storage = uint16_t;
  using Acc = float;
  static float load(uint16_t bits) {
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
  static uint16_t store(float value) {
    const uint32_t u = std::bit_cast<uint32_t>(value);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
  }
};

// float16 <-> float32 in bit arithmetic with selects instead of branches
// (c10::Half's conversions branch per element and stay scalar).
struct HalfCodec {
  using Storage = uint16_t;
  using Acc = float;
  static float load(uint16_t bits) {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t rest = bits & 0x7fffu;  // exponent and mantissa
    // Shifted into float32's fields, the exponent is 112 too small; one
    // multiplication by 2^112 fixes it for normal and subnormal halfs alike.
    const float scaled = std::bit_cast<float>(rest << 13) * 0x1p112f;
    // Inf and NaN keep an all-ones exponent (and NaN its payload).
    const uint32_t special = (rest << 13) | 0x7f800000u;
    const uint32_t magnitude = rest >= 0x7c00u ? special : std::bit_cast<uint32_t>(scaled);
    return std::bit_cast<float>(magnitude | sign);
  }
  static uint16_t store(float value) {
    const uint32_t u = std::bit_cast<uint32_t>(value);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t mag = u & 0x7fffffffu;
    // >= 65520 rounds to inf; NaN stays a quiet NaN.
    const uint32_t overflow = mag > 0x7f800000u ? 0x7e00u : 0x7c00u;
    // Below 2^-14 the result is subnormal: adding 0.5 (exponent 126) lets the
    // float adder round the mantissa to nearest even at the right place.
    const float sub_sum = std::bit_cast<float>(mag) + 0.5f;
    const uint32_t subnormal = std::bit_cast<uint32_t>(sub_sum) - 0x3f000000u;
    // Normal: rebias the exponent by -112 and round the 13 dropped bits to
    // nearest even (add 0xfff plus the lowest kept bit, then truncate).
    const uint32_t normal = (mag - (112u << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
    const uint32_t result = mag >= (143u << 23) ? overflow : (mag < (113u << 23) ? subnormal : normal);
    return static_cast<uint16_t>(result | sign);
  }
};

template <typename T>
struct SameCodec {
  using Storage = T;
  using Acc = T;
  static T load(T v) {
    return v;
  }
  static T store(T v) {
    return v;
  }
};

// Integer arithmetic wraps around: computed in an unsigned type at least as
// wide as int, so that neither signed overflow nor promotion to int is UB.
template <typename T>
using WrapType = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <typename T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<WrapType<T>>(a) + static_cast<WrapType<T>>(b));
  } else {
    return a + b;
  }
}

template <typename T>
T mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<WrapType<T>>(a) * static_cast<WrapType<T>>(b));
  } else {
    return a * b;
  }
}

// x != x is true only for NaN (this file is not built with -ffast-math).
template <typename T>
bool is_nan(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    return x != x;
  } else {
    return false;
  }
}

template <typename Codec, typename Op>
void fold(void* out_ptr, const void* const* inputs, int n, int64_t numel, Op op, typename Codec::Acc scale) {
  using S = typename Codec::Storage;
  using A = typename Codec::Acc;
  auto* out = static_cast<S*>(out_ptr);
  A acc[kBlock];
  for (int64_t base = 0; base < numel; base += kBlock) {
    const int64_t len = std::min(kBlock, numel - base);
    const S* first = static_cast<const S*>(inputs[0]) + base;
    for (int64_t k = 0; k < len; ++k) {
      acc[k] = Codec::load(first[k]);
    }
    for (int r = 1; r < n; ++r) {
      const S* src = static_cast<const S*>(inputs[r]) + base;
      for (int64_t k = 0; k < len; ++k) {
        acc[k] = op(acc[k], Codec::load(src[k]));
      }
    }
    S* dst = out + base;
    if (scale != A(1)) {
      for (int64_t k = 0; k < len; ++k) {
        dst[k] = Codec::store(acc[k] / scale);
      }
    } else {
      for (int64_t k = 0; k < len; ++k) {
        dst[k] = Codec::store(acc[k]);
      }
    }
  }
}

template <typename Codec>
void reduce_typed(Reduction kind, void* out, const void* const* inputs, int n, int64_t numel, int64_t avg_divisor) {
  using A = typename Codec::Acc;
  switch (kind) {
    case Reduction::Sum:
      return fold<Codec>(out, inputs, n, numel, [](A a, A b) { return add(a, b); }, A(1));
    case Reduction::Avg:
      return fold<Codec>(out, inputs, n, numel, [](A a, A b) { return add(a, b); }, static_cast<A>(avg_divisor));
    case Reduction::Product:
      return fold<Codec>(out, inputs, n, numel, [](A a, A b) { return mul(a, b); }, A(1));
    // NOTE [NaN under min and max]: as torch.minimum/maximum (and torch.amax),
    // a NaN on any rank makes the result NaN, whichever rank holds it and in
    // whatever order the fold meets it: the accumulator `a` keeps a NaN by
    // itself (every comparison with it is false) and a NaN `b` is taken. The
    // test is one more compare and an or per element; the loop still vectorises.
    case Reduction::Min:
      return fold<Codec>(out, inputs, n, numel, [](A a, A b) { return (b < a || is_nan(b)) ? b : a; }, A(1));
    case Reduction::Max:
      return fold<Codec>(out, inputs, n, numel, [](A a, A b) { return (a < b || is_nan(b)) ? b : a; }, A(1));
  }
}

} // namespace

// NOTE [runtime ISA dispatch]
// On x86-64 the entry point is compiled twice, for the baseline (SSE2) and
// for AVX2, with everything it calls inlined into each copy (flatten); the
// loader picks the copy the CPU supports (GNU ifunc). The wheel thus stays
// portable while the bf16/fp16 conversions, which are compute-bound at SSE2
// width, get 8-wide vectors where the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCH_TP_REDUCE_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), flatten))
#else
#define TORCH_TP_REDUCE_CLONES
#endif

bool reduction_supported(Reduction kind, c10::ScalarType dtype, const char** why) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kBFloat16:
    case c10::kHalf:
      return true;
    case c10::kChar:
    case c10::kByte:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
    case c10::kBool:
      if (kind == Reduction::Avg) {
        *why = "avg needs a floating-point dtype";
        return false;
      }
      return true;
    default:
      *why = "the dtype is not one of float32, float64, bfloat16, float16, int8, uint8, int16, int32, int64, bool";
      return false;
  }
}

TORCH_TP_REDUCE_CLONES
void reduce_inputs(Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs, int n_inputs,
                   int64_t numel, int64_t avg_divisor) {
  TORCH_INTERNAL_ASSERT(n_inputs >= 1 && avg_divisor >= 1);
  switch (dtype) {
    case c10::kFloat: return reduce_typed<SameCodec<float>>(kind, out, inputs, n_inputs, numel, avg_divisor);
    case c10::kDouble: return reduce_typed<SameCodec<double>>(kind, out, inputs, n_inputs, numel, avg_divisor);
    case c10::kBFloat16: return reduce_typed<BF16Codec>(kind, out, inputs, n_inputs, numel, avg_divisor);
    case c10::kHalf: return reduce_typed<HalfCodec>(kind, out, inputs, n_inputs, numel, avg_divisor);
    case c10::kChar: return reduce_typed<SameCodec<int8_t>>(kind, out, inputs, n_inputs, numel, 1);
    case c10::kByte: return reduce_typed<SameCodec<uint8_t>>(kind, out, inputs, n_inputs, numel, 1);
    case c10::kShort: return reduce_typed<SameCodec<int16_t>>(kind, out, inputs, n_inputs, numel, 1);
    case c10::kInt: return reduce_typed<SameCodec<int32_t>>(kind, out, inputs, n_inputs, numel, 1);
    case c10::kLong: return reduce_typed<SameCodec<int64_t>>(kind, out, inputs, n_inputs, numel, 1);
    case c10::kBool: {
      // bool is one byte holding 0 or 1: or is max, and is min.
      const Reduction as_bytes =
          (kind == Reduction::Sum || kind == Reduction::Max) ? Reduction::Max : Reduction::Min;
      return reduce_typed<SameCodec<uint8_t>>(as_bytes, out, inputs, n_inputs, numel, 1);
    }
    default: TORCH_INTERNAL_ASSERT(false, "reduce_inputs: unsupported dtype ", dtype);
  }
}

} // namespace torch_tp::backend

namespace torch_tp {

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::Sum: return "sum";
    case Reduction::Avg: return "avg";
    case Reduction::Product: return "product";
    case Reduction::Min: return "min";
    case Reduction::Max: return "max";
  }
  return "unknown";
}

} // namespace torch_tp
