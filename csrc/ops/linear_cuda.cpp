// CUDA forward GEMM of the linear ops: cuBLASLt with the bias, and optionally
// GELU (tanh), fused into its epilogue, on the current stream under a device
// guard. Compiled only in CUDA builds. Checked against torch's own cuBLASLt
// GEMMs (aten/src/ATen/cuda/CUDABlas.cpp: bgemm_internal_cublaslt,
// gemm_and_bias) and TransformerEngine's (common/gemm/cublaslt_gemm.cu).
//
// NOTE [row-major GEMM in cuBLASLt]
// cuBLASLt is column-major. A row-major [r, c] buffer is the column-major
// [c, r] matrix, so out [M, N] = x [M, K] @ W [N, K]^T is computed as its
// column-major twin out^T [N, M] = W^T(as stored: [K, N], op T -> [N, K]) @ x(as stored: [K, M]).
// Hence m = N, n = M, k = K, transa = T, transb = N, lda = ldb = K, ldc = N.
// The epilogue's bias has m = N entries, one per output feature, and the
// GELU auxiliary output (the pre-activation, kept for backward) has out's layout.
//
// NOTE [cuBLASLt or ATen]
// cuBLASLt earns its place only by the epilogue, so it runs only where there
// is one to fuse (a bias or GELU): a plain GEMM (every row-parallel one, a
// column layer without bias or activation) is at::mm, which picks cuBLAS or
// cuBLASLt itself and honours all of torch's settings. ATen's unfused GEMMs,
// which compute the same function, also take
//   - what is refused before any cuBLASLt call: float64 (no epilogue kernels),
//     an empty matrix (M, N or K = 0: an empty shard), GELU with N not a
//     multiple of 8 (the auxiliary output's leading dim must be), and float16
//     under torch.backends.cuda.matmul.allow_fp16_accumulation (torch then
//     accumulates in float16; this file does not reproduce that);
//   - a heuristic that answers CUBLAS_STATUS_NOT_SUPPORTED or no algorithm
//     (say, for an alignment no kernel takes), silently: that is a property of
//     the problem, as in torch;
//   - a failed cublasLtMatmul, with a warning (once), as torch's gemm_and_bias
//     recovers with its unfused path.
// Every other failure (descriptors, attributes, the heuristic's other errors)
// raises, naming the op, the shapes and cuBLAS's status string.
//
// NOTE [cuBLASLt pointer alignment]
// Unless told otherwise, cuBLASLt's heuristic assumes A, B, C and D are
// 256-byte aligned and may pick a kernel with vector loads that need it. A view
// with a storage offset (x[1:], a slice of a fused weight) can be aligned to as
// little as its element size, so each pointer's actual alignment (the largest
// power of two dividing its address, at most 256: torch's _getAlignment and
// TransformerEngine's) goes into the preference; the heuristic then picks a
// kernel that takes it, or none (ATen computes it). The bias has no such
// preference. The cuBLASLt docs say the heuristic reads the bias pointer's
// value for its alignment, yet torch has seen a bias epilogue fault with
// "misaligned address" on a bias sliced from a larger buffer (pytorch/pytorch
// PR 194497), so a bias under 16-byte alignment is copied: N elements, into a
// fresh (256-byte aligned) allocation. out and the GELU input are fresh
// allocations too.

#include "ops/linear.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cublasLt.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace torch_tp {
namespace {

// What an error names: the op, the GEMM's operands and cuBLAS's status string.
// (cublasLtGetStatusString is libcublasLt's own, so no libcublas is needed.)
struct Problem {
  const char* op;
  at::IntArrayRef x_sizes;       // x as the GEMM takes it: [M, K]
  at::IntArrayRef weight_sizes;  // [N, K]

  template <typename... What>
  void check(cublasStatus_t status, const What&... what) const {
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, op, ": cuBLASLt ", what..., " of x ", x_sizes, " and weight ",
                weight_sizes, " failed: ", cublasLtGetStatusString(status));
  }
};

// Owners of cuBLASLt descriptors: destroyed on every path, the error ones included.
struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* desc) const {
    cublasLtMatmulDescDestroy(desc);
  }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* layout) const {
    cublasLtMatrixLayoutDestroy(layout);
  }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* preference) const {
    cublasLtMatmulPreferenceDestroy(preference);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

Layout make_layout(const Problem& problem, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  problem.check(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld), "matrix layout");
  return Layout(layout);
}

// The attribute's type is that of `value`, exactly (the cuBLASLt header gives each one).
template <typename T>
void set_attribute(const Problem& problem, cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                   const T& value) {
  problem.check(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)),
                "matmul descriptor attribute ", static_cast<int>(attribute));
}

template <typename T>
void set_preference(const Problem& problem, cublasLtMatmulPreference_t preference,
                    cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
  problem.check(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)),
                "matmul preference attribute ", static_cast<int>(attribute));
}

std::optional<cudaDataType_t> cuda_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: return std::nullopt;
  }
}

// See NOTE [cuBLASLt pointer alignment].
uint32_t alignment_bytes(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (address % alignment != 0) {
    alignment /= 2;
  }
  return alignment;
}

// float32 computes in TF32 exactly when torch's own cuBLASLt GEMMs do: when
// torch.backends.cuda.matmul.fp32_precision is "tf32" (allow_tf32 = True and
// set_float32_matmul_precision("high"/"medium") set it). Read as CUDABlas.cpp
// reads it; allowTF32CuBLAS() would also throw when a script mixed the legacy
// and the new API, which torch's GEMMs do not.
cublasComputeType_t compute_type(at::ScalarType dtype) {
  const bool tf32 = dtype == at::kFloat &&
      at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
          at::Float32Precision::TF32;
  return tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction as
// torch's cuBLASLt GEMMs apply them: the split-K reduction schemes the
// heuristic may pick. nullopt: cuBLASLt's default, every scheme (torch's
// default too). The other settings keep the reduction in float32 (the compute
// type) or forbid split-K altogether.
std::optional<uint32_t> reduction_scheme_mask(at::ScalarType dtype) {
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return std::nullopt;  // float32 reduces in float32 whatever the scheme
  }
  const at::Context& context = at::globalContext();
  switch (dtype == at::kHalf ? context.allowFP16ReductionCuBLAS() : context.allowBF16ReductionCuBLAS()) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK:
      return std::nullopt;
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK:
      return static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    case at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK:
      return static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown at::CuBLASReductionOption");
}

// The fused GEMM, or nullopt where ATen's GEMMs compute it (NOTE [cuBLASLt or ATen]).
std::optional<GemmResult> gemm_cublaslt(const char* op, const at::Tensor& x2d, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, Activation activation) {
  const at::ScalarType dtype = x2d.scalar_type();
  const auto type = cuda_type(dtype);
  const int64_t m = weight.size(0);  // N
  const int64_t n = x2d.size(0);     // M
  const int64_t k = x2d.size(1);     // K
  const bool gelu = activation == Activation::GeluTanh;
  const bool fp16_accumulation = dtype == at::kHalf && at::globalContext().allowFP16AccumulationCuBLAS();
  if (!type || m == 0 || n == 0 || k == 0 || (gelu && m % 8 != 0) || fp16_accumulation) {
    return std::nullopt;
  }
  const Problem problem{op, x2d.sizes(), weight.sizes()};
  const at::Tensor a = weight.contiguous();
  const at::Tensor b = x2d.contiguous();
  at::Tensor bias_vector;
  if (bias) {
    bias_vector = bias->contiguous();
    if (alignment_bytes(bias_vector.const_data_ptr()) < 16) {
      bias_vector = bias_vector.clone();  // NOTE [cuBLASLt pointer alignment]
    }
  }
  at::Tensor out = at::empty({n, m}, x2d.options());
  at::Tensor pre = gelu ? at::empty({n, m}, x2d.options()) : at::Tensor();

  cublasLtMatmulDesc_t raw_desc = nullptr;
  problem.check(cublasLtMatmulDescCreate(&raw_desc, compute_type(dtype), CUDA_R_32F), "matmul descriptor");
  const MatmulDesc desc(raw_desc);
  set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T));
  set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N));
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (bias) {
    epilogue = gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
    set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_vector.const_data_ptr());
  } else {
    TORCH_INTERNAL_ASSERT(gelu, "cuBLASLt without an epilogue to fuse");
    epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
  }
  set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(epilogue));
  if (gelu) {
    set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
    set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
    // The pre-activation is stored in x's dtype: said explicitly, since the
    // default ("D's type, with some exceptions") is cuBLASLt's to change.
    set_attribute(problem, raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, static_cast<int32_t>(*type));
  }

  // See NOTE [row-major GEMM in cuBLASLt].
  const Layout a_layout = make_layout(problem, *type, k, m, k);
  const Layout b_layout = make_layout(problem, *type, k, n, k);
  const Layout c_layout = make_layout(problem, *type, m, n, m);

  const uint64_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  cublasLtMatmulPreference_t raw_preference = nullptr;
  problem.check(cublasLtMatmulPreferenceCreate(&raw_preference), "matmul preference");
  const Preference preference(raw_preference);
  set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_size);
  // NOTE [cuBLASLt pointer alignment]; C and D are both out (beta = 0).
  const uint32_t out_alignment = alignment_bytes(out.const_data_ptr());
  const uint32_t a_alignment = alignment_bytes(a.const_data_ptr());
  const uint32_t b_alignment = alignment_bytes(b.const_data_ptr());
  set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_alignment);
  set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_alignment);
  set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, out_alignment);
  set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out_alignment);
  if (const auto mask = reduction_scheme_mask(dtype)) {
    set_preference(problem, raw_preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, *mask);
  }

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t heuristic_status =
      cublasLtMatmulAlgoGetHeuristic(handle, raw_desc, a_layout.get(), b_layout.get(), c_layout.get(),
                                     c_layout.get(), raw_preference, 1, &heuristic, &found);
  if (heuristic_status == CUBLAS_STATUS_NOT_SUPPORTED || (heuristic_status == CUBLAS_STATUS_SUCCESS && found == 0)) {
    return std::nullopt;
  }
  problem.check(heuristic_status, "heuristic query");

  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, raw_desc, &alpha, a.const_data_ptr(), a_layout.get(), b.const_data_ptr(),
                     b_layout.get(), &beta, out.data_ptr(), c_layout.get(), out.data_ptr(), c_layout.get(),
                     &heuristic.algo, at::cuda::getCUDABlasLtWorkspace(), workspace_size,
                     at::cuda::getCurrentCUDAStream());
  if (status != CUBLAS_STATUS_SUCCESS) {
    TORCH_WARN_ONCE(op, ": cuBLASLt matmul of x ", x2d.sizes(), " and weight ", weight.sizes(), " failed: ",
                    cublasLtGetStatusString(status), "; computing it with ATen's unfused GEMM instead");
    return std::nullopt;
  }
  return GemmResult{out, pre};
}

GemmResult linear_gemm_cuda(const char* op, const at::Tensor& x2d, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, Activation activation) {
  const c10::cuda::CUDAGuard device_guard(x2d.device());
  // See NOTE [cuBLASLt or ATen].
  if (bias || activation != Activation::None) {
    if (auto fused = gemm_cublaslt(op, x2d, weight, bias, activation)) {
      return *fused;
    }
  }
  return linear_gemm_aten(op, x2d, weight, bias, activation);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("column_parallel_linear", column_parallel_linear_kernel<linear_gemm_cuda>);
  m.impl("_column_parallel_linear_forward", column_parallel_linear_forward_kernel<linear_gemm_cuda>);
  m.impl("row_parallel_linear", row_parallel_linear_kernel<linear_gemm_cuda>);
}

} // namespace torch_tp
