// CUDA forward kernels of the linear ops: the GEMM through cuBLASLt with the
// bias, and optionally GELU (tanh), fused into its epilogue, on the current
// stream under a device guard. Compiled only in CUDA builds.
//
// NOTE [row-major GEMM in cuBLASLt]
// cuBLASLt is column-major. A row-major [r, c] buffer is the column-major
// [c, r] matrix, so out [M, N] = x [M, K] @ W [N, K]^T is computed as its
// column-major twin out^T [N, M] = W^T(as stored: [K, N], op T -> [N, K]) @ x(as stored: [K, M]).
// Hence m = N, n = M, k = K, transa = T, transb = N, lda = ldb = K, ldc = N.
// The epilogue's bias has m = N entries, one per output feature, and the
// GELU auxiliary output (the pre-activation, kept for backward) has out's layout.
//
// Shapes or dtypes cuBLASLt does not take here (float64, empty matrices, an
// auxiliary leading dim not divisible by 8, no algorithm found) fall back to
// ATen's GEMMs, which compute the same function.

#include "ops/linear.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cublasLt.h>

#include <memory>
#include <type_traits>

namespace torch_tp {
namespace {

#define TORCH_TP_CUBLAS_CHECK(expr)                                                                        \
  do {                                                                                                     \
    const cublasStatus_t status_ = (expr);                                                                 \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "torch_tp: ", #expr, " failed: ", cublasGetStatusString(status_)); \
  } while (0)

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

Layout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  TORCH_TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  return Layout(layout);
}

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

std::optional<cudaDataType_t> cuda_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: return std::nullopt;
  }
}

// The fused GEMM, or nullopt where cuBLASLt does not take the problem.
std::optional<GemmResult> gemm_cublaslt(const at::Tensor& x2d, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, Activation activation) {
  const auto type = cuda_type(x2d.scalar_type());
  const int64_t m = weight.size(0);  // N
  const int64_t n = x2d.size(0);     // M
  const int64_t k = x2d.size(1);     // K
  const bool gelu = activation == Activation::GeluTanh;
  if (!type || m == 0 || n == 0 || k == 0 || (gelu && m % 8 != 0)) {
    return std::nullopt;
  }
  const at::Tensor a = weight.contiguous();
  const at::Tensor b = x2d.contiguous();
  const at::Tensor bias_vector = bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({n, m}, x2d.options());
  at::Tensor pre = gelu ? at::empty({n, m}, x2d.options()) : at::Tensor();

  // float32 follows torch.backends.cuda.matmul.allow_tf32, as torch's own GEMMs do.
  const cublasComputeType_t compute = x2d.scalar_type() == at::kFloat && at::globalContext().allowTF32CuBLAS()
      ? CUBLAS_COMPUTE_32F_FAST_TF32
      : CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t raw_desc = nullptr;
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F));
  const MatmulDesc desc(raw_desc);
  set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (bias) {
    epilogue = gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
    set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_vector.const_data_ptr());
  } else if (gelu) {
    epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
  }
  set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (gelu) {
    set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
    set_attribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
  }

  // See NOTE [row-major GEMM in cuBLASLt].
  const Layout a_layout = make_layout(*type, k, m, k);
  const Layout b_layout = make_layout(*type, k, n, k);
  const Layout c_layout = make_layout(*type, m, n, m);

  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  cublasLtMatmulPreference_t raw_preference = nullptr;
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_preference));
  const Preference preference(raw_preference);
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size, sizeof(workspace_size)));

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, raw_desc, a_layout.get(), b_layout.get(),
                                                       c_layout.get(), c_layout.get(), raw_preference, 1,
                                                       &heuristic, &found));
  if (found == 0) {
    return std::nullopt;
  }
  const float alpha = 1.0f;
  const float beta = 0.0f;
  TORCH_TP_CUBLAS_CHECK(cublasLtMatmul(handle, raw_desc, &alpha, a.const_data_ptr(), a_layout.get(),
                                       b.const_data_ptr(), b_layout.get(), &beta, out.data_ptr(), c_layout.get(),
                                       out.data_ptr(), c_layout.get(), &heuristic.algo,
                                       at::cuda::getCUDABlasLtWorkspace(), workspace_size,
                                       at::cuda::getCurrentCUDAStream()));
  return GemmResult{out, pre};
}

GemmResult linear_gemm_cuda(const at::Tensor& x2d, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            Activation activation) {
  const c10::cuda::CUDAGuard device_guard(x2d.device());
  if (auto fused = gemm_cublaslt(x2d, weight, bias, activation)) {
    return *fused;
  }
  return linear_gemm_aten(x2d, weight, bias, activation);
}

} // namespace

TORCH_LIBRARY_IMPL(torch_tp, CUDA, m) {
  m.impl("column_parallel_linear", column_parallel_linear_kernel<linear_gemm_cuda>);
  m.impl("_column_parallel_linear_forward", column_parallel_linear_forward_kernel<linear_gemm_cuda>);
  m.impl("row_parallel_linear", row_parallel_linear_kernel<linear_gemm_cuda>);
}

} // namespace torch_tp
