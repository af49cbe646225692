"""Per-token KL estimators between the policy and the reference model.

Tokens are sampled from (roughly) the policy π, so with the log ratio
``d_t = log π(y_t) − log π_ref(y_t)`` the usual single-sample estimators of KL(π ‖ π_ref) are
(J. Schulman, "Approximating KL divergence", 2020):

- ``k1 = d``                        unbiased, high variance, can be negative;
- ``k2 = d² / 2``                   biased, low variance, >= 0;
- ``k3 = exp(−d) − 1 + d``          unbiased, low variance, >= 0 (= (r − 1) − log r, r = π_ref/π).

All three are 0 when π = π_ref. Differentiable w.r.t. both inputs.

Clamping (``algorithm.kl_clamp``, see docs/algorithms.md): k3 grows like e^{−d} where the policy
puts far less mass on a token than the reference, so one token can dominate the loss. With
``clamp`` = c the k3 value is clamped to [−c, c] (only the upper bound can bind, k3 >= 0), and a
clamped token gets no KL gradient. k1 and k2 are never clamped. This is verl's convention
(``low_var_kl`` clamped to ±10, k1/k2 not); AReaL clamps all three estimators to ±10. In k3 the
log ratio itself is also bounded to ±``MAX_LOG_RATIO`` before ``exp`` (as verl does), so the
unclamped value stays finite.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")

#: log-ratio bound before ``exp`` in k3, so that one bad token cannot produce inf.
MAX_LOG_RATIO = 20.0

#: estimators that ``clamp`` applies to (verl's convention: k3 only)
CLAMPED_ESTIMATORS = ("k3",)


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k3",
    loss_mask: Optional[Tensor] = None,
    *,
    clamp: Optional[float] = None,
) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref); 0 where ``loss_mask`` is 0. Returns [T].

    ``logprobs`` are log π(y_t), ``ref_logprobs`` log π_ref(y_t), same shape. ``clamp`` (a
    finite positive float, or None = unclamped) bounds the k3 value to [−clamp, clamp]; it does
    not affect k1 and k2 (see the module docstring). Raises ``ValueError`` for an unknown
    estimator or a bad ``clamp``.
    """
    if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
        raise ValueError(f"kl clamp {clamp!r}: must be a finite number > 0 (None = unclamped)")
    d = logprobs - ref_logprobs
    if loss_mask is not None:
        d = torch.where(loss_mask.bool(), d, torch.zeros_like(d))
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = torch.exp(-d) - 1.0 + d
        return k3 if clamp is None else k3.clamp(-clamp, clamp)
    raise ValueError(f"kl estimator {estimator!r}: must be one of {KL_ESTIMATORS}")
