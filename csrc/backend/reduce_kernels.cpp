#include "backend/reduce_kernels.h"

#include <c10/util/Exception.h>

#include <bit>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// NOTE [portable vectorisation]
// The wheel must run on any x86-64 (or aarch64), so there is no -march=native,
// and intrinsics only where a variant's target guarantees them (NOTE [float16
// in hardware]). The folds are written in GCC/Clang vector extensions on
// vectors of kBytes bytes, and compiled once per instruction set with kBytes
// its native width (NOTE [runtime ISA dispatch]): wider vectors than the
// target has are split by the compiler poorly, narrower ones waste the
// registers. Each step loads one vector from every input, folds them in
// registers and stores one vector, so a block is read completely before it
// is written (the output may be one of the inputs, at the same offset).
//
// bfloat16 and float16 widen to float32 without shuffles or lane-count
// changes: a vector of them is read as 32-bit words; the element in each
// word's low half becomes accumulator part 0 and the one in its high half
// part 1; storing puts them back the same way. Element order never changes,
// and the conversions are shifts, masks and selects on whole words.
//
// NOTE [float16 in hardware]
// float16's bit arithmetic is some twenty operations a vector each way, so
// it ran well behind bfloat16. The AVX2 and AVX-512 variants
// convert it with the conversion instructions instead (F16C, which every
// AVX2 CPU has, and AVX-512F; Half256 and Half512 below), the one place
// this file uses intrinsics, each inside its variant's target. They widen a
// vector's first half of elements into part 0 and its second half into part
// 1 and store them back the same way: element order still never changes,
// and the fold itself is the same float32 arithmetic, so the results are the
// baseline's bit for bit. (NaN payloads aside: the instructions carry a
// NaN's payload over, the bit arithmetic gives the canonical quiet NaN as c10
// does; no reduction promises a payload.) Storing rounds to nearest even, as the
// bit arithmetic does, whatever MXCSR's rounding mode.

namespace torch_tp::backend {
namespace {

template <typename T, int kBytes>
using Vector [[gnu::vector_size(kBytes)]] = T;  // kBytes / sizeof(T) lanes

// The codecs for one vector width. A codec's load turns one stored vector
// into kParts accumulator vectors (`Wide`), its store turns them back.
template <int kBytes>
struct Codecs {
  using Words = Vector<uint32_t, kBytes>;
  using Floats = Vector<float, kBytes>;
  // Comparisons below are on values under 2^31, signed (x86 before AVX-512
  // has no unsigned vector compare).
  using Ints = Vector<int32_t, kBytes>;
  static Ints as_int(Words w) {
    return std::bit_cast<Ints>(w);
  }

  // float32, float64, the integers and bool fold in their own type.
  template <typename T>
  struct Same {
    using Storage = T;
    using Acc = T;
    using Stored = Vector<T, kBytes>;
    using AccVec = Stored;
    static constexpr int kParts = 1;
    struct Wide {
      AccVec part[kParts];
    };
    static Wide load(Stored v) {
      return {{v}};
    }
    static Stored store(const Wide& w) {
      return w.part[0];
    }
  };

  // bfloat16 and float16: two float32 parts per vector of words.
  struct HalfWords {
    using Storage = uint16_t;
    using Acc = float;
    using Stored = Words;
    using AccVec = Floats;
    static constexpr int kParts = 2;
    struct Wide {
      AccVec part[kParts];
    };
  };

  // bfloat16 is the high half of a float32; storing rounds to nearest even and
  // keeps NaN a quiet NaN (c10's rounding).
  struct BF16 : HalfWords {
    static typename HalfWords::Wide load(Words w) {
      return {{std::bit_cast<Floats>(w << 16), std::bit_cast<Floats>(w & 0xffff0000u)}};
    }
    // The rounded bfloat16 in each word's high half (the low half is not zero).
    static Words round(Floats value) {
      const Words u = std::bit_cast<Words>(value);
      const Words rounded = u + 0x7fffu + ((u >> 16) & 1u);
      const Words quiet_nan = Words{} + 0x7fc00000u;
      return as_int(u & 0x7fffffffu) > 0x7f800000 ? quiet_nan : rounded;
    }
    static Words store(const typename HalfWords::Wide& w) {
      return (round(w.part[0]) >> 16) | (round(w.part[1]) & 0xffff0000u);
    }
  };

  // float16 <-> float32 in bit arithmetic with selects instead of branches
  // (c10::Half's conversions branch per element).
  struct Half : HalfWords {
    // `bits`: a float16 in each word's low half, zeros above.
    static Floats widen(Words bits) {
      const Words sign = (bits & 0x8000u) << 16;
      const Words rest = bits & 0x7fffu;  // exponent and mantissa
      // Shifted into float32's fields, the exponent is 112 too small; one
      // multiplication by 2^112 fixes it for normal and subnormal halfs alike.
      const Floats scaled = std::bit_cast<Floats>(rest << 13) * 0x1p112f;
      // Inf and NaN keep an all-ones exponent (and NaN its payload).
      const Words special = (rest << 13) | 0x7f800000u;
      const Words magnitude = as_int(rest) >= 0x7c00 ? special : std::bit_cast<Words>(scaled);
      return std::bit_cast<Floats>(magnitude | sign);
    }
    // The float16 in each word's low half, zeros above.
    static Words narrow(Floats value) {
      const Words u = std::bit_cast<Words>(value);
      const Words sign = (u >> 16) & 0x8000u;
      const Words mag = u & 0x7fffffffu;
      // >= 65520 rounds to inf; NaN stays a quiet NaN.
      const Words overflow = as_int(mag) > 0x7f800000 ? Words{} + 0x7e00u : Words{} + 0x7c00u;
      // Below 2^-14 the result is subnormal: adding 0.5 (exponent 126) lets the
      // float adder round the mantissa to nearest even at the right place.
      const Floats sub_sum = std::bit_cast<Floats>(mag) + 0.5f;
      const Words subnormal = std::bit_cast<Words>(sub_sum) - 0x3f000000u;
      // Normal: rebias the exponent by -112 and round the 13 dropped bits to
      // nearest even (add 0xfff plus the lowest kept bit, then truncate).
      const Words normal = (mag - (112u << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
      const Words result =
          as_int(mag) >= (143 << 23) ? overflow : (as_int(mag) < (113 << 23) ? subnormal : normal);
      return result | sign;
    }
    static typename HalfWords::Wide load(Words w) {
      return {{widen(w & 0xffffu), widen(w >> 16)}};
    }
    static Words store(const typename HalfWords::Wide& w) {
      return narrow(w.part[0]) | (narrow(w.part[1]) << 16);
    }
  };
};

#if defined(__x86_64__)
// The first (`which` 0) or second (1) half of a vector's bytes: a plain copy,
// which the compiler folds into the instruction that reads the half.
template <typename Half, typename Whole>
Half half_of(const Whole& whole, int which) {
  static_assert(2 * sizeof(Half) == sizeof(Whole));
  Half half;
  std::memcpy(&half, reinterpret_cast<const char*>(&whole) + which * sizeof(Half), sizeof(Half));
  return half;
}

// The float32 -> float16 conversions' rounding: to nearest even, whatever MXCSR says.
constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT;

// float16 through F16C at 32 bytes (NOTE [float16 in hardware]): each
// 16-byte half of the vector is eight float16, widened to eight float32.
struct Half256 : Codecs<32>::HalfWords {
  [[gnu::target("avx2,f16c")]] static Wide load(Stored w) {
    return {{std::bit_cast<AccVec>(_mm256_cvtph_ps(half_of<__m128i>(w, 0))),
             std::bit_cast<AccVec>(_mm256_cvtph_ps(half_of<__m128i>(w, 1)))}};
  }
  [[gnu::target("avx2,f16c")]] static Stored store(const Wide& w) {
    const __m128i first = _mm256_cvtps_ph(std::bit_cast<__m256>(w.part[0]), kNearestEven);
    const __m128i second = _mm256_cvtps_ph(std::bit_cast<__m256>(w.part[1]), kNearestEven);
    return std::bit_cast<Stored>(_mm256_set_m128i(second, first));
  }
};

// The same at 64 bytes with AVX-512F: each 32-byte half is sixteen float16.
// The maskz forms with every lane selected are the plain instructions; GCC 12's
// plain forms start from an undefined register that -Wmaybe-uninitialized flags.
struct Half512 : Codecs<64>::HalfWords {
  static constexpr __mmask16 kAllLanes = 0xffff;  // of 16 float32
  static constexpr __mmask8 kAllQuads = 0xff;     // of 8 64-bit lanes
  [[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]] static Wide load(Stored w) {
    return {{std::bit_cast<AccVec>(_mm512_maskz_cvtph_ps(kAllLanes, half_of<__m256i>(w, 0))),
             std::bit_cast<AccVec>(_mm512_maskz_cvtph_ps(kAllLanes, half_of<__m256i>(w, 1)))}};
  }
  [[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]] static Stored store(const Wide& w) {
    const __m256i first = _mm512_maskz_cvtps_ph(kAllLanes, std::bit_cast<__m512>(w.part[0]), kNearestEven);
    const __m256i second = _mm512_maskz_cvtps_ph(kAllLanes, std::bit_cast<__m512>(w.part[1]), kNearestEven);
    return std::bit_cast<Stored>(_mm512_maskz_inserti64x4(kAllQuads, _mm512_castsi256_si512(first), second, 1));
  }
};
#endif

// The float16 codec of each vector width: the conversion instructions where a
// variant has them, the bit arithmetic elsewhere.
template <int kBytes>
struct HalfCodec {
  using type = typename Codecs<kBytes>::Half;
};
#if defined(__x86_64__)
template <>
struct HalfCodec<32> {
  using type = Half256;
};
template <>
struct HalfCodec<64> {
  using type = Half512;
};
#endif

// Integer arithmetic wraps around: computed on unsigned lanes, where it is
// defined (vector lanes are not promoted to int).
template <typename T, typename V>
V add(V a, V b) {
  if constexpr (std::is_integral_v<T>) {
    using U = Vector<std::make_unsigned_t<T>, sizeof(V)>;
    return std::bit_cast<V>(std::bit_cast<U>(a) + std::bit_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T, typename V>
V mul(V a, V b) {
  if constexpr (std::is_integral_v<T>) {
    using U = Vector<std::make_unsigned_t<T>, sizeof(V)>;
    return std::bit_cast<V>(std::bit_cast<U>(a) * std::bit_cast<U>(b));
  } else {
    return a * b;
  }
}

// out[i] = fold over r of inputs[r][i], one stored vector per step; the last,
// partial vector is staged through zero-filled vectors.
template <typename Codec, typename Op>
void fold(void* out_ptr, const void* const* inputs, int n, int64_t numel, Op op, typename Codec::Acc scale) {
  using S = typename Codec::Storage;
  using Stored = typename Codec::Stored;
  constexpr int64_t kStep = sizeof(Stored) / sizeof(S);  // elements per step
  auto* out = static_cast<S*>(out_ptr);
  auto input = [&](int r, int64_t base) { return static_cast<const S*>(inputs[r]) + base; };
  // `load(r)` gives input r's vector; all are read before the result is stored.
  auto step = [&](auto load) {
    auto acc = Codec::load(load(0));
    for (int r = 1; r < n; ++r) {
      const auto next = Codec::load(load(r));
      for (int p = 0; p < Codec::kParts; ++p) {
        acc.part[p] = op(acc.part[p], next.part[p]);
      }
    }
    if constexpr (std::is_floating_point_v<typename Codec::Acc>) {
      if (scale != 1) {
        for (int p = 0; p < Codec::kParts; ++p) {
          acc.part[p] = acc.part[p] / scale;
        }
      }
    }
    return Codec::store(acc);
  };
  int64_t base = 0;
  for (; base + kStep <= numel; base += kStep) {
    const Stored result = step([&](int r) {
      Stored v;
      std::memcpy(&v, input(r, base), sizeof(v));
      return v;
    });
    std::memcpy(out + base, &result, sizeof(result));
  }
  if (base < numel) {
    const size_t rest = static_cast<size_t>(numel - base) * sizeof(S);
    const Stored result = step([&](int r) {
      Stored v{};
      std::memcpy(&v, input(r, base), rest);
      return v;
    });
    std::memcpy(out + base, &result, rest);
  }
}

template <typename Codec>
void reduce_typed(Reduction kind, void* out, const void* const* inputs, int n, int64_t numel, int64_t avg_divisor) {
  using A = typename Codec::Acc;
  using V = typename Codec::AccVec;
  switch (kind) {
    case Reduction::Sum:
      return fold<Codec>(out, inputs, n, numel, [](V a, V b) { return add<A>(a, b); }, A(1));
    case Reduction::Avg:
      return fold<Codec>(out, inputs, n, numel, [](V a, V b) { return add<A>(a, b); }, static_cast<A>(avg_divisor));
    case Reduction::Product:
      return fold<Codec>(out, inputs, n, numel, [](V a, V b) { return mul<A>(a, b); }, A(1));
    // NOTE [NaN under min and max]: as torch.minimum/maximum (and torch.amax),
    // a NaN on any rank makes the result NaN, whichever rank holds it and in
    // whatever order the fold meets it: the accumulator `a` keeps a NaN by
    // itself (every comparison with it is false) and a NaN `b` is taken
    // (b != b only for NaN: this file is not built with -ffast-math; for
    // integers the test is always false). Lane-wise selects, no branches.
    case Reduction::Min:
      return fold<Codec>(out, inputs, n, numel, [](V a, V b) { return ((b < a) | (b != b)) ? b : a; }, A(1));
    case Reduction::Max:
      return fold<Codec>(out, inputs, n, numel, [](V a, V b) { return ((a < b) | (b != b)) ? b : a; }, A(1));
  }
}

template <int kBytes>
void reduce_with_vectors_of(Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs, int n,
                            int64_t numel, int64_t avg_divisor) {
  using C = Codecs<kBytes>;
  switch (dtype) {
    case c10::kFloat: return reduce_typed<typename C::template Same<float>>(kind, out, inputs, n, numel, avg_divisor);
    case c10::kDouble: return reduce_typed<typename C::template Same<double>>(kind, out, inputs, n, numel, avg_divisor);
    case c10::kBFloat16: return reduce_typed<typename C::BF16>(kind, out, inputs, n, numel, avg_divisor);
    case c10::kHalf: return reduce_typed<typename HalfCodec<kBytes>::type>(kind, out, inputs, n, numel, avg_divisor);
    case c10::kChar: return reduce_typed<typename C::template Same<int8_t>>(kind, out, inputs, n, numel, 1);
    case c10::kByte: return reduce_typed<typename C::template Same<uint8_t>>(kind, out, inputs, n, numel, 1);
    case c10::kShort: return reduce_typed<typename C::template Same<int16_t>>(kind, out, inputs, n, numel, 1);
    case c10::kInt: return reduce_typed<typename C::template Same<int32_t>>(kind, out, inputs, n, numel, 1);
    case c10::kLong: return reduce_typed<typename C::template Same<int64_t>>(kind, out, inputs, n, numel, 1);
    case c10::kBool: {
      // bool is one byte holding 0 or 1: or is max, and is min.
      const Reduction as_bytes =
          (kind == Reduction::Sum || kind == Reduction::Max) ? Reduction::Max : Reduction::Min;
      return reduce_typed<typename C::template Same<uint8_t>>(as_bytes, out, inputs, n, numel, 1);
    }
    default: TORCH_INTERNAL_ASSERT(false, "reduce_inputs: unsupported dtype ", dtype);
  }
}

// NOTE [runtime ISA dispatch]
// The folds are compiled three times, each with everything it calls inlined
// (flatten) and its own vector width: 16 bytes for the baseline (SSE2 on
// x86-64, NEON on aarch64), 32 for AVX2 (with F16C) and 64 for AVX-512 (F, BW,
// DQ, VL).
// reduce_inputs takes the widest the CPU and OS support, checked once; the
// wheel stays portable and the bf16/fp16 conversions, which are compute-bound,
// get the widest vectors there are. reduce_inputs_with runs a given variant,
// so that tests hold every variant the CPU runs to the same results.
using FoldFn = void (*)(Reduction, c10::ScalarType, void*, const void* const*, int, int64_t, int64_t);

[[gnu::flatten]] void fold_baseline(Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs,
                                    int n, int64_t numel, int64_t avg_divisor) {
  reduce_with_vectors_of<16>(kind, dtype, out, inputs, n, numel, avg_divisor);
}

#if defined(__x86_64__)
[[gnu::target("avx2,f16c"), gnu::flatten]] void fold_avx2(Reduction kind, c10::ScalarType dtype, void* out,
                                                           const void* const* inputs, int n, int64_t numel,
                                                           int64_t avg_divisor) {
  reduce_with_vectors_of<32>(kind, dtype, out, inputs, n, numel, avg_divisor);
}

[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl"), gnu::flatten]] void fold_avx512(
    Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs, int n, int64_t numel,
    int64_t avg_divisor) {
  reduce_with_vectors_of<64>(kind, dtype, out, inputs, n, numel, avg_divisor);
}
#endif

bool cpu_runs(FoldIsa isa) {
  switch (isa) {
    case FoldIsa::Baseline: return true;
#if defined(__x86_64__)
    case FoldIsa::Avx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case FoldIsa::Avx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
    case FoldIsa::Avx2:
    case FoldIsa::Avx512: return false;
#endif
  }
  return false;
}

FoldFn fold_for(FoldIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case FoldIsa::Avx512: return fold_avx512;
    case FoldIsa::Avx2: return fold_avx2;
#endif
    default: return fold_baseline;
  }
}

} // namespace

const char* fold_isa_name(FoldIsa isa) {
  switch (isa) {
    case FoldIsa::Baseline: return "baseline";
    case FoldIsa::Avx2: return "avx2";
    case FoldIsa::Avx512: return "avx512";
  }
  return "unknown";
}

std::vector<FoldIsa> supported_fold_isas() {
  std::vector<FoldIsa> isas;
  for (const FoldIsa isa : {FoldIsa::Avx512, FoldIsa::Avx2, FoldIsa::Baseline}) {
    if (cpu_runs(isa)) {
      isas.push_back(isa);
    }
  }
  return isas;
}

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

void reduce_inputs_with(FoldIsa isa, Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs,
                        int n_inputs, int64_t numel, int64_t avg_divisor) {
  TORCH_INTERNAL_ASSERT(n_inputs >= 1 && avg_divisor >= 1);
  TORCH_CHECK(cpu_runs(isa), "torch_tp backend: the ", fold_isa_name(isa), " reduce kernels need a CPU that has ",
              fold_isa_name(isa));
  fold_for(isa)(kind, dtype, out, inputs, n_inputs, numel, avg_divisor);
}

void reduce_inputs(Reduction kind, c10::ScalarType dtype, void* out, const void* const* inputs, int n_inputs,
                   int64_t numel, int64_t avg_divisor) {
  TORCH_INTERNAL_ASSERT(n_inputs >= 1 && avg_divisor >= 1);
  static const FoldFn best = fold_for(supported_fold_isas().front());
  best(kind, dtype, out, inputs, n_inputs, numel, avg_divisor);
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
