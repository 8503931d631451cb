// NOTE [half-precision GEMMs through float32 panels]
// ATen runs a bfloat16 or float16 GEMM on the CPU through oneDNN where oneDNN
// supports the type natively (bfloat16: AVX-512 core or AVX-NE-CONVERT;
// float16: AVX-512 FP16 or AVX-NE-CONVERT) and otherwise through its scalar
// fallback loops. On an AVX2 CPU torch 2.14's fallback runs x @ W^T, and
// grad @ W (W not transposed, the input gradient) even more so, far slower
// than float32 SGEMM: a bfloat16 model (autocast training, a bfloat16 prompt,
// batched decode above kSmallBatchRows rows) spends many times its float32
// GEMM time in the forward GEMMs there, and more in the input gradient's. On
// such a CPU
// local_mm computes a [M, K] @ b [K, N] as
//     a32 = float32(a)                                   (once)
//     for each panel of b's columns [n0, n1):            (~2 MiB in float32)
//         out[:, n0:n1] = round(a32 @ float32(b[:, n0:n1]) (+ bias[n0:n1]))
// The conversions are O(MK + KN + MN) against the GEMM's O(MNK); the panels
// keep the float32 copy of b (usually the weight) cache-sized instead of twice
// the weight's size, at the speed of converting it whole (alike from the
// example's shapes to LLM-sized ones). Each entry is
// the float32 sum of the half-precision products rounded once to nearest even,
// as ATen's fallback and oneDNN compute it too (each within half an ulp of the
// exact product plus the float32 sum's error, checked for ATen's fallback at
// the test's shapes): the panels change the speed, not the numbers' accuracy;
// the float32 sums' order differs, so an entry may differ by an ulp.

#include "ops/gemm_cpu.h"

#include <ATen/ATen.h>

#include <algorithm>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace torch_tp {

namespace {

#if defined(__x86_64__)
// CPUID leaf 7's feature bits (sub-leaf 0 or 1, register EDX).
bool cpuid7_edx_bit(unsigned subleaf, unsigned bit) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, subleaf, &eax, &ebx, &ecx, &edx) && ((edx >> bit) & 1U);
}

// oneDNN's conditions for a native GEMM of the type, which ATen's mm takes.
bool onednn_has_native_gemm(at::ScalarType dtype) {
  static const bool avx512_core = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  static const bool avx512_fp16 = avx512_core && cpuid7_edx_bit(0, 23);
  static const bool avx_ne_convert = __builtin_cpu_supports("avx2") && cpuid7_edx_bit(1, 5);
  return dtype == at::kBFloat16 ? avx512_core || avx_ne_convert : avx512_fp16 || avx_ne_convert;
}
#endif

// b's columns per panel: ~2 MiB of float32, at least 64 columns.
int64_t panel_columns(int64_t k) {
  constexpr int64_t kPanelBytes = int64_t{2} << 20;
  return std::max<int64_t>(64, kPanelBytes / (static_cast<int64_t>(sizeof(float)) * std::max<int64_t>(k, 1)));
}

at::Tensor mm_through_float32_panels(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  const int64_t n = b.size(1);
  at::Tensor out = at::empty({a.size(0), n}, a.options());
  const at::Tensor a32 = a.to(at::kFloat);
  const int64_t step = panel_columns(b.size(0));
  for (int64_t n0 = 0; n0 < n; n0 += step) {
    const int64_t width = std::min(step, n - n0);
    const at::Tensor b32 = b.narrow(1, n0, width).to(at::kFloat);
    const at::Tensor part = bias ? at::addmm(bias->narrow(0, n0, width).to(at::kFloat), a32, b32) : at::mm(a32, b32);
    out.narrow(1, n0, width).copy_(part);
  }
  return out;
}

} // namespace

bool half_gemm_through_float32(at::ScalarType dtype) {
#if defined(__x86_64__)
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && !onednn_has_native_gemm(dtype);
#else
  (void)dtype;
  return false;
#endif
}

at::Tensor local_mm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  // One or two rows of a against b = W^T of a row-major W [N, K] stay ATen's:
  // its fallback computes them as dot products of contiguous rows, faster than
  // the panels' conversions at that size (float16 at the decode shapes of
  // bench_decode's dim512x8: ATen's dot products win at one and two rows, the
  // panels from four). The linear ops'
  // forward rows go to the decode GEMV first (linear_gemm_aten); these are the
  // ones it does not take, such as x strided in K.
  const bool aten_dot_products = a.size(0) <= 2 && b.stride(0) == 1 && b.stride(1) == b.size(0);
  const bool panels = a.device().is_cpu() && b.device().is_cpu() && (!bias || bias->device().is_cpu()) &&
      b.scalar_type() == a.scalar_type() && (!bias || bias->scalar_type() == a.scalar_type()) &&
      a.numel() > 0 && b.numel() > 0 && !aten_dot_products && half_gemm_through_float32(a.scalar_type());
  if (panels) {
    return mm_through_float32_panels(a, b, bias);
  }
  return bias ? at::addmm(*bias, a, b) : at::mm(a, b);
}

} // namespace torch_tp
