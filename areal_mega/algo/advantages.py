r"""Reward shaping and advantage estimation over a packed batch.

Pipeline (:func:`compute_advantages`), per sequence i with reward R_i:

1. :func:`shape_rewards` — zero R_i if the sequence ended without EOS (optional), add the DAPO
   overlong penalty, then scale, bias and clip.
2. KL in the reward (``kl_in_reward``, β = ``kl_coef``): per-token penalty −β·KL_t(π ‖ π_ref)
   with π = π_prox when present, else π_behav (no gradient: it is part of the reward); k3 is
   clamped to ±``kl_clamp`` as in the loss term (:mod:`~areal_mega.algo.kl`).
3. The estimator (``adv_estimator``):

   - ``grpo``: sequence reward R_i − β Σ_t KL_t, normalised within its prompt group
     (:func:`group_normalize`; or raw when ``group_norm`` is off), broadcast to its tokens.
   - ``reinforce``: outcome reward (group-normalised when ``group_norm``; verl's
     REINFORCE++-baseline is ``reinforce_plus_plus_baseline``) at the last loss token, plus
     the per-token KL penalty, turned into discounted returns-to-go
     G_t = Σ_{u≥t} γ^{u−t} r_u by ``packed_gae`` with V = 0, λ = 1.
   - ``gae``: the same token rewards with the critic's ``values`` through
     ``areal_mega.ops.packed_gae`` (γ, λ, ``bootstrap_values`` for truncated sequences).
   - ``rloo``, ``opo``, ``grpo_passk``, ``reinforce_plus_plus``,
     ``reinforce_plus_plus_baseline``: verl's estimators of those names
     (:mod:`~areal_mega.algo.estimators`), on R_i − β Σ_t KL_t (per token for REINFORCE++);
     ``group_norm`` / ``leave_one_out`` do not apply, ``group_std`` is pass@k's std division.
4. Optional batch normalisation of the per-token advantages (:func:`masked_whiten`).

Where these conventions differ from verl and AReaL on purpose (singleton groups, reward
``scale·R + bias``, the capped overlong penalty) is stated at each function and, with the
formulas and config keys, in docs/algorithms.md.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from areal_mega.algo.estimators import ESTIMATORS, estimator_advantages
from areal_mega.algo.kl import kl_estimate
from areal_mega.algo.packing import broadcast_to_tokens, last_token_index, segment_sum

EPS = 1e-6


# ----------------------------------------------------------------------------- reward shaping


def overlong_penalty(
    response_lens: Tensor, *, max_len: int, buffer: int, penalty: float = 1.0
) -> Tensor:
    r"""DAPO soft overlong punishment, ≤ 0, per sequence [B].

    With L_exp = max_len − buffer:  0 for |y| ≤ L_exp;  −penalty·(|y| − L_exp)/buffer for
    L_exp < |y| ≤ max_len;  −penalty beyond.  ``buffer == 0`` disables it (all zeros).

    Convention: the penalty is capped at −penalty. verl's DAPO reward manager and AReaL compute
    min(−(|y| − L_exp)/buffer·penalty, 0) with no lower bound; the two agree whenever
    |y| ≤ max_len, which generation with ``max_new_tokens = max_len`` guarantees.
    """
    lens = response_lens.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lens)
    if buffer > max_len:
        raise ValueError(f"overlong_buffer={buffer} exceeds the max response length {max_len}")
    return -penalty * ((lens - (max_len - buffer)) / buffer).clamp(0.0, 1.0)


def shape_rewards(
    rewards: Tensor,
    cfg,
    *,
    response_lens: Optional[Tensor] = None,
    seq_no_eos: Optional[Tensor] = None,
    max_response_len: Optional[int] = None,
) -> Tensor:
    r"""Shaped sequence rewards [B], in this order:

    R ← 0 where ``seq_no_eos`` (if ``zero_reward_without_eos``);
    R ← R + overlong_penalty(|y|) (if ``overlong_buffer`` > 0);
    R ← ``reward_scale``·R + ``reward_bias``;
    R ← clip(R, −``reward_clip``, ``reward_clip``) (if set).

    ``rewards`` [B] are the raw sequence rewards; ``cfg`` is an ``AlgorithmConfig``. Convention:
    the bias is added after scaling (``scale·R + bias``); AReaL computes ``(R + bias)·scale``
    (its ``reward_bias`` / ``reward_scaling``), verl has no such option. With bias b and scale s,
    AReaL's (s, b) equals our (s, s·b).
    """
    r = rewards.to(torch.float32)
    if cfg.zero_reward_without_eos:
        if seq_no_eos is None:
            raise KeyError("zero_reward_without_eos needs 'seq_no_eos'")
        r = torch.where(seq_no_eos.bool(), torch.zeros_like(r), r)
    if cfg.overlong_buffer > 0:
        if response_lens is None or max_response_len is None:
            raise KeyError("the overlong penalty needs 'response_lens' and max_response_len")
        r = r + overlong_penalty(
            response_lens,
            max_len=max_response_len,
            buffer=cfg.overlong_buffer,
            penalty=cfg.overlong_penalty,
        )
    r = cfg.reward_scale * r + cfg.reward_bias
    if cfg.reward_clip is not None:
        r = r.clamp(-cfg.reward_clip, cfg.reward_clip)
    return r


# ----------------------------------------------------------------------------- normalisation


def group_normalize(
    rewards: Tensor,
    group_index: Tensor,
    *,
    use_std: bool = True,
    leave_one_out: bool = False,
    eps: float = EPS,
) -> Tensor:
    r"""GRPO advantages per sequence [B], within each prompt group g of size n:

    baseline b_i = mean_g(R)   or, with ``leave_one_out`` (RLOO), mean of the *other* n−1
    rewards, so R_i − b_i = n/(n−1)·(R_i − mean_g(R));
    A_i = (R_i − b_i) / (std_g(R) + eps) with the unbiased (n−1) group std, or
    A_i = R_i − b_i when ``use_std`` is off (Dr.GRPO). Returns [B].

    Convention: a singleton group (n = 1) gets A = 0 under every option, so it contributes no
    policy gradient (and :func:`~areal_mega.algo.filters.dynamic_filter` drops it). verl's GRPO
    uses mean 0 and std 1 for a singleton, i.e. A = R/(1 + eps), and its RLOO leaves R as is;
    AReaL's group normalisation gives 0 by plain mean but R with leave-one-out.
    """
    r = rewards.to(torch.float32)
    _, gid = torch.unique(group_index, return_inverse=True)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add(
        0, gid, torch.ones_like(r)
    )
    mean = torch.zeros_like(count).index_add(0, gid, r) / count
    centred = r - mean[gid]
    n = count[gid]
    if leave_one_out:
        centred = centred * n / (n - 1).clamp_min(1.0)
    if use_std:
        sq = torch.zeros_like(count).index_add(0, gid, (r - mean[gid]) ** 2)
        std = (sq / (count - 1).clamp_min(1.0)).sqrt()
        centred = centred / (std[gid] + eps)
    return torch.where(n > 1, centred, torch.zeros_like(centred))


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = EPS) -> Tensor:
    r"""Batch normalisation over the masked entries: (x − mean) / (std + eps) with the unbiased
    std of the entries where ``mask`` is 1; 0 elsewhere. ``shift_mean=False`` only rescales."""
    m = mask.bool()
    vals = x[m]
    if vals.numel() < 2:
        return torch.where(
            m, x - vals.mean() if shift_mean and vals.numel() else x, torch.zeros_like(x)
        )
    mean, std = vals.mean(), vals.std(unbiased=True)
    y = (x - mean if shift_mean else x) / (std + eps)
    return torch.where(m, y, torch.zeros_like(y))


def outcome_token_rewards(seq_rewards: Tensor, loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-token rewards [T]: ``seq_rewards[b]`` on the last loss token of sequence b, 0 on
    every other token (sequences without loss tokens get nothing)."""
    out = torch.zeros(loss_mask.shape[0], dtype=seq_rewards.dtype, device=seq_rewards.device)
    last = last_token_index(loss_mask, cu_seqlens)
    has = last >= 0
    out[last[has]] = seq_rewards[has]
    return out


# ----------------------------------------------------------------------------- top level


def _packed_gae():
    try:
        from areal_mega.ops import packed_gae
    except ImportError as e:  # the kernels land in areal_mega.ops
        raise NotImplementedError(
            "adv_estimator gae/reinforce needs areal_mega.ops.packed_gae "
            "(not available in this build)"
        ) from e
    return packed_gae


@torch.no_grad()
def compute_advantages(
    batch: dict, cfg, *, max_response_len: Optional[int] = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Advantages (and returns, for GAE) of a whole packed batch; see the module docstring.

    ``batch`` needs ``loss_mask``, ``cu_seqlens``, ``rewards``; ``group_index`` for group
    normalisation; ``seq_no_eos``, ``response_lens`` for those shaping options; ``ref_logprobs``
    (+ ``prox_logprobs`` or the behaviour ``logprobs``) for ``kl_in_reward``; ``values`` (per token,
    + optional per-sequence ``bootstrap_values``) for GAE. ``cfg`` is an ``AlgorithmConfig``;
    ``max_response_len`` is ``rollout.max_new_tokens`` (for the overlong penalty).

    Returns ``({"advantages": [T], "returns": [T] (gae only), "shaped_rewards": [B]}, stats)``
    with float stats ``reward_mean``, ``shaped_reward_mean``, ``advantage_mean``,
    ``advantage_std``, ``kl_reward_mean`` (when used), ``no_eos_frac``, ``overlong_frac``.
    """
    mask = batch["loss_mask"].bool()
    cu = batch["cu_seqlens"]
    n_tokens = mask.shape[0]
    raw = batch["rewards"].to(torch.float32)
    rewards = shape_rewards(
        raw,
        cfg,
        response_lens=batch.get("response_lens"),
        seq_no_eos=batch.get("seq_no_eos"),
        max_response_len=max_response_len,
    )
    stats: dict[str, float] = {
        "reward_mean": float(raw.mean()),
        "shaped_reward_mean": float(rewards.mean()),
    }
    if batch.get("seq_no_eos") is not None:
        stats["no_eos_frac"] = float(batch["seq_no_eos"].float().mean())
    if cfg.overlong_buffer > 0 and max_response_len is not None:
        over = batch["response_lens"] > max_response_len - cfg.overlong_buffer
        stats["overlong_frac"] = float(over.float().mean())

    kl_pen = torch.zeros(n_tokens, dtype=torch.float32, device=mask.device)
    if cfg.kl_in_reward and cfg.kl_coef > 0:
        if batch.get("ref_logprobs") is None:
            raise KeyError("kl_in_reward needs 'ref_logprobs'")
        pol = batch.get("prox_logprobs")
        pol = batch["logprobs"] if pol is None else pol
        kl = kl_estimate(
            pol.float(), batch["ref_logprobs"].float(), cfg.kl_estimator, mask, clamp=cfg.kl_clamp
        )
        kl_pen = -cfg.kl_coef * kl
        if mask.any():  # a mean over no token is left out
            stats["kl_reward_mean"] = float(kl[mask].mean())

    def group_adv(r: Tensor) -> Tensor:
        if not cfg.group_norm:
            return r
        return group_normalize(
            r, batch["group_index"], use_std=cfg.group_std, leave_one_out=cfg.leave_one_out
        )

    out: dict[str, Tensor] = {"shaped_rewards": rewards}
    if cfg.adv_estimator == "grpo":
        seq_r = rewards + segment_sum(kl_pen, cu)
        adv = broadcast_to_tokens(group_adv(seq_r), cu, n_tokens)
    elif cfg.adv_estimator == "reinforce":
        tok_r = outcome_token_rewards(group_adv(rewards), mask, cu) + kl_pen
        adv, _ = _packed_gae()(
            tok_r, torch.zeros_like(tok_r), cu, gamma=cfg.gamma, lam=1.0, loss_mask=mask
        )
    elif cfg.adv_estimator == "gae":
        if batch.get("values") is None:
            raise KeyError("adv_estimator='gae' needs the critic's per-token 'values'")
        tok_r = outcome_token_rewards(rewards, mask, cu) + kl_pen
        adv, returns = _packed_gae()(
            tok_r,
            batch["values"].float(),
            cu,
            gamma=cfg.gamma,
            lam=cfg.lam,
            bootstrap_values=batch.get("bootstrap_values"),
            loss_mask=mask,
        )
        out["returns"] = returns
    elif cfg.adv_estimator in ESTIMATORS:
        adv = estimator_advantages(
            cfg.adv_estimator,
            rewards + segment_sum(kl_pen, cu),
            outcome_token_rewards(rewards, mask, cu) + kl_pen,
            mask,
            cu,
            batch.get("group_index"),
            gamma=cfg.gamma,
            use_std=cfg.group_std,
        )
    else:
        raise ValueError(
            f"adv_estimator {cfg.adv_estimator!r}: must be grpo, reinforce, gae "
            f"or one of {ESTIMATORS}"
        )
    if cfg.batch_norm:
        adv = masked_whiten(adv, mask)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    out["advantages"] = adv
    vals = adv[mask]
    if vals.numel():  # undefined over no token (std: over fewer than two): left out
        stats["advantage_mean"] = float(vals.mean())
    if vals.numel() > 1:
        stats["advantage_std"] = float(vals.std())
    return out, stats
