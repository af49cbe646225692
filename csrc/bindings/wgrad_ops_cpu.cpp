// torch binding of the bf16 weight gradient accumulated in fp32 (the CPU counterpart of
// megatron-core's gradient_accumulation_fusion), registered on areal_mega._ops_cpu by
// ops_cpu.cpp. It is a call into torch's own GEMM, not a kernel of ours: ATen's
// cpublas::brgemm with a row-major B (is_vnni = false) is a full bf16 x bf16 -> fp32 GEMM
// with C += A.B, which oneDNN runs on AMX or AVX-512 BF16 where the CPU has them. Hence no C
// ABI entry in areal_kernels.h and no CUDA twin (on a GPU megatron fuses this itself).
#include <ATen/native/CPUBlas.h>

#include "common.h"

namespace {

// main_grad[N, K] += grad_output[T, N]^T @ total_input[T, K], in fp32, without a bf16 product.
void accumulate_weight_grad_bf16(at::Tensor& main_grad, const at::Tensor& grad_output,
                                 const at::Tensor& total_input) {
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
          "accumulated in fp32",
          py::arg("main_grad"), py::arg("grad_output"), py::arg("total_input"));
}

}  // namespace areal
