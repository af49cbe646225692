"""Generalised advantage estimation over packed sequences (segmented reverse scan)."""

from __future__ import annotations

from typing import Optional

import torch

from . import _backend
from .reference import _check_gae_inputs, packed_gae_torch


def packed_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_values: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
):
    """GAE for packed sequences.

    For token ``t`` of sequence ``b`` (tokens ``cu_seqlens[b] .. cu_seqlens[b+1]-1``):
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    ``returns_t = A_t + V_t``.  Past the last token of ``b``, ``V_next = bootstrap_values[b]``
    (0 when ``bootstrap_values`` is ``None``: terminated) and ``A_next = 0``.  With
    ``loss_mask``, tokens whose mask is 0 are skipped (the recurrence runs over the masked-in
    tokens in order; their rewards are ignored) and get ``A = returns = 0``.  Tokens past
    ``cu_seqlens[-1]`` (padding) get 0.

    Args:
        rewards, values: ``[T]`` float tensors.
        cu_seqlens: ``[B+1]`` integer cumulative sequence lengths (``cu_seqlens[0] == 0``).
        gamma, lam: discount and GAE lambda.
        bootstrap_values: optional ``[B]`` values of the state after each (truncated) sequence.
        loss_mask: optional ``[T]`` bool/integer mask.

    Returns:
        ``(advantages, returns)``, float32 ``[T]``.  Not differentiable (advantages are targets).
    """
    _check_gae_inputs(rewards, values, cu_seqlens, bootstrap_values, loss_mask)
    dev = rewards.device
    rewards = rewards.detach().to(torch.float32).contiguous()
    values = values.detach().to(device=dev, dtype=torch.float32).contiguous()
    cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    if bootstrap_values is not None:
        bootstrap_values = (
            bootstrap_values.detach().to(device=dev, dtype=torch.float32).contiguous()
        )
    if loss_mask is not None:
        loss_mask = loss_mask.to(device=dev, dtype=torch.uint8).contiguous()
    if cu.numel() > 0 and dev.type == "cpu":
        # cheap validation on CPU; on GPU the kernel clamps instead of syncing here
        diffs = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or bool((diffs < 0).any()) or int(cu[-1]) > rewards.numel():
            raise ValueError(
                f"cu_seqlens must start at 0, be non-decreasing and end at "
                f"<= T={rewards.numel()}, got {cu.tolist()[:8]}..."
            )
    mod = _backend.select(dev)
    if mod is None:
        return packed_gae_torch(
            rewards,
            values,
            cu,
            gamma=gamma,
            lam=lam,
            bootstrap_values=bootstrap_values,
            loss_mask=loss_mask,
        )
    adv, ret = mod.gae(rewards, values, cu, bootstrap_values, loss_mask, float(gamma), float(lam))
    return adv, ret
