#pragma once
// Row loops compiled for several x86 instruction sets in one build, the
// widest the CPU runs picked at run time (the fused cross entropy's and
// RMSNorm's, cross_entropy.cpp and norm.cpp).
//
// NOTE [instruction-set variants of the row loops]
// The library is built for the baseline x86-64 ISA (SSE2), so that one wheel
// runs on every x86-64 CPU; a loop vectorised there moves 4 floats a step. A
// row loop written once as `Loop::run(args...)` is compiled again inside
// functions carrying gnu::target("avx2,fma") and gnu::target("avx512...")
// with gnu::flatten, which inlines Loop::run (and what it calls) into each,
// so every variant is vectorised for its own width. isa_entry<Loop>(isa)
// hands back the variant as a plain function pointer; callers pick
// widest_cpu_isa() and call it from inside their at::parallel_for chunk (a
// lambda is compiled for the baseline: the loop must sit behind the
// pointer). Variants may differ in the last bits where a loop reduces (one
// partial sum per vector lane), so tests hold each variant the CPU runs to
// the same reference (supported_cpu_isas()).

#include <vector>

namespace torch_tp {

enum class CpuIsa { Avx512, Avx2, Baseline };

// The variants this CPU runs, widest first.
inline std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    isas.push_back(CpuIsa::Avx512);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    isas.push_back(CpuIsa::Avx2);
  }
#endif
  isas.push_back(CpuIsa::Baseline);
  return isas;
}

// The variant the ops run: the widest this CPU supports.
inline CpuIsa widest_cpu_isa() {
  static const CpuIsa isa = supported_cpu_isas().front();
  return isa;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Baseline: return "baseline";
  }
  return "unknown";
}

namespace isa_detail {

template <typename Loop, typename... Args>
[[gnu::flatten]] void run_baseline(Args... args) {
  Loop::run(args...);
}
#if defined(__x86_64__)
template <typename Loop, typename... Args>
[[gnu::target("avx2,fma"), gnu::flatten]] void run_avx2(Args... args) {
  Loop::run(args...);
}
template <typename Loop, typename... Args>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl"), gnu::flatten]] void run_avx512(Args... args) {
  Loop::run(args...);
}
#endif

template <typename Loop, typename... Args>
auto entry(CpuIsa isa, void (*)(Args...)) -> void (*)(Args...) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::Avx512: return run_avx512<Loop, Args...>;
    case CpuIsa::Avx2: return run_avx2<Loop, Args...>;
#endif
    default: return run_baseline<Loop, Args...>;
  }
}

} // namespace isa_detail

// Loop::run (a static function of value and pointer arguments) compiled for `isa`.
template <typename Loop>
auto isa_entry(CpuIsa isa) {
  return isa_detail::entry<Loop>(isa, static_cast<decltype(&Loop::run)>(nullptr));
}

} // namespace torch_tp
