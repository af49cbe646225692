"""Pure-torch references for the packed-sequence kernels.

Three kinds of functions live here:

* ``logprobs_naive`` and ``gae_loop_reference``: the obvious, slow, memory-hungry definitions
  (a float32 ``[T, V]`` log-softmax; a per-token Python loop in float64).  Tests compare every
  backend against them and ``bench/kernels.py`` measures the kernels against them.
* ``logprob_stats_torch`` / ``logprob_backward_torch``: the torch fallback backend of
  :func:`areal_mega.ops.packed_logprobs`.  They work on chunks of tokens, so the float32
  temporaries are bounded by ``chunk_size x V_local`` instead of ``T x V_local``.
* ``packed_gae_torch``: a vectorised torch GAE (loop over time, vectorised over sequences, the
  way most RL trainers write it) used as the fallback backend of
  :func:`areal_mega.ops.packed_gae`.

Per-token logprob statistics (the contract shared by every backend) for one TP shard
``x = logits / temperature`` of width ``V_local`` starting at global id ``vocab_start``:

* ``m``    = max_v x_v
* ``s``    = sum_v exp(x_v - m)
* ``xlab`` = x_label if ``vocab_start <= label < vocab_start + V_local`` else 0
* ``u``    = sum_v exp(x_v - m) * (x_v - m)            (only needed for the entropy)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

FLOAT32_MIN = torch.finfo(torch.float32).min


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation (and output) dtype: float64 for float64 logits, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_size(vocab: int, budget_elems: int = 1 << 23) -> int:
    """Tokens per chunk so that one float32 chunk of logits holds about ``budget_elems`` values."""
    return max(1, budget_elems // max(1, vocab))


def _local_label_index(labels: torch.Tensor, vocab_start: int, vocab_local: int):
    local = labels.long() - vocab_start
    valid = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), valid


def logprob_stats_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, ...]:
    """Per-token statistics ``(m, s, xlab, u)`` of one vocabulary shard, chunked over tokens.

    ``u`` is ``None`` unless ``with_entropy``.  Outputs are ``[T]`` in :func:`acc_dtype`.
    """
    T, V = logits.shape
    chunk = chunk_size or default_chunk_size(V)
    inv_t = 1.0 / float(temperature)
    dev = logits.device
    acc = acc_dtype(logits.dtype)
    lowest = torch.finfo(acc).min
    m = torch.empty(T, dtype=acc, device=dev)
    s = torch.empty_like(m)
    u = torch.empty_like(m) if with_entropy else None
    idx, valid = _local_label_index(labels, vocab_start, V)
    xlab = logits.gather(1, idx[:, None]).squeeze(1).to(acc) * inv_t
    xlab = torch.where(valid, xlab, torch.zeros_like(xlab))
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        x = logits[a:b].to(acc, copy=True)
        if inv_t != 1.0:
            x.mul_(inv_t)
        mc = x.amax(dim=1)
        m[a:b] = mc
        x.sub_(mc[:, None]).clamp_(min=lowest)
        e = torch.exp(x)
        s[a:b] = e.sum(dim=1)
        if with_entropy:
            u[a:b] = e.mul_(x).sum(dim=1)
        del x, e
    return m, s, xlab, u


def logprob_backward_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    *,
    ex: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient w.r.t. the logits shard, in the logits' dtype.

    With ``p = softmax(x)`` over the global vocabulary (``lse`` is its global log-sum-exp) and
    ``ex = E_p[x]``: ``d/dx_v = g_lp * (1[v = label] - p_v) - g_ent * p_v * (x_v - ex)``, and
    ``d/dlogits = d/dx / temperature``. ``out``: the tensor to write it to (``logits``
    itself may be: each chunk is read before it is written); a new one when None.
    """
    T, V = logits.shape
    chunk = chunk_size or default_chunk_size(V)
    inv_t = 1.0 / float(temperature)
    grad = torch.empty_like(logits) if out is None else out
    idx, valid = _local_label_index(labels, vocab_start, V)
    acc = acc_dtype(logits.dtype)
    lowest = torch.finfo(acc).min
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        x = logits[a:b].to(acc, copy=True)
        if inv_t != 1.0:
            x.mul_(inv_t)
        p = torch.exp(x - lse[a:b, None])
        g = p * (-grad_logprob[a:b, None])
        if grad_entropy is not None:
            x.sub_(ex[a:b, None]).clamp_(min=lowest)
            g.sub_(p.mul_(x).mul_(grad_entropy[a:b, None]))
        rows = torch.arange(b - a, device=logits.device)
        g[rows, idx[a:b]] += torch.where(
            valid[a:b], grad_logprob[a:b], torch.zeros_like(grad_logprob[a:b])
        )
        if inv_t != 1.0:
            g.mul_(inv_t)
        grad[a:b] = g
        del x, p, g
    return grad


def logprobs_naive(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """The textbook definition: ``log_softmax(logits.float() / T).gather(labels)``.

    Materialises float32 ``[T, V]`` copies; negative labels give logprob 0.  Differentiable.
    """
    logp = torch.log_softmax(logits.to(acc_dtype(logits.dtype)) / temperature, dim=-1)
    lab = labels.long()
    lp = logp.gather(1, lab.clamp(min=0)[:, None]).squeeze(1)
    lp = torch.where(lab >= 0, lp, torch.zeros_like(lp))
    if not return_entropy:
        return lp
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return lp, ent


def _check_gae_inputs(rewards, values, cu_seqlens, bootstrap_values, loss_mask):
    if rewards.dim() != 1 or values.shape != rewards.shape:
        raise ValueError(
            f"rewards and values must be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D with B+1 >= 1 entries")
    B = cu_seqlens.numel() - 1
    if bootstrap_values is not None and bootstrap_values.shape != (B,):
        raise ValueError(
            f"bootstrap_values must have shape ({B},), got {tuple(bootstrap_values.shape)}"
        )
    if loss_mask is not None and loss_mask.shape != rewards.shape:
        raise ValueError(
            f"loss_mask must have shape {tuple(rewards.shape)}, got {tuple(loss_mask.shape)}"
        )


def gae_loop_reference(
    rewards,
    values,
    cu_seqlens,
    *,
    gamma: float,
    lam: float,
    bootstrap_values=None,
    loss_mask=None,
    dtype: torch.dtype = torch.float64,
):
    """GAE by the definition: a per-token Python loop, accumulated in float64.

    Tokens past ``cu_seqlens[-1]`` (padding) get 0.  Returns ``(advantages, returns)``.
    """
    _check_gae_inputs(rewards, values, cu_seqlens, bootstrap_values, loss_mask)
    r = rewards.double().tolist()
    v = values.double().tolist()
    cu = cu_seqlens.long().tolist()
    mk = loss_mask.bool().tolist() if loss_mask is not None else None
    boot = bootstrap_values.double().tolist() if bootstrap_values is not None else None
    adv = [0.0] * len(r)
    ret = [0.0] * len(r)
    gl = gamma * lam
    for b in range(len(cu) - 1):
        next_v = boot[b] if boot is not None else 0.0
        next_a = 0.0
        for t in range(cu[b + 1] - 1, cu[b] - 1, -1):
            if mk is not None and not mk[t]:
                continue
            a = r[t] + gamma * next_v - v[t] + gl * next_a
            adv[t] = a
            ret[t] = a + v[t]
            next_v = v[t]
            next_a = a
    return (torch.tensor(adv, dtype=dtype), torch.tensor(ret, dtype=dtype))


def packed_gae_torch(
    rewards, values, cu_seqlens, *, gamma: float, lam: float, bootstrap_values=None, loss_mask=None
):
    """Vectorised torch GAE: scatter the (masked-in) tokens into a ``[L, B]`` grid and run the
    recurrence with one vectorised step per time index.  float32 in and out."""
    _check_gae_inputs(rewards, values, cu_seqlens, bootstrap_values, loss_mask)
    dev = rewards.device
    T = rewards.numel()
    B = cu_seqlens.numel() - 1
    adv = torch.zeros(T, dtype=torch.float32, device=dev)
    ret = torch.zeros(T, dtype=torch.float32, device=dev)
    if B == 0:
        return adv, ret
    cu = cu_seqlens.long().to(dev)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(B, device=dev), lengths)
    keep = torch.ones(total, dtype=torch.bool, device=dev)
    if loss_mask is not None:
        keep = loss_mask[:total].bool()
    kept = keep.nonzero().squeeze(1)
    sid = seq_id[kept]
    counts = torch.bincount(sid, minlength=B)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(kept.numel(), device=dev) - starts[sid]
    L = int(counts.max()) if kept.numel() else 0
    r = torch.zeros(L + 1, B, dtype=torch.float32, device=dev)
    v = torch.zeros(L + 1, B, dtype=torch.float32, device=dev)
    r[pos, sid] = rewards[kept].float()
    v[pos, sid] = values[kept].float()
    if bootstrap_values is not None:
        v[counts, torch.arange(B, device=dev)] = bootstrap_values.float().to(dev)
    valid = torch.arange(L, device=dev)[:, None] < counts[None, :]
    delta = (r[:L] + gamma * v[1:] - v[:L]) * valid
    a = torch.zeros(L + 1, B, dtype=torch.float32, device=dev)
    gl = float(gamma * lam)
    for t in range(L - 1, -1, -1):
        torch.add(delta[t], a[t + 1], alpha=gl, out=a[t])
    adv[kept] = a[pos, sid]
    ret[kept] = adv[kept] + values[kept].float()
    return adv, ret
