// torch binding of the CUDA kernels: module areal_mega._ops_cuda (built only with CUDA torch).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common.h"

namespace {

void* current_stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }

std::vector<at::Tensor> logprob_stats(const at::Tensor& logits, const at::Tensor& labels,
                                      int64_t vocab_start, double inv_temp, bool with_entropy) {
  areal::check_logits_labels(logits, labels);
  TORCH_CHECK(logits.is_cuda(), "_ops_cuda.logprob_stats needs CUDA tensors");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), V = logits.size(1);
  auto opts = logits.options().dtype(areal::acc_type(logits));
  at::Tensor m = at::empty({T}, opts), s = at::empty({T}, opts), xl = at::empty({T}, opts);
  at::Tensor u = at::empty({with_entropy ? T : 0}, opts);
  areal::check_status(
      areal_logprob_stats_cuda(logits.data_ptr(), areal::dtype_code(logits.scalar_type()), T, V,
                               logits.stride(0), labels.data_ptr<int64_t>(), vocab_start,
                               inv_temp, m.data_ptr(), s.data_ptr(), xl.data_ptr(),
                               with_entropy ? u.data_ptr() : nullptr, current_stream()),
      "logprob_stats (CUDA)");
  return {m, s, xl, u};
}

at::Tensor logprob_backward(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t vocab_start, double inv_temp, const at::Tensor& lse,
                            const at::Tensor& grad_lp, const c10::optional<at::Tensor>& ex,
                            const c10::optional<at::Tensor>& grad_ent) {
  areal::check_logits_labels(logits, labels);
  TORCH_CHECK(logits.is_cuda(), "_ops_cuda.logprob_backward needs CUDA tensors");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), V = logits.size(1);
  const auto acc = areal::acc_type(logits);
  areal::check_vec(lse, T, acc, logits, "lse");
  areal::check_vec(grad_lp, T, acc, logits, "grad_logprob");
  const bool ent = ex.has_value() && grad_ent.has_value();
  if (ent) {
    areal::check_vec(*ex, T, acc, logits, "ex");
    areal::check_vec(*grad_ent, T, acc, logits, "grad_entropy");
  }
  at::Tensor grad = at::empty({T, V}, logits.options());
  areal::check_status(
      areal_logprob_backward_cuda(logits.data_ptr(), areal::dtype_code(logits.scalar_type()), T,
                                  V, logits.stride(0), labels.data_ptr<int64_t>(), vocab_start,
                                  inv_temp, lse.data_ptr(), grad_lp.data_ptr(),
                                  ent ? ex->data_ptr() : nullptr,
                                  ent ? grad_ent->data_ptr() : nullptr, grad.data_ptr(), V,
                                  current_stream()),
      "logprob_backward (CUDA)");
  return grad;
}

std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                            const at::Tensor& cu_seqlens, const c10::optional<at::Tensor>& bootstrap,
                            const c10::optional<at::Tensor>& loss_mask, double gamma, double lam) {
  areal::check_gae(rewards, values, cu_seqlens, bootstrap, loss_mask);
  TORCH_CHECK(rewards.is_cuda(), "_ops_cuda.gae needs CUDA tensors");
  const c10::cuda::CUDAGuard guard(rewards.device());
  const int64_t T = rewards.numel(), B = cu_seqlens.numel() - 1;
  at::Tensor adv = at::zeros({T}, rewards.options()), ret = at::zeros({T}, rewards.options());
  areal::check_status(
      areal_gae_cuda(rewards.data_ptr<float>(), values.data_ptr<float>(),
                     cu_seqlens.data_ptr<int32_t>(), B, T,
                     bootstrap ? bootstrap->data_ptr<float>() : nullptr,
                     loss_mask ? loss_mask->data_ptr<uint8_t>() : nullptr, gamma, lam,
                     adv.data_ptr<float>(), ret.data_ptr<float>(), current_stream()),
      "gae (CUDA)");
  return {adv, ret};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "areal-mega CUDA kernels (packed logprobs, GAE)";
  mod.def("logprob_stats", &logprob_stats, "per-token (m, s, xlab, u) of a vocabulary shard",
          py::arg("logits"), py::arg("labels"), py::arg("vocab_start"), py::arg("inv_temp"),
          py::arg("with_entropy"));
  mod.def("logprob_backward", &logprob_backward, "gradient w.r.t. the logits shard",
          py::arg("logits"), py::arg("labels"), py::arg("vocab_start"), py::arg("inv_temp"),
          py::arg("lse"), py::arg("grad_lp"), py::arg("ex"), py::arg("grad_ent"));
  mod.def("gae", &gae, "GAE over packed sequences", py::arg("rewards"), py::arg("values"),
          py::arg("cu_seqlens"), py::arg("bootstrap"), py::arg("loss_mask"), py::arg("gamma"),
          py::arg("lam"));
}
