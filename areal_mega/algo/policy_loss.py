r"""The decoupled PPO / GRPO policy loss, its aggregation and its statistics.

Notation, per generated token t of sequence i (loss_mask m_t = 1):
``logπ_θ`` = ``logprobs`` (current weights, differentiable), ``logπ_prox`` = ``prox_logprobs``
(trainer's recomputation under the weights before this update), ``logπ_behav`` =
``mb["logprobs"]`` (the rollout policy that sampled the token: the trajectory's ``logprobs``
under the same name), A_t = ``advantages``.

Ratio (``ratio_level``)::

    token:     r_t = π_θ(y_t) / π_old(y_t)
    sequence:  r_t = s_i = exp( (1/|y_i|) Σ_{u∈i} m_u (logπ_θ(y_u) − logπ_old(y_u)) )   (GSPO)

with π_old = π_prox when ``decoupled`` (Hilton et al., "Batch size-invariance for policy
optimization"; AReaL) and π_old = π_behav otherwise (standard PPO).

Clipped surrogate with clip-higher (ε_low, ε_high) and optional dual clip c > 1::

    ℓ_t = max( −A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high) )
    ℓ_t = min( ℓ_t, −c A_t )            only where A_t < 0 (dual clip)

``policy_loss`` = ``cispo`` / ``sapo`` replace ℓ_t by the objectives of
:mod:`areal_mega.algo.objectives` (token ratio); ``gspo`` is the clipped surrogate of the
sequence ratio.

Decoupled objective: each token's surrogate is weighted by the behaviour importance weight
(a constant, no gradient) ``w = π_prox / π_behav`` (see :func:`behav_importance_weight` for the
token / sequence / geometric levels and the mask / clamp cap), so the per-token loss is::

    L_t = w_t · keep_t · ℓ_t  +  β_kl · KL_t(π_θ ‖ π_ref)  −  β_ent · H_t

with KL_t the ``kl_estimator`` (k1/k2/k3) of :func:`~areal_mega.algo.kl.kl_estimate`, k3
clamped to ±``kl_clamp`` (verl's convention; see docs/algorithms.md).

Aggregation (``loss_agg``) as numerator / denominator, see :func:`aggregate_loss`. The engine
sums numerators over micro-batches and divides by the sum of denominators over all micro-batches
and DP ranks (computed before the forward passes), so the loss and its gradients do not depend on
how the batch is split.

Packed layout and context parallelism: sequence i is the slot ``[cu[i], cu[i+1])`` of
``cu = cu_seqlens_padded`` (``cu_seqlens`` when absent; the slot's padding has loss_mask 0). The
engine hands the loss a CP rank's share of the tokens with that share's own layout and a
``cp_shard`` (see :mod:`areal_mega.engine.loss_context`): per-token sums are additive over the
CP ranks, every per-sequence sum goes through ``seq_reduce`` = ``cp_shard.sum`` (identity without
CP), and per-sequence statistics are reported by the owner rank only. Every tensor input must be
on the device of ``logprobs`` (checked: mixing devices raises a ValueError naming the field).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from areal_mega.algo.kl import kl_estimate
from areal_mega.algo.objectives import POLICY_LOSSES, cispo_surrogate, sapo_surrogate
from areal_mega.algo.packing import broadcast_to_tokens, segment_sum

#: Log-ratios are clamped to ±MAX_LOG_RATIO before ``exp`` so a single wild token cannot turn
#: the loss into inf/NaN. Such a ratio (e^20) is far outside any clip range anyway.
MAX_LOG_RATIO = 20.0

LOSS_AGGS = ("token_mean", "seq_mean", "seq_sum_norm")

LossFn = Callable[[Tensor, Optional[Tensor], dict], "tuple[Tensor, dict[str, Tensor]]"]
SeqReduce = Optional[Callable[[Tensor], Tensor]]


def _total(per_seq: Tensor, seq_reduce: SeqReduce) -> Tensor:
    return per_seq if seq_reduce is None else seq_reduce(per_seq)


def segment_bounds(mb: dict) -> Tensor:
    """The slot layout of a packed micro-batch: ``cu_seqlens_padded`` when present, else
    ``cu_seqlens`` (equal without context-parallel slot padding)."""
    cu = mb.get("cu_seqlens_padded")
    return mb["cu_seqlens"] if cu is None else cu


def check_devices(logprobs: Tensor, mb: dict, keys, entropy: Optional[Tensor] = None) -> None:
    """Raise a ValueError naming the first field of ``mb`` (among ``keys``; absent ones are
    skipped) or ``entropy`` that is a tensor on another device than ``logprobs``. The engine
    hands a loss its micro-batch on the compute device; a loss run on a micro-batch left on the
    host would otherwise fail deep inside an operator, or not at all on CPU."""
    fields = [(k, mb.get(k)) for k in keys] + [("entropy", entropy)]
    for key, value in fields:
        if isinstance(value, Tensor) and value.device != logprobs.device:
            raise ValueError(
                f"loss input {key!r} is on {value.device} but logprobs are on "
                f"{logprobs.device}: the micro-batch must be on the compute device "
                "(see areal_mega.engine.loss_context.loss_view)"
            )


def _exp(log_x: Tensor) -> Tensor:
    return torch.exp(log_x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` else 0, without letting NaN/inf of masked-out entries through."""
    return torch.where(mask, x, torch.zeros_like(x))


# ----------------------------------------------------------------------------- building blocks


def ppo_ratio(
    logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Optional[Tensor] = None,
    level: str = "token",
    seq_reduce: SeqReduce = None,
) -> Tensor:
    r"""Policy ratio per token, differentiable w.r.t. ``logprobs``; 1 where ``loss_mask`` is 0.

    ``token``: r_t = exp(logπ_θ − logπ_old).
    ``sequence`` (GSPO): every token of sequence i gets s_i = exp(mean over i's loss tokens of
    (logπ_θ − logπ_old)); the gradient flows through the mean to all of i's tokens.
    ``seq_reduce`` adds the per-sequence partial sums of the other CP shards (differentiable).
    """
    mask = loss_mask.bool()
    d = _masked(logprobs - old_logprobs, mask)
    if level == "token":
        return _exp(d)
    if level != "sequence":
        raise ValueError(f"ratio level {level!r}: must be 'token' or 'sequence'")
    if cu_seqlens is None:
        raise ValueError("a sequence-level ratio needs cu_seqlens")
    n_tok = _total(segment_sum(mask.to(d.dtype), cu_seqlens), seq_reduce).clamp_min(1.0)
    mean_d = _total(segment_sum(d, cu_seqlens), seq_reduce) / n_tok
    return _exp(_masked(broadcast_to_tokens(mean_d, cu_seqlens, d.shape[0]), mask))


@torch.no_grad()
def behav_importance_weight(
    prox_logprobs: Tensor,
    logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Optional[Tensor] = None,
    *,
    cap: Optional[float] = None,
    level: str = "token",
    mode: str = "mask",
    seq_reduce: SeqReduce = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Importance weight of the proximal against the behaviour policy (no gradient);
    ``logprobs`` are the behaviour logprobs (the batch's ``logprobs``).

    Levels, with δ_u = logπ_prox(y_u) − logπ_behav(y_u) over the loss tokens u of sequence i::

        token:      w_t = exp(δ_t)
        sequence:   w_t = exp(Σ_u δ_u)              the sequence's true likelihood ratio
        geometric:  w_t = exp((1/|y_i|) Σ_u δ_u)    its per-token geometric mean

    Cap (``cap`` None = no cap): ``mask`` drops every token (every sequence, for the sequence
    levels) whose weight exceeds ``cap`` — it keeps its place in the denominator but contributes
    0 to the numerator; ``clamp`` uses min(w, cap) (truncated importance sampling).
    ``seq_reduce`` adds the per-sequence sums of the other CP shards.

    Returns ``(weight, keep, capped)``: the (clamped) weight [T] (1 where loss_mask is 0), the
    bool mask of tokens that stay in the loss, and the bool mask of loss tokens above the cap.
    """
    mask = loss_mask.bool()
    d = _masked(prox_logprobs - logprobs, mask)
    if level in ("sequence", "geometric"):
        if cu_seqlens is None:
            raise ValueError(f"imp_weight_level={level!r} needs cu_seqlens")
        log_w = _total(segment_sum(d, cu_seqlens), seq_reduce)
        if level == "geometric":
            log_w = log_w / _total(segment_sum(mask.to(d.dtype), cu_seqlens), seq_reduce).clamp_min(
                1.0
            )
        d = _masked(broadcast_to_tokens(log_w, cu_seqlens, d.shape[0]), mask)
    elif level != "token":
        raise ValueError(f"imp_weight_level {level!r}: must be token, sequence or geometric")
    weight = _exp(d)
    if cap is None:
        return weight, mask, torch.zeros_like(mask)
    capped = mask & (weight > cap)
    if mode == "mask":
        return weight, mask & ~capped, capped
    if mode == "clamp":
        return weight.clamp_max(cap), mask, capped
    raise ValueError(f"imp_weight_mode {mode!r}: must be 'mask' or 'clamp'")


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: Optional[float] = None,
    dual_clip_c: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""PPO clipped surrogate loss per token (to be minimised).

    ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)); with dual clip c > 1, ℓ = min(ℓ, −c·A) where
    A < 0 (bounds the loss of a negative-advantage token whose ratio exploded).

    Returns ``(loss, clipped, dual_clipped)``: the loss [T] and bool masks of the tokens where
    the clipped branch (resp. the dual-clip bound) is the active one (zero gradient there).
    """
    eps_high = eps_low if eps_high is None else eps_high
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c}: must be > 1")
    bound = -dual_clip_c * advantages
    dual = (advantages < 0) & (loss > bound)
    return torch.where(dual, bound, loss), clipped, dual


def loss_denominator(loss_mask: Tensor, cu_seqlens: Tensor, loss_agg: str) -> Tensor:
    """This micro-batch's share of the global denominator: the number of loss tokens
    (``token_mean``) or of sequences with at least one loss token (``seq_mean``,
    ``seq_sum_norm``). Computed from the data alone, before any forward pass."""
    mask = loss_mask.to(torch.float64)
    if loss_agg == "token_mean":
        return mask.sum()
    if loss_agg in ("seq_mean", "seq_sum_norm"):
        return (segment_sum(mask, cu_seqlens) > 0).to(torch.float64).sum()
    raise ValueError(f"loss_agg {loss_agg!r}: must be one of {LOSS_AGGS}")


def aggregate_loss(
    token_loss: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    loss_agg: str,
    norm_len: Optional[float] = None,
    seq_reduce: SeqReduce = None,
) -> Tensor:
    r"""This micro-batch's numerator; the loss is Σ_mb numerator / Σ_{mb,dp} denominator.

    ``token_mean``:   Σ_t m_t L_t                   / Σ_t m_t          (mean over all tokens)
    ``seq_mean``:     Σ_i (Σ_{t∈i} m_t L_t / |y_i|) / #sequences        (mean of sequence means)
    ``seq_sum_norm``: Σ_t m_t L_t / norm_len        / #sequences        (Dr.GRPO: constant norm)

    With ``seq_reduce`` (CP shards) |y_i| is the whole sequence's count, so the numerators of
    the shards add up to the full one.
    """
    mask = loss_mask.bool()
    tl = _masked(token_loss, mask)
    if loss_agg == "token_mean":
        return tl.sum()
    if loss_agg == "seq_mean":
        n_tok = _total(segment_sum(mask.to(tl.dtype), cu_seqlens), seq_reduce).clamp_min(1.0)
        return (segment_sum(tl, cu_seqlens) / n_tok).sum()
    if loss_agg == "seq_sum_norm":
        if not norm_len or norm_len <= 0:
            raise ValueError(
                "loss_agg='seq_sum_norm' needs a positive norm_len "
                "(algorithm.loss_norm_len or rollout.max_new_tokens)"
            )
        return tl.sum() / float(norm_len)
    raise ValueError(f"loss_agg {loss_agg!r}: must be one of {LOSS_AGGS}")


def policy_objective(
    objective: str, logprobs: Tensor, ratio: Tensor, advantages: Tensor, cfg
) -> tuple[Tensor, Tensor, Tensor]:
    """The per-token loss of ``algorithm.policy_loss`` (``ppo``/``gspo``: clipped surrogate of
    ``ratio``; ``cispo``, ``sapo``: :mod:`areal_mega.algo.objectives`) and the bool masks
    ``(clipped, dual_clipped)`` (all False for SAPO; CISPO has no dual clip)."""
    if objective in ("ppo", "gspo"):
        return clipped_surrogate(
            ratio,
            advantages,
            eps_low=cfg.eps_clip_low,
            eps_high=cfg.eps_clip_high,
            dual_clip_c=cfg.dual_clip_c,
        )
    none = torch.zeros_like(advantages, dtype=torch.bool)
    if objective == "cispo":
        loss, clipped = cispo_surrogate(
            logprobs, ratio, advantages, eps_low=cfg.eps_clip_low, eps_high=cfg.eps_clip_high
        )
        return loss, clipped, none
    if objective == "sapo":
        return (
            sapo_surrogate(ratio, advantages, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg),
            none,
            none,
        )
    raise ValueError(f"policy_loss {objective!r}: must be one of {POLICY_LOSSES}")


# ----------------------------------------------------------------------------- the loss


def policy_loss(
    logprobs: Tensor,
    entropy: Optional[Tensor],
    mb: dict,
    cfg,
    norm_len: Optional[float] = None,
    *,
    prox_from_forward: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's loss numerator and summed statistics (the engine loss contract).

    ``cfg`` is an :class:`~areal_mega.config.AlgorithmConfig`. ``mb`` needs ``loss_mask``,
    ``cu_seqlens``, ``advantages``, ``logprobs`` (behaviour: the trajectory's, not the
    ``logprobs`` argument, which are π_θ's); ``prox_logprobs`` when ``cfg.decoupled``;
    ``ref_logprobs`` when ``cfg.kl_coef > 0`` and not ``cfg.kl_in_reward``. With
    ``prox_from_forward`` and no ``prox_logprobs`` in ``mb``, π_prox is ``logprobs`` detached:
    exact when this forward runs on the weights that define π_prox (one optimizer step per RL
    step), and it saves the proximal forward pass.

    Statistics are detached sums over this micro-batch's loss tokens (see
    :func:`finalize_stats` for their means): ``token_count``, ``seq_count``, ``clip_count``,
    ``dual_clip_count``, ``ratio_sum``, ``ppo_kl_sum`` (k1 of π_θ against π_old: exactly 0 when
    they agree), ``behav_kl_sum`` (k1 against the behaviour policy), ``mismatch_sum``
    (|trainer logprob − rollout logprob| over tokens generated by the weights the trainer
    evaluates — ``versions == policy_version`` when both are given — with its own count
    ``mismatch_tokens``; the trainer's logprob is π_prox when given, else π_θ),
    ``behav_diff_sum`` (the same difference over all loss tokens: mismatch plus policy lag),
    ``imp_weight_sum``, ``imp_weight_sq_sum``, ``imp_weight_capped_count``, ``pg_loss_sum``,
    ``advantage_sum``, and ``kl_ref_sum`` / ``entropy_sum`` when available.

    Sequences are the slots of :func:`segment_bounds`; with ``mb["cp_shard"]`` (a CP rank's
    share, see the module docstring) per-sequence sums are added over the CP group.
    """
    check_devices(
        logprobs,
        mb,
        ("loss_mask", "advantages", "logprobs", "prox_logprobs", "ref_logprobs", "versions"),
        entropy,
    )
    dtype = logprobs.dtype
    cu = segment_bounds(mb)
    shard = mb.get("cp_shard")
    seq_reduce = None if shard is None else shard.sum
    owner = shard is None or shard.owner
    mask = mb["loss_mask"].bool()
    adv = mb["advantages"].to(dtype)
    behav = mb["logprobs"].to(dtype)
    prox = mb["prox_logprobs"].to(dtype) if mb.get("prox_logprobs") is not None else None
    if prox is None and prox_from_forward:
        prox = logprobs.detach()
    if cfg.decoupled:
        if prox is None:
            raise KeyError("decoupled PPO needs 'prox_logprobs' in the micro-batch")
        old = prox
        weight, keep, capped = behav_importance_weight(
            prox,
            behav,
            mask,
            cu,
            cap=cfg.behav_imp_weight_cap,
            level=cfg.imp_weight_level,
            mode=cfg.imp_weight_mode,
            seq_reduce=seq_reduce,
        )
    else:
        old = behav
        weight, keep, capped = torch.ones_like(behav), mask, torch.zeros_like(mask)

    objective = getattr(cfg, "policy_loss", "ppo")
    level = "sequence" if objective == "gspo" else cfg.ratio_level
    ratio = ppo_ratio(logprobs, old.detach(), mask, cu, level, seq_reduce)
    pg, clipped, dual = policy_objective(objective, logprobs, ratio, adv, cfg)
    pg = _masked(weight * pg, keep)
    token_loss = pg
    kl_ref = None
    if mb.get("ref_logprobs") is not None:
        kl_ref = kl_estimate(
            logprobs, mb["ref_logprobs"].to(dtype), cfg.kl_estimator, mask, clamp=cfg.kl_clamp
        )
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            token_loss = token_loss + cfg.kl_coef * kl_ref
    elif cfg.kl_coef > 0 and not cfg.kl_in_reward:
        raise KeyError("kl_coef > 0 with the KL as a loss term needs 'ref_logprobs'")
    if entropy is not None and cfg.entropy_coef > 0:
        token_loss = token_loss - cfg.entropy_coef * entropy
    numerator = aggregate_loss(token_loss, mask, cu, cfg.loss_agg, norm_len, seq_reduce)

    with torch.no_grad():
        m = mask.to(dtype)
        lp = logprobs.detach()
        trainer_lp = prox if prox is not None else lp
        # the training/inference mismatch compares the same weights: with asynchronous
        # rollouts only tokens generated by the version the trainer evaluates qualify
        same_weights = mask
        if mb.get("versions") is not None and mb.get("policy_version") is not None:
            same_weights = mask & (mb["versions"] == int(mb["policy_version"]))
        n_seq = (_total(segment_sum(m, cu), seq_reduce) > 0).to(dtype).sum()
        stats = {
            "token_count": m.sum(),
            "seq_count": n_seq if owner else torch.zeros_like(n_seq),
            "clip_count": (clipped & mask).to(dtype).sum(),
            "dual_clip_count": (dual & mask).to(dtype).sum(),
            "ratio_sum": _masked(ratio.detach(), mask).sum(),
            "ppo_kl_sum": _masked(old - lp, mask).sum(),
            "behav_kl_sum": _masked(behav - lp, mask).sum(),
            "mismatch_sum": _masked((trainer_lp - behav).abs(), same_weights).sum(),
            "mismatch_tokens": same_weights.to(dtype).sum(),
            "behav_diff_sum": _masked((trainer_lp - behav).abs(), mask).sum(),
            "imp_weight_sum": _masked(weight, mask).sum(),
            "imp_weight_sq_sum": _masked(weight * weight, mask).sum(),
            "imp_weight_capped_count": capped.to(dtype).sum(),
            "pg_loss_sum": pg.detach().sum(),
            "advantage_sum": _masked(adv, mask).sum(),
        }
        if kl_ref is not None:
            stats["kl_ref_sum"] = kl_ref.detach().sum()
        if entropy is not None:
            stats["entropy_sum"] = _masked(entropy.detach().to(dtype), mask).sum()
    return numerator, stats


LOSS_MASK_ONLY = "reads_loss_mask_only"


def reads_loss_mask_only(loss_fn: Callable) -> Callable:
    """Mark an engine loss function as reading log-probabilities and entropies only where its
    micro-batch's ``loss_mask`` is set, so the engine may compute logits at those rows only
    (:mod:`areal_mega.engine.loss_rows`); returns ``loss_fn``."""
    setattr(loss_fn, LOSS_MASK_ONLY, True)
    return loss_fn


def make_policy_loss(
    cfg, *, max_response_len: Optional[int] = None, prox_from_forward: bool = False
) -> tuple[LossFn, Callable[[dict], float]]:
    """``(loss_fn, denominator_fn)`` for the engine (see the module docstring).

    ``loss_fn(logprobs, entropy, mb) -> (numerator, stats)``; ``denominator_fn(mb) -> float``.
    ``max_response_len`` (the trainer passes ``rollout.max_new_tokens``) is the ``seq_sum_norm``
    constant unless ``cfg.loss_norm_len`` sets it. ``prox_from_forward``: see
    :func:`policy_loss`.
    """
    if cfg.loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg {cfg.loss_agg!r}: must be one of {LOSS_AGGS}")
    if getattr(cfg, "policy_loss", "ppo") not in POLICY_LOSSES:
        raise ValueError(f"policy_loss {cfg.policy_loss!r}: must be one of {POLICY_LOSSES}")
    norm_len = cfg.loss_norm_len or max_response_len
    if cfg.loss_agg == "seq_sum_norm" and not norm_len:
        raise ValueError(
            "loss_agg='seq_sum_norm' needs algorithm.loss_norm_len or "
            "max_response_len (rollout.max_new_tokens)"
        )

    @reads_loss_mask_only  # the engine computes logits at loss-mask rows only
    def loss_fn(logprobs: Tensor, entropy: Optional[Tensor], mb: dict):
        return policy_loss(
            logprobs, entropy, mb, cfg, norm_len, prox_from_forward=prox_from_forward
        )

    def denominator_fn(mb: dict) -> float:
        return float(loss_denominator(mb["loss_mask"], segment_bounds(mb), cfg.loss_agg))

    return loss_fn, denominator_fn


def finalize_stats(summed: dict) -> dict[str, float]:
    """Turn statistics summed over micro-batches and DP ranks into means.

    Every per-token statistic is divided by ``token_count``: ``X_sum`` -> ``X`` (mean),
    ``X_count`` -> ``X_frac``, ``X_sq_sum`` -> ``X_std`` (from the second moment) — except
    that an ``X_sum`` with its own ``X_tokens`` count is divided by that count.
    ``token_count``, ``seq_count`` and ``X_tokens`` are passed through. Works on tensors or
    floats.

    A mean over zero tokens is undefined and left out of the result (never NaN, never 0):
    ``X`` when ``X_tokens`` is 0 (e.g. ``mismatch`` on a step with no token of the trainer's
    weights version), and every per-token mean, fraction and std when ``token_count`` is 0
    or absent.
    """
    vals = {k: float(v) for k, v in summed.items()}
    n = vals.get("token_count", 0.0)
    out: dict[str, float] = {}
    for key, v in vals.items():
        if key in ("token_count", "seq_count") or key.endswith("_tokens"):
            out[key] = v
        elif key.endswith("_sum") and key[: -len("_sum")] + "_tokens" in vals:
            own = vals[key[: -len("_sum")] + "_tokens"]
            if own > 0:
                out[key[: -len("_sum")]] = v / own
        elif key.endswith(("_sum", "_count")) and n <= 0:
            continue  # a per-token mean over no token
        elif key.endswith("_sq_sum"):
            base = key[: -len("_sq_sum")]
            mean = vals.get(base + "_sum", 0.0) / n
            out[base + "_std"] = math.sqrt(max(v / n - mean * mean, 0.0))
        elif key.endswith("_sum"):
            out[key[: -len("_sum")]] = v / n
        elif key.endswith("_count"):
            out[key[: -len("_count")] + "_frac"] = v / n
        else:
            out[key] = v
    return out
