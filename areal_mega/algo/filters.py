"""Dynamic sampling (DAPO): drop prompt groups whose rewards all agree.

A group where every sample got the same reward has zero group-normalised advantage for every
token, so it only dilutes the batch; dropping it keeps the gradient signal per token up.

Convention: a singleton group (one sample) counts as uniform and is dropped, consistent with
its zero advantage in :func:`~areal_mega.algo.advantages.group_normalize`. verl's DAPO filter
keeps singleton groups (its rule is "std > 0 or a single sample"); AReaL has no built-in group
filter (a workflow's ``should_accept_fn`` decides). See docs/algorithms.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from areal_mega.algo.packing import select_sequences


def uniform_groups(
    rewards: Tensor, group_index: Tensor, *, tol: float = 0.0
) -> tuple[Tensor, Tensor]:
    """``(keep [B] bool, uniform_group [G] bool)``: a group is uniform when
    max − min of its rewards ≤ ``tol``; ``keep`` is False on every sequence of such a group.
    A singleton group is uniform. Groups are numbered by ``torch.unique(group_index)``
    (sorted ids)."""
    r = rewards.to(torch.float32)
    _, gid = torch.unique(group_index, return_inverse=True)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    gid = gid.to(r.device)
    hi = torch.full((n_groups,), -float("inf"), device=r.device).scatter_reduce(0, gid, r, "amax")
    lo = torch.full((n_groups,), float("inf"), device=r.device).scatter_reduce(0, gid, r, "amin")
    uniform = (hi - lo) <= tol
    return ~uniform[gid], uniform


def group_filter(
    rewards: Tensor, group_index: Tensor, *, tol: float = 0.0
) -> tuple[Tensor, dict[str, float]]:
    """``(keep [B] bool, stats)`` of the uniform-group rule over per-sequence ``rewards`` and
    their ``group_index``: what :func:`dynamic_filter` (packed batch) and
    :func:`~areal_mega.algo.trajectories.filter_trajectories` (trajectory list) both apply.
    Statistics: ``groups``, ``uniform_groups``, ``uniform_group_frac``,
    ``uniform_all_max_groups`` (uniform at the batch's highest reward, e.g. all correct),
    ``uniform_all_min_groups``."""
    r = rewards.to(torch.float32)
    keep, uniform = uniform_groups(r, group_index, tol=tol)
    _, gid = torch.unique(group_index, return_inverse=True)
    n_groups = uniform.numel()
    group_value = torch.full((n_groups,), 0.0, device=r.device).scatter_reduce(
        0, gid.to(r.device), r, "amax", include_self=False
    )
    stats = {
        "groups": float(n_groups),
        "uniform_groups": float(uniform.sum()),
        "uniform_all_max_groups": float((uniform & (group_value >= r.max() - tol)).sum())
        if n_groups
        else 0.0,
        "uniform_all_min_groups": float((uniform & (group_value <= r.min() + tol)).sum())
        if n_groups
        else 0.0,
    }
    if n_groups:  # a fraction of no group is left out
        stats["uniform_group_frac"] = float(uniform.float().mean())
    return keep, stats


def dynamic_filter(
    batch: dict, enabled: bool = True, *, rewards: Tensor | None = None, tol: float = 0.0
) -> tuple[dict, dict[str, float]]:
    """Drop the sequences of uniform-reward groups from a packed batch (when ``enabled``).

    ``rewards`` defaults to ``batch["rewards"]`` (pass shaped rewards to filter on those).
    Statistics are reported whether or not the filter is enabled: those of
    :func:`group_filter`, ``seqs_dropped`` and ``seqs_kept``. Returns ``(batch, stats)``; the
    batch is unchanged when nothing is dropped.
    """
    r = (batch["rewards"] if rewards is None else rewards).to(torch.float32)
    keep, stats = group_filter(r, batch["group_index"], tol=tol)
    if not enabled or bool(keep.all()):
        stats.update(seqs_dropped=0.0, seqs_kept=float(r.numel()))
        return batch, stats
    idx = torch.nonzero(keep).flatten()
    stats.update(seqs_dropped=float(r.numel() - idx.numel()), seqs_kept=float(idx.numel()))
    return select_sequences(batch, idx), stats
