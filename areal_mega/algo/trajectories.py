"""Filtering and advantages on the step's trajectories, before anything is packed.

The trainer computes advantages over whole prompt groups on the list of
:class:`~areal_mega.dataplane.trajectory.Trajectory` objects it drew for a step, in each
trajectory's own token layout; packing (and the one next-token shift) comes afterwards with the
advantages as one more per-token field. The per-sequence inputs are read straight from the
trajectories under the packed batch's vocabulary (``rewards``, ``group_index``,
``seq_no_eos``, ``response_lens``); the per-token inputs the estimators need are laid end to
end in the list's order — always ``loss_mask`` (the advantages are per token), and
``logprobs`` / ``prox_logprobs`` / ``ref_logprobs`` (``kl_in_reward``) and ``values`` (GAE)
only when the configuration uses them — and the formulas are those of
:func:`~areal_mega.algo.advantages.compute_advantages`, so the numbers are the ones a packed
batch of the same trajectories gives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from areal_mega.algo.advantages import compute_advantages
from areal_mega.algo.filters import group_filter
from areal_mega.algo.packing import group_index_of

__all__ = ["sequence_rewards", "sequence_fields", "filter_trajectories", "trajectory_advantages"]


def sequence_rewards(trajs: Sequence) -> Tensor:
    """``rewards`` [B] float32: each trajectory's scalar reward, or the float64 sum of its
    per-token rewards (as ``pack_sequences`` packs them)."""
    out = np.zeros(len(trajs), np.float32)
    for i, t in enumerate(trajs):
        out[i] = t.reward.sum(dtype=np.float64) if t.reward.ndim else t.reward
    return torch.from_numpy(out)


def sequence_fields(trajs: Sequence) -> dict:
    """The per-sequence [B] inputs of filtering and advantages: ``rewards``, ``group_index``
    (derived from ``group_id``), ``seq_no_eos`` (finished by ``length``) and
    ``response_lens`` (int32, tokens after the prompt)."""
    return {
        "rewards": sequence_rewards(trajs),
        "group_index": group_index_of([t.group_id for t in trajs]),
        "seq_no_eos": torch.tensor([t.finish_reason == "length" for t in trajs], dtype=torch.bool),
        "response_lens": torch.tensor(
            [len(t.input_ids) - int(t.prompt_len) for t in trajs], dtype=torch.int32
        ),
    }


def filter_trajectories(
    trajs: Sequence, enabled: bool = True, *, tol: float = 0.0
) -> tuple[list, dict[str, float]]:
    """Dynamic sampling on a trajectory list: drop the trajectories of uniform-reward groups
    (when ``enabled``), keeping the others in order. Statistics as
    :func:`~areal_mega.algo.filters.dynamic_filter` (reported whether or not it is enabled)."""
    seq = sequence_fields(trajs)
    keep, stats = group_filter(seq["rewards"], seq["group_index"], tol=tol)
    if not enabled or bool(keep.all()):
        stats.update(seqs_dropped=0.0, seqs_kept=float(len(trajs)))
        return list(trajs), stats
    kept = [t for t, k in zip(trajs, keep.tolist()) if k]
    stats.update(seqs_dropped=float(len(trajs) - len(kept)), seqs_kept=float(len(kept)))
    return kept, stats


def _token_column(trajs: Sequence, name: str) -> Optional[Tensor]:
    """One per-token field of every trajectory laid end to end (a core field or a
    ``token_extras`` entry); None when the first trajectory has no such field."""

    def get(t):
        return getattr(t, name) if name in ("loss_mask", "logprobs") else t.token_extras.get(name)

    arrays = [get(t) for t in trajs]
    if arrays[0] is None:
        return None
    missing = [t.sample_id for t, a in zip(trajs, arrays) if a is None]
    if missing:
        raise ValueError(
            f"per-token field {name!r} present in some trajectories only "
            f"(missing in {missing[0]!r})"
        )
    return torch.from_numpy(np.concatenate(arrays))


@torch.no_grad()
def trajectory_advantages(
    trajs: Sequence, cfg, *, max_response_len: Optional[int] = None
) -> tuple[list, dict[str, float]]:
    """Per-token advantages of each trajectory, in its own layout (float32 arrays of its
    length L, 0 where ``loss_mask`` is 0), and the statistics of
    :func:`~areal_mega.algo.advantages.compute_advantages`; ``cfg`` is an
    ``AlgorithmConfig``, ``max_response_len`` the rollout's ``max_new_tokens``. Group
    statistics are over ``group_id`` within ``trajs``, batch normalisation over all of them."""
    if not trajs:
        raise ValueError("trajectory_advantages: no trajectories")
    lens = np.array([len(t.input_ids) for t in trajs], np.int64)
    cu = np.zeros(len(trajs) + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    inputs = {
        **sequence_fields(trajs),
        "cu_seqlens": torch.from_numpy(cu),
        "loss_mask": _token_column(trajs, "loss_mask"),
    }
    wanted = []
    if cfg.kl_in_reward and cfg.kl_coef > 0:
        wanted += ["logprobs", "prox_logprobs", "ref_logprobs"]
    if cfg.adv_estimator == "gae":
        wanted.append("values")
    for name in wanted:
        col = _token_column(trajs, name)
        if col is not None:
            inputs[name] = col
    out, stats = compute_advantages(inputs, cfg, max_response_len=max_response_len)
    adv = out["advantages"].to(torch.float32).numpy()
    return [adv[cu[i] : cu[i + 1]] for i in range(len(trajs))], stats
