"""Per-token KL estimators between the policy and the reference model.

Tokens are sampled from (roughly) the policy π, so with the log ratio
``d_t = log π(y_t) − log π_ref(y_t)`` the usual single-sample estimators of KL(π ‖ π_ref) are
(J. Schulman, "Approximating KL divergence", 2020):

- ``k1 = d``                        unbiased, high variance, can be negative;
- ``k2 = d² / 2``                   biased, low variance, >= 0;
- ``k3 = exp(−d) − 1 + d``          unbiased, low variance, >= 0 (= (r − 1) − log r, r = π_ref/π).

All three are 0 when π = π_ref. Differentiable w.r.t. both inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")

#: log-ratio bound before ``exp`` in k3, so that one bad token cannot produce inf.
MAX_LOG_RATIO = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
                loss_mask: Optional[Tensor] = None) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref); 0 where ``loss_mask`` is 0. Returns [T]."""
    d = logprobs - ref_logprobs
    if loss_mask is not None:
        d = torch.where(loss_mask.bool(), d, torch.zeros_like(d))
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"kl estimator {estimator!r}: must be one of {KL_ESTIMATORS}")
