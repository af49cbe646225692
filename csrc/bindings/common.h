// Shared tensor checks for the CPU and CUDA torch bindings.
#pragma once
#include <torch/extension.h>

#include "areal_kernels.h"

namespace areal {

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return AREAL_F32;
    case at::kDouble: return AREAL_F64;
    case at::kHalf: return AREAL_F16;
    case at::kBFloat16: return AREAL_BF16;
    default: TORCH_CHECK(false, "areal_mega.ops: unsupported logits dtype ", t,
                         " (expected float32, float64, float16 or bfloat16)");
  }
  return -1;
}

inline at::ScalarType acc_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_status(int status, const char* what) {
  TORCH_CHECK(status == AREAL_OK, "areal_mega.ops: ", what, " failed: ",
              areal_status_string(status));
}

inline void check_logits_labels(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [T, V_local], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, "logits has an empty vocabulary dimension");
  TORCH_CHECK(logits.stride(1) == 1, "logits rows must be contiguous (stride(1) == 1)");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0),
              "labels must be [T] = ", logits.size(0), ", got ", labels.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.is_contiguous(),
              "labels must be a contiguous int64 tensor");
  TORCH_CHECK(labels.device() == logits.device(), "labels and logits on different devices");
}

inline void check_vec(const at::Tensor& t, int64_t n, at::ScalarType dt, const at::Tensor& like,
                      const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must be [", n, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ",
              like.device());
}

inline void check_gae(const at::Tensor& rewards, const at::Tensor& values,
                      const at::Tensor& cu_seqlens, const c10::optional<at::Tensor>& bootstrap,
                      const c10::optional<at::Tensor>& loss_mask) {
  const int64_t T = rewards.numel();
  check_vec(rewards, T, at::kFloat, rewards, "rewards");
  check_vec(values, T, at::kFloat, rewards, "values");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, "cu_seqlens must be [B+1]");
  check_vec(cu_seqlens, cu_seqlens.numel(), at::kInt, rewards, "cu_seqlens");
  const int64_t B = cu_seqlens.numel() - 1;
  if (bootstrap) check_vec(*bootstrap, B, at::kFloat, rewards, "bootstrap_values");
  if (loss_mask) check_vec(*loss_mask, T, at::kByte, rewards, "loss_mask");
}

}  // namespace areal
