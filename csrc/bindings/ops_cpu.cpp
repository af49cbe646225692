// torch binding of the C++ CPU kernels: module areal_mega._ops_cpu.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common.h"

namespace areal {
void register_decode_ops(py::module& mod);  // decode_ops_cpu.cpp
void register_wgrad_ops(py::module& mod);   // wgrad_ops_cpu.cpp
}

namespace {

std::vector<at::Tensor> logprob_stats(const at::Tensor& logits, const at::Tensor& labels,
                                      int64_t vocab_start, double inv_temp, bool with_entropy) {
  areal::check_logits_labels(logits, labels);
  TORCH_CHECK(logits.device().is_cpu(), "_ops_cpu.logprob_stats needs CPU tensors");
  const int64_t T = logits.size(0), V = logits.size(1);
  const int code = areal::dtype_code(logits.scalar_type());
  auto opts = logits.options().dtype(areal::acc_type(logits));
  at::Tensor m = at::empty({T}, opts), s = at::empty({T}, opts), xl = at::empty({T}, opts);
  at::Tensor u = at::empty({with_entropy ? T : 0}, opts);
  const void* src = logits.data_ptr();
  const int64_t* lab = labels.data_ptr<int64_t>();
  void* up = with_entropy ? u.data_ptr() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 65536 / V);
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) {
    areal::check_status(areal_logprob_stats_cpu(src, code, b, e, V, logits.stride(0), lab,
                                                vocab_start, inv_temp, m.data_ptr(),
                                                s.data_ptr(), xl.data_ptr(), up),
                        "logprob_stats");
  });
  return {m, s, xl, u};
}

at::Tensor logprob_backward(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t vocab_start, double inv_temp, const at::Tensor& lse,
                            const at::Tensor& grad_lp, const c10::optional<at::Tensor>& ex,
                            const c10::optional<at::Tensor>& grad_ent, bool in_place) {
  areal::check_logits_labels(logits, labels);
  TORCH_CHECK(logits.device().is_cpu(), "_ops_cpu.logprob_backward needs CPU tensors");
  const int64_t T = logits.size(0), V = logits.size(1);
  const int code = areal::dtype_code(logits.scalar_type());
  const auto acc = areal::acc_type(logits);
  areal::check_vec(lse, T, acc, logits, "lse");
  areal::check_vec(grad_lp, T, acc, logits, "grad_logprob");
  const bool ent = ex.has_value() && grad_ent.has_value();
  if (ent) {
    areal::check_vec(*ex, T, acc, logits, "ex");
    areal::check_vec(*grad_ent, T, acc, logits, "grad_entropy");
  }
  // in place: each row's gradient over its logits (a block is read before it is written)
  at::Tensor grad = in_place ? logits : at::empty({T, V}, logits.options());
  const int64_t gstride = in_place ? logits.stride(0) : V;
  const void* src = logits.data_ptr();
  const int64_t* lab = labels.data_ptr<int64_t>();
  const void* exp_ = ent ? ex->data_ptr() : nullptr;
  const void* gep = ent ? grad_ent->data_ptr() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 65536 / V);
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) {
    areal::check_status(areal_logprob_backward_cpu(src, code, b, e, V, logits.stride(0), lab,
                                                   vocab_start, inv_temp, lse.data_ptr(),
                                                   grad_lp.data_ptr(), exp_, gep,
                                                   grad.data_ptr(), gstride),
                        "logprob_backward");
  });
  return grad;
}

std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                            const at::Tensor& cu_seqlens, const c10::optional<at::Tensor>& bootstrap,
                            const c10::optional<at::Tensor>& loss_mask, double gamma, double lam) {
  areal::check_gae(rewards, values, cu_seqlens, bootstrap, loss_mask);
  TORCH_CHECK(rewards.device().is_cpu(), "_ops_cpu.gae needs CPU tensors");
  const int64_t T = rewards.numel(), B = cu_seqlens.numel() - 1;
  at::Tensor adv = at::zeros({T}, rewards.options()), ret = at::zeros({T}, rewards.options());
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  TORCH_CHECK(B == 0 || (cu[0] == 0 && cu[B] <= T), "cu_seqlens must start at 0 and end <= T");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(cu[b + 1] >= cu[b], "cu_seqlens must be non-decreasing (at index ", b + 1, ")");
  const float* bp = bootstrap ? bootstrap->data_ptr<float>() : nullptr;
  const uint8_t* mp = loss_mask ? loss_mask->data_ptr<uint8_t>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, B * 16384 / std::max<int64_t>(T, 1));
  at::parallel_for(0, B, grain, [&](int64_t b, int64_t e) {
    areal::check_status(areal_gae_cpu(rewards.data_ptr<float>(), values.data_ptr<float>(), cu,
                                      b, e, bp, mp, gamma, lam, adv.data_ptr<float>(),
                                      ret.data_ptr<float>()),
                        "gae");
  });
  return {adv, ret};
}

// by areal_cpu_isa() code (0 generic / SSE2, 1 AVX2, 2 AVX-512)
const char* const kIsaNames[] = {"generic", "avx2", "avx512"};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "areal-mega C++ CPU kernels (packed logprobs, GAE, the rollout decode step, the bf16 weight gradient accumulated in fp32)";
  mod.def("logprob_stats", &logprob_stats, "per-token (m, s, xlab, u) of a vocabulary shard",
          py::arg("logits"), py::arg("labels"), py::arg("vocab_start"), py::arg("inv_temp"),
          py::arg("with_entropy"));
  mod.def("logprob_backward", &logprob_backward, "gradient w.r.t. the logits shard",
          py::arg("logits"), py::arg("labels"), py::arg("vocab_start"), py::arg("inv_temp"),
          py::arg("lse"), py::arg("grad_lp"), py::arg("ex"), py::arg("grad_ent"),
          py::arg("in_place") = false);
  mod.def("cpu_isa", [] { return std::string(kIsaNames[areal_cpu_isa()]); },
          "the vector ISA the logprob kernels run: generic (SSE2), avx2 or avx512");
  mod.def("set_cpu_isa", [](const std::string& name) {
    int code = name == "default" ? -1 : -2;
    for (int i = 0; i < 3; ++i)
      if (name == kIsaNames[i]) code = i;
    TORCH_CHECK(code != -2, "set_cpu_isa(", name, "): expected generic, avx2, avx512 or default");
    return std::string(kIsaNames[areal_cpu_set_isa(code)]);
  }, "use the kernels of this ISA (capped at what the CPU supports); returns the one in use",
          py::arg("name"));
  mod.def("gae", &gae, "GAE over packed sequences", py::arg("rewards"), py::arg("values"),
          py::arg("cu_seqlens"), py::arg("bootstrap"), py::arg("loss_mask"), py::arg("gamma"),
          py::arg("lam"));
  areal::register_decode_ops(mod);
  areal::register_wgrad_ops(mod);
}
