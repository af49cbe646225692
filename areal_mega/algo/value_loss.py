r"""The critic's clipped value loss and its statistics.

Per loss token t (``loss_mask`` = 1, next-token layout) with the current value V_t, the value
V_old,t that computed the advantages (``mb["values"]``) and the GAE return R_t
(``mb["returns"]``)::

    V_clip,t = V_old,t + clamp(V_t − V_old,t, −ε_v, +ε_v)
    ℓ_t      = ½ · max((V_t − R_t)², (V_clip,t − R_t)²)      (ε_v = ``value_clip``; no clip
                                                               when None: ½ (V_t − R_t)²)

The engine divides ``value_loss_coef · Σ_t ℓ_t`` by the global loss-token count (a token mean
over all micro-batches and DP ranks), as for the policy loss (PPO's clipped value objective,
as in verl's ``compute_value_loss`` with ``loss_agg_mode=token-mean``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["value_loss", "make_value_loss", "finalize_value_stats", "explained_variance"]


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *, clip: Optional[float]
) -> tuple[Tensor, dict]:
    """``(Σ_t ℓ_t over loss tokens, stats)``; see the module docstring. ``stats`` are detached
    sums over the loss tokens: ``value_token_count``, ``value_loss_sum``, ``value_clip_count``
    (tokens where the clipped term is the larger), ``value_sum``, ``return_sum``,
    ``return_sq_sum``, ``residual_sum``, ``residual_sq_sum`` (residual = R − V), for
    :func:`finalize_value_stats`."""
    mask = loss_mask.to(torch.bool)
    v, ret = values.float(), returns.float()
    err = (v - ret) ** 2
    if clip is not None:
        old = old_values.float()
        err_clipped = (old + (v - old).clamp(-clip, clip) - ret) ** 2
        per_token = torch.maximum(err, err_clipped)
        clipped = (err_clipped > err) & mask
    else:
        per_token, clipped = err, torch.zeros_like(mask)
    per_token = 0.5 * torch.where(mask, per_token, torch.zeros_like(per_token))
    total = per_token.sum()
    with torch.no_grad():
        m = mask.float()
        res = (ret - v) * m
        stats = {
            "value_token_count": m.sum(),
            "value_loss_sum": total.detach(),
            "value_clip_count": clipped.float().sum(),
            "value_sum": (v * m).sum(),
            "return_sum": (ret * m).sum(),
            "return_sq_sum": (ret * ret * m).sum(),
            "residual_sum": res.sum(),
            "residual_sq_sum": (res * res).sum(),
        }
    return total, stats


def make_value_loss(critic_cfg) -> tuple[Callable, Callable]:
    """``(loss_fn, denominator_fn)`` for :meth:`CriticEngine.train_batch`: ``loss_fn(values,
    _, mb)`` returns ``value_loss_coef · Σ ℓ_t`` and the stats of :func:`value_loss`; the
    denominator is the loss-token count. ``critic_cfg`` is the ``critic`` config section."""
    coef, clip = critic_cfg.value_loss_coef, critic_cfg.value_clip

    def loss_fn(values: Tensor, _entropy, mb) -> tuple[Tensor, dict]:
        total, stats = value_loss(values, mb["values"], mb["returns"], mb["loss_mask"], clip=clip)
        return coef * total, stats

    return loss_fn, loss_token_count


def loss_token_count(mb) -> Tensor:
    """The value loss's denominator for one micro-batch: its loss-mask token count."""
    return torch.as_tensor(mb["loss_mask"]).sum()


def explained_variance(
    n: float, ret_sum: float, ret_sq: float, res_sum: float, res_sq: float
) -> float:
    """1 − Var(R − V) / Var(R) from sums over n tokens (population variances); 0 when Var(R)
    is 0 or n < 2."""
    if n < 2:
        return 0.0
    var_ret = ret_sq / n - (ret_sum / n) ** 2
    var_res = res_sq / n - (res_sum / n) ** 2
    return 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0


def finalize_value_stats(summed: dict) -> dict:
    """Means of the sums of :func:`value_loss` (over micro-batches, DP ranks, minibatches):
    ``value_loss``, ``clip_frac``, ``value_mean``, ``return_mean``, ``explained_variance``.
    Undefined values are left out: everything over zero tokens, ``explained_variance`` over
    fewer than two tokens or constant returns."""
    n = float(summed.get("value_token_count", 0.0))
    if n <= 0:
        return {}
    out = {
        "value_loss": summed["value_loss_sum"] / n,
        "clip_frac": summed["value_clip_count"] / n,
        "value_mean": summed["value_sum"] / n,
        "return_mean": summed["return_sum"] / n,
    }
    var_ret = summed["return_sq_sum"] / n - (summed["return_sum"] / n) ** 2
    if n >= 2 and var_ret > 1e-12:
        out["explained_variance"] = explained_variance(
            n,
            summed["return_sum"],
            summed["return_sq_sum"],
            summed["residual_sum"],
            summed["residual_sq_sum"],
        )
    return out
