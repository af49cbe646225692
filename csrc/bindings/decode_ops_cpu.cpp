// torch bindings of the rollout server's decode-step kernels (csrc/decode/), registered on
// areal_mega._ops_cpu by ops_cpu.cpp.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common.h"

namespace {

void check_f32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "_ops_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "_ops_cpu: ", name, " must be float32, got ",
              t.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_f32_cpu(x, "x");
  check_f32_cpu(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "rms_norm: x must have a last dimension");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [", H,
              "], got ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t N = xc.numel() / H;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / H), [&](int64_t b, int64_t e) {
    areal::check_status(areal_rms_norm_cpu(xp, H, wp, yp, H, H, static_cast<float>(eps), b, e),
                        "rms_norm");
  });
  return y;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& pos,
                            double scale, int64_t window) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k_new, "k_new"}, {&v_new, "v_new"},
                         {&k_cache, "k_cache"}, {&v_cache, "v_cache"}})
    check_f32_cpu(*t, name);
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3,
              "decode_attention: q, k_new and v_new must be [rows, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: the caches must be contiguous [rows, kv_heads, capacity, "
              "head_dim] of one shape");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(0) == B && k_new.size(1) == Hkv &&
                  k_new.size(2) == D && k_cache.size(3) == D && k_cache.size(0) >= B,
              "decode_attention: shapes disagree: q ", q.sizes(), ", k_new ", k_new.sizes(),
              ", v_new ", v_new.sizes(), ", cache ", k_cache.sizes());
  TORCH_CHECK(Hq % Hkv == 0, "decode_attention: ", Hq, " query heads for ", Hkv, " KV heads");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == B &&
                  pos.is_contiguous() && pos.device().is_cpu(),
              "decode_attention: pos must be a contiguous CPU int64 [", B, "]");
  const at::Tensor qc = q.contiguous(), kn = k_new.contiguous(), vn = v_new.contiguous();
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  if (B == 0) return out;
  const int64_t G = Hq / Hkv, cap = k_cache.size(2);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(pp, pp + B) + 1;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scratch(static_cast<size_t>(std::max<int64_t>(longest, 1)));
    areal::check_status(
        areal_decode_attention_cpu(qc.data_ptr<float>(), Hq * D, kn.data_ptr<float>(),
                                   vn.data_ptr<float>(), Hkv * D, k_cache.data_ptr<float>(),
                                   v_cache.data_ptr<float>(), Hkv * cap * D, cap, pp, Hkv, G,
                                   D, static_cast<float>(scale), window, out.data_ptr<float>(),
                                   Hq * D, scratch.data(), b, e),
        "decode_attention (a position outside the cache?)");
  });
  return out;
}

std::vector<at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                    const at::Tensor& uniform, const at::Tensor& greedy) {
  check_f32_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "sample_rows: logits must be [rows, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  check_f32_cpu(temperature, "temperature");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == B && temperature.is_contiguous(),
              "sample_rows: temperature must be a contiguous float32 [", B, "]");
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.dim() == 1 &&
                  uniform.size(0) == B && uniform.is_contiguous() && uniform.device().is_cpu(),
              "sample_rows: uniform must be a contiguous CPU float64 [", B, "]");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && greedy.dim() == 1 && greedy.size(0) == B &&
                  greedy.is_contiguous() && greedy.device().is_cpu(),
              "sample_rows: greedy must be a contiguous CPU bool [", B, "]");
  at::Tensor tok = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor lp = at::empty({B}, logits.options());
  at::Tensor bad = at::empty({B}, logits.options().dtype(at::kBool));
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    areal::check_status(
        areal_sample_rows_cpu(logits.data_ptr<float>(), logits.stride(0), V,
                              temperature.data_ptr<float>(), uniform.data_ptr<double>(),
                              reinterpret_cast<const uint8_t*>(greedy.data_ptr<bool>()),
                              tok.data_ptr<int64_t>(), lp.data_ptr<float>(),
                              reinterpret_cast<uint8_t*>(bad.data_ptr<bool>()), b, e),
        "sample_rows");
  });
  return {tok, lp, bad};
}

// w [N, K] as [panels, K, NR] (see areal_gemm_panels_cpu); NR: the ISA's panel width
at::Tensor pack_gemm_panels(const at::Tensor& w) {
  check_f32_cpu(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.size(0) > 0 && w.size(1) > 0, "pack_gemm_panels: w must be "
              "[N, K], got ", w.sizes());
  const int64_t NR = areal_gemm_panel_width_cpu(), N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  at::Tensor padded = at::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

at::Tensor gemm_panels(const at::Tensor& x, const at::Tensor& w_panels, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  check_f32_cpu(x, "x");
  check_f32_cpu(w_panels, "w_panels");
  const int64_t NR = areal_gemm_panel_width_cpu();
  TORCH_CHECK(w_panels.dim() == 3 && w_panels.size(2) == NR && w_panels.is_contiguous(),
              "gemm_panels: w_panels must be a contiguous [panels, K, ", NR, "] from "
              "pack_gemm_panels under the ISA in use, got ", w_panels.sizes());
  const int64_t panels = w_panels.size(0), K = w_panels.size(1);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "gemm_panels: N = ", N,
              " does not match ", panels, " panels of ", NR);
  TORCH_CHECK(x.size(-1) == K, "gemm_panels: x has ", x.size(-1), " features, w has ", K);
  at::Tensor bp;
  if (bias) {
    check_f32_cpu(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "gemm_panels: bias must be [", N, "]");
    bp = at::zeros({panels * NR}, bias->options());
    bp.narrow(0, 0, N).copy_(*bias);
  }
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, panels * NR}, x.options());
  if (M > 0) {
    const float* bptr = bias ? bp.data_ptr<float>() : nullptr;
    at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
      areal::check_status(areal_gemm_panels_cpu(xc.data_ptr<float>(), K, M, K,
                                                w_panels.data_ptr<float>(), bptr,
                                                y.data_ptr<float>(), panels * NR, b, e),
                          "gemm_panels");
    });
  }
  if (panels * NR != N) y = y.narrow(1, 0, N).contiguous();
  return y.view(out_shape);
}

}  // namespace

namespace areal {

void register_decode_ops(py::module& mod) {
  mod.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)", py::arg("x"),
          py::arg("weight"), py::arg("eps"));
  mod.def("decode_attention", &decode_attention,
          "one decode step's attention: writes the new keys / values into the caches at pos, "
          "attends each row's queries over its columns up to pos",
          py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("pos"), py::arg("scale"), py::arg("window"));
  mod.def("sample_rows", &sample_rows,
          "one token per row (inverse CDF at a uniform, or argmax), its logprob, bad rows",
          py::arg("logits"), py::arg("temperature"), py::arg("uniform"), py::arg("greedy"));
  mod.def("gemm_panel_width", &areal_gemm_panel_width_cpu,
          "output columns per packed weight panel under the ISA in use");
  mod.def("pack_gemm_panels", &pack_gemm_panels, "a [N, K] weight packed for gemm_panels",
          py::arg("w"));
  mod.def("gemm_panels", &gemm_panels, "x w^T + bias for few rows, w from pack_gemm_panels",
          py::arg("x"), py::arg("w_panels"), py::arg("n"), py::arg("bias"));
}

}  // namespace areal
