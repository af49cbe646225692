r"""Per-token policy objectives other than the PPO clipped surrogate (``algorithm.policy_loss``).

Both take the ratio r_t = π_θ(y_t)/π_old(y_t) of :func:`~areal_mega.algo.policy_loss.ppo_ratio`
(token level, log-ratio bounded to ±20, π_old = π_prox when ``decoupled``) and return a per-token
loss to be minimised; :func:`~areal_mega.algo.policy_loss.policy_loss` then multiplies it by the
behaviour importance weight w_t = π_prox/π_behav (decoupled PPO; verl's ``rollout_is_weights``
plays that role), adds the KL and entropy terms and aggregates with ``loss_agg``.

``cispo`` (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, and
the gradient flows only through log π_θ (REINFORCE form)::

    ℓ_t = − sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)

so ∇ℓ_t = − clip(r_t) · A_t · ∇log π_θ: unlike PPO, a clipped token still gets a gradient. The
loss *value* is that expression (verl's convention), not a surrogate of the objective.

``sapo`` (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate in place of the
hard clip, with a temperature per advantage sign::

    f_τ(r) = (4/τ) · σ(τ (r − 1)),   τ_t = τ_pos if A_t > 0 else τ_neg
    ℓ_t = − f_τ_t(r_t) · A_t

f has slope 1 at r = 1 (the PPO gradient on-policy) and its slope decays smoothly as r
leaves 1.

Deliberate differences from verl's ``compute_policy_loss_cispo`` / ``_sapo`` (otherwise equal
term for term, see tests/test_algo_objectives.py): the decoupled weight π_prox/π_behav is applied
whenever ``decoupled`` (verl: only when given ``rollout_is_weights``), and the loss is aggregated
with ``loss_agg`` for both (verl's SAPO always uses seq-mean-token-mean = our ``seq_mean``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo")


def cispo_surrogate(
    logprobs: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """CISPO per-token loss − sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ.

    ``logprobs`` are π_θ's (differentiable); ``ratio`` is only used detached. ``eps_high`` None
    means ``eps_low``. Returns ``(loss, clipped)``: the loss [T] and the bool mask of tokens
    whose weight was clipped (they still get a gradient, scaled by the clipped weight).
    """
    eps_high = eps_low if eps_high is None else eps_high
    r = ratio.detach()
    weight = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logprobs, weight != r


def sapo_gate(ratio: Tensor, tau: Tensor) -> Tensor:
    """SAPO's soft gate (4/τ)·σ(τ(r − 1)): value 2/τ and slope 1 at r = 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_surrogate(ratio: Tensor, advantages: Tensor, *, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO per-token loss − f_τ(r) · A with τ = ``tau_pos`` where A > 0, else ``tau_neg``;
    differentiable through ``ratio``."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0 (tau_pos={tau_pos}, tau_neg={tau_neg})")
    pos = torch.full_like(advantages, float(tau_pos))
    neg = torch.full_like(advantages, float(tau_neg))
    tau = torch.where(advantages > 0, pos, neg)
    return -sapo_gate(ratio, tau) * advantages
