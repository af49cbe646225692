// torch binding of the bf16 weight gradient accumulated in fp32 (the CPU counterpart of
// megatron-core's gradient_accumulation_fusion), registered on areal_mega._ops_cpu by
// ops_cpu.cpp. It is a call into a GEMM torch ships, not a kernel of ours, hence no C ABI
// entry in areal_kernels.h and no CUDA twin (on a GPU megatron fuses this itself):
// - "mkl": MKL's cblas_gemm_bf16bf16f32 (bf16 x bf16 -> fp32, C += op(A).B), which torch's
//   x86 builds link into libtorch_cpu; it reads the output gradient transposed in place and
//   runs on AMX. Looked up at run time: a torch without it still loads this module.
// - "onednn": ATen's cpublas::brgemm with a row-major B (is_vnni = false), a full bf16 x bf16
//   -> fp32 GEMM with C += A.B that oneDNN runs on AVX-512 BF16 or AMX; it takes no
//   transposed operand, so the output gradient is copied transposed first.
#include <ATen/native/CPUBlas.h>
#include <dlfcn.h>

#include <limits>
#include <string>

#include "common.h"

namespace {

// cblas_gemm_bf16bf16f32(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
// with MKL's LP64 integers and its CBLAS enum values
using MklGemmBf16 = void (*)(int, int, int, int, int, int, float, const uint16_t*, int,
                             const uint16_t*, int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

MklGemmBf16 mkl_gemm_bf16() {
  static const MklGemmBf16 fn = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    return reinterpret_cast<MklGemmBf16>(lib ? dlsym(lib, "cblas_gemm_bf16bf16f32") : nullptr);
  }();
  return fn;
}

// main_grad[N, K] += grad_output[T, N]^T @ total_input[T, K], in fp32, without a bf16 product.
void accumulate_weight_grad_bf16(at::Tensor& main_grad, const at::Tensor& grad_output,
                                 const at::Tensor& total_input, const std::string& gemm) {
  TORCH_CHECK(gemm == "mkl" || gemm == "onednn",
              "accumulate_weight_grad_bf16: gemm must be mkl or onednn, got ", gemm);
  TORCH_CHECK(main_grad.device().is_cpu() && grad_output.device().is_cpu() &&
                  total_input.device().is_cpu(),
              "accumulate_weight_grad_bf16 needs CPU tensors");
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat && main_grad.dim() == 2 &&
                  main_grad.is_contiguous(),
              "accumulate_weight_grad_bf16: main_grad must be a contiguous 2-D float32 tensor, "
              "got ", main_grad.scalar_type(), " ", main_grad.sizes());
  TORCH_CHECK(grad_output.scalar_type() == at::kBFloat16 &&
                  total_input.scalar_type() == at::kBFloat16,
              "accumulate_weight_grad_bf16: grad_output and total_input must be bfloat16, got ",
              grad_output.scalar_type(), " and ", total_input.scalar_type());
  TORCH_CHECK(grad_output.dim() == 2 && total_input.dim() == 2 &&
                  grad_output.size(0) == total_input.size(0) &&
                  grad_output.size(1) == main_grad.size(0) &&
                  total_input.size(1) == main_grad.size(1),
              "accumulate_weight_grad_bf16: expected grad_output [T, N], total_input [T, K] and "
              "main_grad [N, K], got ", grad_output.sizes(), ", ", total_input.sizes(), " and ",
              main_grad.sizes());
  const int64_t N = main_grad.size(0), K = main_grad.size(1), T = total_input.size(0);
  if (T == 0 || N == 0 || K == 0) return;
  if (gemm == "mkl") {
    const MklGemmBf16 fn = mkl_gemm_bf16();
    TORCH_CHECK(fn, "accumulate_weight_grad_bf16: this torch has no MKL cblas_gemm_bf16bf16f32");
    const at::Tensor a = grad_output.stride(1) == 1 ? grad_output : grad_output.contiguous();
    const at::Tensor b = total_input.stride(1) == 1 ? total_input : total_input.contiguous();
    constexpr int64_t kMax = std::numeric_limits<int>::max();
    TORCH_CHECK(N <= kMax && K <= kMax && T <= kMax && a.stride(0) <= kMax &&
                    b.stride(0) <= kMax,
                "accumulate_weight_grad_bf16: a dimension over MKL's 32-bit integers");
    fn(kRowMajor, kTrans, kNoTrans, static_cast<int>(N), static_cast<int>(K),
       static_cast<int>(T), 1.0f, reinterpret_cast<const uint16_t*>(a.data_ptr()),
       static_cast<int>(a.stride(0)), reinterpret_cast<const uint16_t*>(b.data_ptr()),
       static_cast<int>(b.stride(0)), 1.0f, main_grad.data_ptr<float>(), static_cast<int>(K));
    return;
  }
  // A = grad_output^T must be row-major [N, T]: one transposed copy of the bf16 gradient
  // (T x N x 2 bytes) instead of an [N, K] product, its fp32 cast and the add
  const at::Tensor a = grad_output.t().contiguous();
  const at::Tensor b = total_input.stride(1) == 1 ? total_input : total_input.contiguous();
  at::native::cpublas::brgemm(N, K, T, /*ld_a=*/T, /*ld_b=*/b.stride(0), /*ld_c=*/K,
                              /*add_C=*/true, a.data_ptr<at::BFloat16>(),
                              b.data_ptr<at::BFloat16>(), main_grad.data_ptr<float>(),
                              /*is_vnni=*/false);
}

}  // namespace

namespace areal {

void register_wgrad_ops(py::module& mod) {
  mod.def("accumulate_weight_grad_bf16", &accumulate_weight_grad_bf16,
          "main_grad (fp32 [N, K]) += grad_output (bf16 [T, N])^T @ total_input (bf16 [T, K]), "
          "accumulated in fp32 by gemm (mkl or onednn)",
          py::arg("main_grad"), py::arg("grad_output"), py::arg("total_input"),
          py::arg("gemm") = "onednn");
  mod.def("has_mkl_gemm_bf16", [] { return mkl_gemm_bf16() != nullptr; },
          "whether torch's libtorch_cpu carries MKL's cblas_gemm_bf16bf16f32");
}

}  // namespace areal
