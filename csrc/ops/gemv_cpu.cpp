// NOTE [few-row GEMV on the CPU]
// Decode runs one token per forward: every linear is a GEMV, x [1, K] @ W [N, K]^T,
// that reads each weight once and so should run at memory bandwidth. torch
// 2.14's CPU GEMM does not, in bfloat16 nor in float32, with W cache-resident
// or streamed from DRAM, and falls further behind as x gains rows; this
// kernel stays ahead of it with two ranks streaming at once, one thread each
// (benchmarks/RESULTS.md's decode sections time both in the model). The
// design, one template on the element type T:
//   - R rows of W per block (8 down to 3 as M grows: M * R accumulators, the
//     loads beside them, fit the 32 vector registers), one 64-byte load per W
//     row and per x row per step (32 bfloat16 or 16 float32 K-elements)
//     feeding M * R multiply-adds into float32 lanes (vdpbf16ps: pairs of
//     bfloat16 products; vfmadd231ps), so an x load serves R rows and a W
//     load M rows; the loops over M and R are unrolled so the accumulators
//     stay in registers (without that M >= 3 spilled and ran far slower);
//   - each step prefetches the same columns of the next block's rows: the
//     hardware prefetcher alone leaves a single core short of DRAM bandwidth
//     in bfloat16; in float32 prefetching lifts 4 and 8 rows and is a wash at
//     2, but at 1 row float32 streams faster without it (presumably the
//     prefetches take load slots the hardware prefetcher does not need
//     there), with one process and with two streaming at once, so float32
//     prefetches from 2 rows on;
//   - the K tail through masked (zeroing) loads, the N tail with R = 1;
//   - the bias added in float32 to the float32 sum, rounded once for a
//     bfloat16 or float16 output (to nearest even, as c10::BFloat16 and
//     c10::Half round), so the result is F.linear's in float32 (rounded), up to
//     the order of the float32 sum;
//   - at::parallel_for over output rows, in tasks of >= 64 KiB of W (inline
//     with one intra-op thread, as each rank runs).
// It takes up to kSmallBatchRows = 8 rows: at 8 it still beat at::mm, in
// bfloat16 and float32, cache-resident and from DRAM; at 9 ATen takes over.
// float16 runs the float32 loop on half the bytes, widened as it loads
// (vcvtph2ps): ATen's float16 GEMV is no faster than its bfloat16 one, even
// on a CPU with AVX-512 FP16 and AMX, and this loop beats it at every row
// count up to 8. Other dtypes go to ATen. A CPU
// without AVX-512 BF16 but with AVX2, FMA and F16C runs the variant of NOTE
// [few-row GEMV on AVX2]; one without, ATen's GEMM.

#include "ops/gemv_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torch_tp {

#if defined(__x86_64__)
namespace {

// The kernels' instruction set, on these functions only (the rest of the build
// keeps its flags); supported_gemv_isas guards every call into them.
#define TORCH_TP_GEMV_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")

// What the kernels need of an element type T: a 64-byte vector of it (Vec, kStep
// elements, loaded under a Mask of kStep bits, the others read as zeros),
// acc + x * w of two such vectors into 16 float32 lanes, and from how many x
// rows on the kernel prefetches W (NOTE [few-row GEMV on the CPU]).
template <typename T>
struct Lanes;

template <>
struct Lanes<c10::BFloat16> {
  using Vec = __m512i;
  using Mask = __mmask32;
  static constexpr int64_t kStep = 32;
  static constexpr int kPrefetchFromRows = 1;
  [[TORCH_TP_GEMV_TARGET, gnu::always_inline]] static inline Vec load(Mask mask, const c10::BFloat16* p) {
    return _mm512_maskz_loadu_epi16(mask, p);
  }
  // Pairs of products, each pair summed into one float32 lane.
  [[TORCH_TP_GEMV_TARGET, gnu::always_inline]] static inline __m512 multiply_add(__m512 acc, Vec x, Vec w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

template <>
struct Lanes<float> {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static constexpr int kPrefetchFromRows = 2;
  [[TORCH_TP_GEMV_TARGET, gnu::always_inline]] static inline Vec load(Mask mask, const float* p) {
    return _mm512_maskz_loadu_ps(mask, p);
  }
  [[TORCH_TP_GEMV_TARGET, gnu::always_inline]] static inline __m512 multiply_add(__m512 acc, Vec x, Vec w) {
    return _mm512_fmadd_ps(x, w, acc);
  }
};

// float16: the float32 loop over half the bytes, 16 float16 (32 bytes) a step
// widened to float32 as they load (vcvtph2ps). It prefetches from one x row on,
// as bfloat16 does: prefetching from two instead slowed one row (the dim 512
// decode shapes).
template <>
struct Lanes<c10::Half> : Lanes<float> {
  static constexpr int kPrefetchFromRows = 1;
  [[TORCH_TP_GEMV_TARGET, gnu::always_inline]] static inline Vec load(Mask mask, const c10::Half* p) {
    // The maskz form: GCC 12's plain _mm512_cvtph_ps trips -Wmaybe-uninitialized (as in sum_lanes).
    return _mm512_maskz_cvtph_ps(mask, _mm256_maskz_loadu_epi16(mask, p));
  }
};

// The sum of v's 16 lanes. GCC 12's plain shuffles (and _mm512_reduce_add_ps)
// start from an undefined register that -Wmaybe-uninitialized flags; the
// maskz forms with every lane selected are the same instructions.
[[TORCH_TP_GEMV_TARGET, gnu::always_inline]] inline float sum_lanes(__m512 v) {
  constexpr __mmask16 all = 0xffff;
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, 0x4e));  // + the other 256-bit half
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, 0xb1));  // + the neighbouring 128-bit quarter
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, 0x4e));        // + the other pair in the quarter
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, 0xb1));        // + the neighbouring lane
  return _mm512_cvtss_f32(v);
}

// acc[m][r] += x[m][k, k + kStep) . w[r][k, k + kStep), the elements outside `mask` read as zeros.
template <typename T, int M, int R>
[[TORCH_TP_GEMV_TARGET, gnu::always_inline]] inline void dot_step(__m512 (&acc)[M][R], const T* x, int64_t ldx,
                                                                 const T* w, int64_t K, int64_t k,
                                                                 typename Lanes<T>::Mask mask) {
  typename Lanes<T>::Vec wv[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if constexpr (M >= Lanes<T>::kPrefetchFromRows) {
      // The same columns of the next block's rows (NOTE [bfloat16 GEMV on the
      // CPU]); a prefetch past the end of W is harmless, it never faults.
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    }
    wv[r] = Lanes<T>::load(mask, w + r * K + k);
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const typename Lanes<T>::Vec xv = Lanes<T>::load(mask, x + m * ldx + k);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[m][r] = Lanes<T>::multiply_add(acc[m][r], xv, wv[r]);
    }
  }
}

// out[m][r] = sum_k x[m][k] * w[r][k] + bias[r] over R rows of W starting at w,
// for M rows of x (row stride ldx) and out (row stride ldo).
template <typename T, int M, int R>
[[TORCH_TP_GEMV_TARGET, gnu::always_inline]] inline void dot_rows(const T* x, int64_t ldx, const T* w, int64_t K,
                                                                 const T* bias, T* out, int64_t ldo) {
  using Mask = typename Lanes<T>::Mask;
  constexpr int64_t kStep = Lanes<T>::kStep;
  __m512 acc[M][R];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[m][r] = _mm512_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    dot_step<T, M, R>(acc, x, ldx, w, K, k, static_cast<Mask>(~Mask{0}));
  }
  if (k < K) {
    dot_step<T, M, R>(acc, x, ldx, w, K, k, static_cast<Mask>((uint64_t{1} << (K - k)) - 1));
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float b = bias ? static_cast<float>(bias[r]) : 0.0f;
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      out[m * ldo + r] = static_cast<T>(sum_lanes(acc[m][r]) + b);  // bfloat16, float16: rounded to nearest even
    }
  }
}

// Output rows [n_begin, n_end) of every x row.
template <typename T, int M>
[[TORCH_TP_GEMV_TARGET]] void gemv_rows(const T* x, int64_t ldx, const T* w, const T* bias, T* out, int64_t ldo,
                                        int64_t K, int64_t n_begin, int64_t n_end) {
  // Accumulators: M * R of the 32 vector registers, leaving room for the loads.
  constexpr int R = M <= 2 ? 8 : M == 3 ? 6 : M == 4 ? 5 : M <= 6 ? 4 : 3;
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    dot_rows<T, M, R>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (; n < n_end; ++n) {
    dot_rows<T, M, 1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
  }
}

// ---------------------------------------------------------------- AVX2 (with FMA)

#define TORCH_TP_GEMV_AVX2 gnu::target("avx2,fma,f16c")

// A kernel's output rows [n_begin, n_end): (x, ldx, w, bias, out, ldo, K, n_begin, n_end).
template <typename T>
using GemvRows = void (*)(const T*, int64_t, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t);

namespace avx2 {

// NOTE [few-row GEMV on AVX2]
// CPUs without AVX-512 BF16 (AMD before Zen 4, most Intel client parts) get
// the same design in 32-byte vectors: 16 registers, so fewer W rows per block
// (rows_per_block: M * R accumulators beside the loads), full loads only (the
// K tail summed in scalars, in float32 as the rest), and bfloat16 widened in
// registers instead of vdpbf16ps: 16 elements read as 8 words, the low halves
// shifted up and the high halves masked are exactly their float32 values, and
// x and W split alike, so the two halves' products are the pairs vdpbf16ps
// sums. float16 is widened by F16C's vcvtph2ps, 8 elements a load, into the
// float32 loop. It beats ATen from DRAM at every row count up to 8, in
// float32 and bfloat16; the prefetch choices are the AVX-512 variant's, not
// tuned here (its speed drifted too much between runs to tune them on). One
// and two x rows read W row by
// row instead, NOTE [W row by row on AVX2], which keeps one row ahead of
// F.linear alone and with a second rank streaming at once.
template <typename T>
struct Lanes256;

template <>
struct Lanes256<c10::BFloat16> {
  // 16 bfloat16 read as 8 32-bit words: the elements in the words' low halves
  // (even K) and high halves (odd K), each widened to 8 float32 lanes.
  struct Vec {
    __m256 even, odd;
  };
  static constexpr int64_t kStep = 16;
  static constexpr int kPrefetchFromRows = 1;
  // W rows per block for M >= 3 x rows (fewer: NOTE [W row by row on AVX2]):
  // M * R accumulators, 2 for an x vector, 2 R for W's.
  static constexpr int rows_per_block(int M) {
    return M <= 4 ? 2 : 1;
  }
  [[TORCH_TP_GEMV_AVX2, gnu::always_inline]] static inline Vec load(const c10::BFloat16* p) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  [[TORCH_TP_GEMV_AVX2, gnu::always_inline]] static inline __m256 multiply_add(__m256 acc, Vec x, Vec w) {
    return _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc));
  }
};

template <>
struct Lanes256<float> {
  using Vec = __m256;
  static constexpr int64_t kStep = 8;
  static constexpr int kPrefetchFromRows = 2;
  // M >= 3: M * R accumulators, 1 for an x vector, R for W's.
  static constexpr int rows_per_block(int M) {
    return M == 3 ? 3 : M <= 5 ? 2 : 1;
  }
  [[TORCH_TP_GEMV_AVX2, gnu::always_inline]] static inline Vec load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  [[TORCH_TP_GEMV_AVX2, gnu::always_inline]] static inline __m256 multiply_add(__m256 acc, Vec x, Vec w) {
    return _mm256_fmadd_ps(x, w, acc);
  }
};

// float16: the float32 loop over half the bytes, 8 float16 a step widened to
// float32 as they load (F16C's vcvtph2ps); prefetching as bfloat16 does.
template <>
struct Lanes256<c10::Half> : Lanes256<float> {
  static constexpr int kPrefetchFromRows = 1;
  [[TORCH_TP_GEMV_AVX2, gnu::always_inline]] static inline Vec load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

[[TORCH_TP_GEMV_AVX2, gnu::always_inline]] inline float sum_lanes(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // the two 128-bit halves
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));                                   // + the other pair
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));                               // + the neighbouring lane
  return _mm_cvtss_f32(sum);
}

// acc[m][r] += x[m][k, k + kStep) . w[r][k, k + kStep).
template <typename T, int M, int R>
[[TORCH_TP_GEMV_AVX2, gnu::always_inline]] inline void dot_step(__m256 (&acc)[M][R], const T* x, int64_t ldx,
                                                               const T* w, int64_t K, int64_t k) {
  typename Lanes256<T>::Vec wv[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if constexpr (M >= Lanes256<T>::kPrefetchFromRows) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    }
    wv[r] = Lanes256<T>::load(w + r * K + k);
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const typename Lanes256<T>::Vec xv = Lanes256<T>::load(x + m * ldx + k);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[m][r] = Lanes256<T>::multiply_add(acc[m][r], xv, wv[r]);
    }
  }
}

template <typename T, int M, int R>
[[TORCH_TP_GEMV_AVX2, gnu::always_inline]] inline void dot_rows(const T* x, int64_t ldx, const T* w, int64_t K,
                                                               const T* bias, T* out, int64_t ldo) {
  constexpr int64_t kStep = Lanes256<T>::kStep;
  __m256 acc[M][R];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[m][r] = _mm256_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    dot_step<T, M, R>(acc, x, ldx, w, K, k);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float b = bias ? static_cast<float>(bias[r]) : 0.0f;
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      float tail = 0.0f;  // the K elements after the last full vector
      for (int64_t j = k; j < K; ++j) {
        tail += static_cast<float>(x[m * ldx + j]) * static_cast<float>(w[r * K + j]);
      }
      out[m * ldo + r] = static_cast<T>(sum_lanes(acc[m][r]) + tail + b);  // bfloat16, float16: rounded to nearest even
    }
  }
}

template <typename T, int M>
[[TORCH_TP_GEMV_AVX2]] void gemv_rows(const T* x, int64_t ldx, const T* w, const T* bias, T* out, int64_t ldo,
                                           int64_t K, int64_t n_begin, int64_t n_end) {
  constexpr int R = Lanes256<T>::rows_per_block(M);
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    dot_rows<T, M, R>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (; n < n_end; ++n) {
    dot_rows<T, M, 1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo);
  }
}

// NOTE [W row by row on AVX2]
// With one or two x rows, gemv_rows' blocks read R rows of W side by side: R
// short streams (a row is 1-2 KiB at the models' K) that the hardware
// prefetcher picks up anew at every block. Read a row at a time, front to
// back like a sum, W streams faster: in standalone loops over the decode
// shapes' weights (cycled from DRAM, two processes, one per core, at once),
// row by row came near a plain AVX2 sum at one and two x rows in float32 and
// bfloat16, where the blocks fell behind. Through torch_tp's op at two rows,
// both ranks at once, row by row wins in float32 and, within the runs'
// spread, in bfloat16 (the op's call costs more of a bfloat16 GEMV). At 4 x
// rows it was a wash in bfloat16 (a gain in float32), and at 8 slower in
// both, so from 3 rows on the blocks stay. A step reads 128 bytes of
// W (2 cache lines) into four accumulators per x row, which cover the
// multiply-add latency. A software prefetch 1 KiB ahead (past the row's end:
// the next row's start) helps bfloat16 and two float32 rows; one float32 row
// runs best on the hardware prefetcher alone (1-4 KiB ahead slowed it).
// Widening x to float32 once per call instead of in every row did not pay.
// float16 takes bfloat16's prefetch (as many bytes a row; not measured here).
template <typename T, int M>
constexpr int64_t kRowByRowPrefetchBytes = (!std::is_same_v<T, float> || M >= 2) ? 1024 : 0;

// out[m][n] = x[m] . w[n] + bias[n] for M (1 or 2) x rows and n in [n_begin, n_end):
// GemvRows reading W row by row.
template <typename T, int M>
[[TORCH_TP_GEMV_AVX2]] void gemv_row_by_row(const T* x, int64_t ldx, const T* w, const T* bias, T* out,
                                            int64_t ldo, int64_t K, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kStep = Lanes256<T>::kStep;
  constexpr int kVectors = 4;  // W vectors per step (128 bytes), each into its own accumulator per x row
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* row = w + n * K;
    __m256 acc[M][kVectors];
    #pragma GCC unroll 2
    for (int m = 0; m < M; ++m) {
      #pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        acc[m][v] = _mm256_setzero_ps();
      }
    }
    int64_t k = 0;
    for (; k + kVectors * kStep <= K; k += kVectors * kStep) {
      if constexpr (kRowByRowPrefetchBytes<T, M> > 0) {
        const char* ahead = reinterpret_cast<const char*>(row + k) + kRowByRowPrefetchBytes<T, M>;  // never faults
        #pragma GCC unroll 2
        for (int64_t line = 0; line < kVectors * kStep * static_cast<int64_t>(sizeof(T)); line += 64) {
          _mm_prefetch(ahead + line, _MM_HINT_T0);  // the step's 128 bytes (64 in float16)
        }
      }
      #pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        const typename Lanes256<T>::Vec wv = Lanes256<T>::load(row + k + v * kStep);
        #pragma GCC unroll 2
        for (int m = 0; m < M; ++m) {
          acc[m][v] = Lanes256<T>::multiply_add(acc[m][v], Lanes256<T>::load(x + m * ldx + k + v * kStep), wv);
        }
      }
    }
    for (; k + kStep <= K; k += kStep) {
      const typename Lanes256<T>::Vec wv = Lanes256<T>::load(row + k);
      #pragma GCC unroll 2
      for (int m = 0; m < M; ++m) {
        acc[m][0] = Lanes256<T>::multiply_add(acc[m][0], Lanes256<T>::load(x + m * ldx + k), wv);
      }
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    #pragma GCC unroll 2
    for (int m = 0; m < M; ++m) {
      float tail = 0.0f;  // the K elements after the last full vector
      for (int64_t j = k; j < K; ++j) {
        tail += static_cast<float>(x[m * ldx + j]) * static_cast<float>(row[j]);
      }
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
      out[m * ldo + n] = static_cast<T>(sum_lanes(sum) + tail + b);  // bfloat16, float16: rounded to nearest even
    }
  }
}

// Output rows [n_begin, n_end) of M x rows (NOTE [W row by row on AVX2] up to 2).
template <typename T, int M>
constexpr GemvRows<T> rows_for() {
  if constexpr (M <= 2) {
    return gemv_row_by_row<T, M>;
  } else {
    return gemv_rows<T, M>;
  }
}

} // namespace avx2

#undef TORCH_TP_GEMV_AVX2

// ---------------------------------------------------------------- dispatch

template <typename T, int... Ms>
constexpr GemvRows<T> gemv_for(GemvIsa isa, int64_t rows, std::integer_sequence<int, Ms...>) {
  GemvRows<T> fn = nullptr;
  ((rows == Ms + 1 ? (fn = isa == GemvIsa::Avx512 ? gemv_rows<T, Ms + 1> : avx2::rows_for<T, Ms + 1>(), 0) : 0), ...);
  return fn;
}

// out [M, N] = x2d @ weight^T + bias in T, the arguments checked by the caller.
template <typename T>
at::Tensor gemv(GemvIsa isa, const at::Tensor& x2d, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t M = x2d.size(0);
  const int64_t K = x2d.size(1);
  const int64_t N = weight.size(0);
  const GemvRows<T> rows = gemv_for<T>(isa, M, std::make_integer_sequence<int, kSmallBatchRows>{});
  TORCH_INTERNAL_ASSERT(rows != nullptr);
  // Its own profiler event: the GEMV's time, apart from the op around it (benchmarks/bench_decode.py).
  RECORD_FUNCTION("torch_tp::small_batch_linear_cpu", std::vector<c10::IValue>());
  at::Tensor out = at::empty({M, N}, x2d.options());
  const T* x = x2d.const_data_ptr<T>();
  const T* w = weight.const_data_ptr<T>();
  const T* b = bias ? bias->const_data_ptr<T>() : nullptr;
  T* y = out.mutable_data_ptr<T>();
  const int64_t ldx = x2d.stride(0);
  // A task streams at least ~64 KiB of W, so small layers stay on one thread.
  const int64_t grain = std::max<int64_t>(16, (int64_t{64} << 10) / (static_cast<int64_t>(sizeof(T)) * K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { rows(x, ldx, w, b, y, N, K, begin, end); });
  return out;
}

bool cpu_has_avx512_bf16() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
}

bool cpu_has_avx2_fma_f16c() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return supported;
}

#undef TORCH_TP_GEMV_TARGET

} // namespace
#endif

std::vector<GemvIsa> supported_gemv_isas() {
  std::vector<GemvIsa> isas;
#if defined(__x86_64__)
  if (cpu_has_avx512_bf16()) {
    isas.push_back(GemvIsa::Avx512);
  }
  if (cpu_has_avx2_fma_f16c()) {
    isas.push_back(GemvIsa::Avx2);
  }
#endif
  return isas;
}

const char* gemv_isa_name(GemvIsa isa) {
  return isa == GemvIsa::Avx512 ? "avx512" : "avx2";
}

std::optional<at::Tensor> small_batch_linear_cpu_with(GemvIsa isa, const at::Tensor& x2d, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias) {
#if defined(__x86_64__)
  const int64_t M = x2d.size(0);
  const at::ScalarType dtype = x2d.scalar_type();
  const bool kernel_dtype = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!x2d.device().is_cpu() || !weight.device().is_cpu() || !kernel_dtype ||
      weight.scalar_type() != dtype || M < 1 || M > kSmallBatchRows || x2d.size(1) < 1 || weight.size(0) < 1 ||
      !weight.is_contiguous() || (x2d.stride(1) != 1) ||
      (bias && (!bias->device().is_cpu() || bias->scalar_type() != dtype || !bias->is_contiguous()))) {
    return std::nullopt;
  }
  const std::vector<GemvIsa> isas = supported_gemv_isas();
  TORCH_CHECK(std::find(isas.begin(), isas.end(), isa) != isas.end(), "torch_tp: the ", gemv_isa_name(isa),
              " GEMV does not run on this CPU");
  switch (dtype) {
    case at::kFloat:
      return gemv<float>(isa, x2d, weight, bias);
    case at::kBFloat16:
      return gemv<c10::BFloat16>(isa, x2d, weight, bias);
    default:
      return gemv<c10::Half>(isa, x2d, weight, bias);
  }
#else
  (void)isa;
  (void)x2d;
  (void)weight;
  (void)bias;
  return std::nullopt;
#endif
}

std::optional<at::Tensor> small_batch_linear_cpu(const at::Tensor& x2d, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias) {
  static const std::vector<GemvIsa> isas = supported_gemv_isas();
  if (isas.empty()) {
    return std::nullopt;
  }
  return small_batch_linear_cpu_with(isas.front(), x2d, weight, bias);
}

} // namespace torch_tp
