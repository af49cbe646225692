r"""Outcome advantage estimators with the meaning of verl's registered estimators of the same
names (``verl/trainer/ppo/core_algos.py``), over packed per-token data.

Per sequence i of prompt group g (size n), R_i its outcome reward (the sum of its token
rewards), |y_i| its number of loss tokens:

- ``rloo``: A_i = R_i − mean of the other n − 1 rewards = n/(n−1)·(R_i − mean_g R).
- ``opo``: A_i = R_i − Σ_g |y_j| R_j / Σ_g |y_j| (length-weighted group baseline).
- ``grpo_passk``: only the best sequence of the group gets a non-zero advantage,
  r_max − r_second (÷ (std_g R + 1e−6) when ``use_std``); a tied maximum gives 0 to all.
- ``reinforce_plus_plus``: per-token discounted returns-to-go G_t = Σ_{u≥t} γ^{u−t} r_u over the
  loss tokens, whitened over all loss tokens of the batch (:func:`whiten_like_verl`).
- ``reinforce_plus_plus_baseline``: R_i − mean_g R on every loss token, whitened likewise.

Every function works in the floating dtype it is given (integers become float32), so a float64
test can compare against verl's outputs to 1e−12. Conventions kept on purpose (stated in
docs/algorithms.md): a singleton group gets A = 0 (verl: R_i, and ``grpo_passk`` raises); the
returns-to-go of ``reinforce_plus_plus`` run over the loss tokens in order, skipping tokens with
loss mask 0 as ``areal_mega.ops.packed_gae`` does (verl restarts the sum at every masked token;
the two agree when each sequence's loss tokens are contiguous).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from areal_mega.algo.packing import broadcast_to_tokens, segment_sum, token_seq_ids

EPS = 1e-6
WHITEN_EPS = 1e-8
SEQUENCE_ESTIMATORS = ("rloo", "opo", "grpo_passk")
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
ESTIMATORS = SEQUENCE_ESTIMATORS + TOKEN_ESTIMATORS

__all__ = [
    "ESTIMATORS",
    "discounted_returns",
    "estimator_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "whiten_like_verl",
]


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def _groups(group_index: Tensor) -> tuple[Tensor, Tensor]:
    """(group id per sequence in 0..G−1, long [B]; group sizes, long [G])."""
    _, gid = torch.unique(group_index, return_inverse=True)
    return gid, torch.bincount(gid, minlength=int(gid.max()) + 1 if gid.numel() else 0)


def _group_sum(x: Tensor, gid: Tensor, n_groups: int) -> Tensor:
    return x.new_zeros(n_groups).index_add(0, gid, x)


def _centred(r: Tensor, gid: Tensor, count: Tensor) -> Tensor:
    """R_i − mean_g R, 0 for singleton groups."""
    mean = _group_sum(r, gid, count.numel()) / count.to(r.dtype)
    return torch.where(count[gid] > 1, r - mean[gid], torch.zeros_like(r))


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    r"""RLOO (verl ``rloo``): A_i = n/(n−1)·(R_i − mean_g R), the reward minus the mean of the
    other n − 1 rewards of its group; 0 for a singleton (verl keeps R_i). Returns [B]."""
    r = _float(rewards)
    gid, count = _groups(group_index)
    n = count[gid].to(r.dtype)
    return _centred(r, gid, count) * n / (n - 1).clamp_min(1)


def opo_advantages(rewards: Tensor, group_index: Tensor, lengths: Tensor) -> Tensor:
    r"""OPO (verl ``opo``): A_i = R_i − b_g with the length-weighted baseline
    b_g = Σ_g |y_j| R_j / Σ_g |y_j| (``lengths`` [B] = loss tokens per sequence); 0 for a
    singleton (verl keeps R_i) and b_g = 0 for a group without loss tokens. Returns [B]."""
    r = _float(rewards)
    w = lengths.to(r.dtype)
    gid, count = _groups(group_index)
    num = _group_sum(w * r, gid, count.numel())
    den = _group_sum(w, gid, count.numel())
    base = torch.where(den > 0, num / den.clamp_min(torch.finfo(r.dtype).tiny), 0 * num)
    return torch.where(count[gid] > 1, r - base[gid], torch.zeros_like(r))


def grpo_passk_advantages(
    rewards: Tensor, group_index: Tensor, *, use_std: bool = True, eps: float = EPS
) -> Tensor:
    r"""GRPO pass@k (verl ``grpo_passk``): the group's best sequence gets r_max − r_second
    (divided by std_g R + ``eps``, unbiased std, when ``use_std``), every other sequence 0; a
    maximum shared by several sequences gives 0 to all. A singleton group gets 0 (verl raises:
    pass@k needs two samples). Returns [B]."""
    r = _float(rewards)
    gid, count = _groups(group_index)
    g = count.numel()
    neg_inf = torch.full((g,), float("-inf"), dtype=r.dtype, device=r.device)
    gmax = neg_inf.scatter_reduce(0, gid, r, "amax", include_self=True)
    is_max = r == gmax[gid]
    n_max = torch.bincount(gid[is_max], minlength=g)
    rest = torch.where(is_max, torch.full_like(r, float("-inf")), r)
    second = neg_inf.scatter_reduce(0, gid, rest, "amax", include_self=True)
    second = torch.where(n_max > 1, gmax, second)
    gap = gmax - second
    if use_std:
        mean = _group_sum(r, gid, g) / count.to(r.dtype)
        sq = _group_sum((r - mean[gid]) ** 2, gid, g)
        gap = gap / ((sq / (count - 1).clamp_min(1).to(r.dtype)).sqrt() + eps)
    win = is_max & (n_max[gid] == 1) & (count[gid] > 1)
    return torch.where(win, gap[gid], torch.zeros_like(r))


def whiten_like_verl(x: Tensor, mask: Tensor) -> Tensor:
    r"""verl's ``masked_whiten`` over the entries where ``mask`` is 1, 0 elsewhere:
    μ = Σ x / (n + 1e−8), σ² = Σ (x − μ)² / (n + 1e−8) · n/(n − 1), (x − μ)/√(σ² + 1e−8).
    With fewer than two entries (verl raises) it returns x − μ there. Unlike
    :func:`~areal_mega.algo.advantages.masked_whiten` (÷ (σ + 1e−6)), this is the form verl's
    REINFORCE++ estimators use, kept so they match verl to float precision."""
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros_like(x))
    n = m.sum().to(x.dtype)
    mean = xm.sum() / (n + WHITEN_EPS)
    if int(m.sum()) < 2:
        return torch.where(m, x - mean, torch.zeros_like(x))
    dev = torch.where(m, x - mean, torch.zeros_like(x))
    var = (dev**2).sum() / (n + WHITEN_EPS) * n / (n - 1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + WHITEN_EPS), torch.zeros_like(x))


def discounted_returns(
    token_rewards: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, *, gamma: float
) -> Tensor:
    r"""G_t = r_t + γ·G_{t'} over the loss tokens of each sequence in order (t' the next loss
    token of the same sequence, G = 0 past its last one); tokens with loss mask 0 and padding
    get 0 and their rewards are ignored. Same numbers as ``packed_gae`` with V = 0, λ = 1, in
    the input's dtype. Returns [T]."""
    r = _float(token_rewards)
    n_tok = r.shape[0]
    n_seq = cu_seqlens.numel() - 1
    sid = token_seq_ids(cu_seqlens, n_tok).to(r.device)
    kept = (loss_mask.bool() & (sid < n_seq)).nonzero().squeeze(1)
    s = sid[kept]
    counts = torch.bincount(s, minlength=n_seq)
    pos = torch.arange(kept.numel(), device=r.device) - (torch.cumsum(counts, 0) - counts)[s]
    steps = int(counts.max()) if kept.numel() else 0
    grid = r.new_zeros(steps + 1, max(n_seq, 1))
    grid[pos, s] = r[kept]
    for t in range(steps - 1, -1, -1):
        grid[t] += gamma * grid[t + 1]
    out = torch.zeros_like(r)
    out[kept] = grid[pos, s]
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, *, gamma: float
) -> Tensor:
    r"""REINFORCE++ (verl ``reinforce_plus_plus``): :func:`discounted_returns` whitened over
    every loss token of the batch (:func:`whiten_like_verl`), 0 off the loss mask. [T]."""
    returns = discounted_returns(token_rewards, loss_mask, cu_seqlens, gamma=gamma)
    return whiten_like_verl(returns, loss_mask)


def reinforce_pp_baseline_advantages(
    rewards: Tensor, group_index: Tensor, loss_mask: Tensor, cu_seqlens: Tensor
) -> Tensor:
    r"""REINFORCE++-baseline (verl ``reinforce_plus_plus_baseline``): R_i − mean_g R (0 for a
    singleton; verl keeps R_i) on every loss token of i, then whitened over all loss tokens of
    the batch (:func:`whiten_like_verl`; longer sequences weigh more). Returns [T]."""
    r = _float(rewards)
    gid, count = _groups(group_index)
    per_tok = broadcast_to_tokens(_centred(r, gid, count), cu_seqlens, loss_mask.shape[0])
    return whiten_like_verl(per_tok, loss_mask)


def estimator_advantages(
    name: str,
    seq_rewards: Tensor,
    token_rewards: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    group_index: Optional[Tensor],
    *,
    gamma: float = 1.0,
    use_std: bool = True,
) -> Tensor:
    """Per-token advantages [T] (0 off the loss mask) of one of :data:`ESTIMATORS`.

    ``seq_rewards`` [B] are the outcome rewards R_i (already including any per-token reward
    such as a KL penalty), ``token_rewards`` [T] the same rewards per token (REINFORCE++ only),
    ``group_index`` [B] the prompt groups (all but REINFORCE++), ``gamma`` the REINFORCE++
    discount, ``use_std`` the pass@k std division (``algorithm.group_std``)."""
    mask = loss_mask.bool()
    n_tok = mask.shape[0]
    if name == "reinforce_plus_plus":
        return reinforce_pp_advantages(token_rewards, mask, cu_seqlens, gamma=gamma)
    if name not in ESTIMATORS:
        raise ValueError(f"adv_estimator {name!r}: not one of {ESTIMATORS}")
    if group_index is None:
        raise KeyError(f"adv_estimator {name!r} needs the batch's 'group_index'")
    if name == "reinforce_plus_plus_baseline":
        return reinforce_pp_baseline_advantages(seq_rewards, group_index, mask, cu_seqlens)
    if name == "rloo":
        adv = rloo_advantages(seq_rewards, group_index)
    elif name == "opo":
        lengths = segment_sum(mask.to(_float(seq_rewards).dtype), cu_seqlens)
        adv = opo_advantages(seq_rewards, group_index, lengths)
    else:
        adv = grpo_passk_advantages(seq_rewards, group_index, use_std=use_std)
    per_tok = broadcast_to_tokens(adv, cu_seqlens, n_tok)
    return torch.where(mask, per_tok, torch.zeros_like(per_tok))
