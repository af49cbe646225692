"""Entry checks of the numbers a sample brings into the trainer from outside.

Rank 0 screens the step's trajectories before planning (:func:`screen_samples`): a sample whose
reward (the workflow's) or rollout logprobs (the inference servers') are NaN/inf, or whose
MoE routes do not fit the model or name one expert twice in a token's top-k, is dropped from
its group before the advantages, logged with its id and the source, and counted in the step's
row (``refused/samples``, ``refused/<source>``); the rest of its group trains. The teacher's
logprobs are checked where they arrive, in the OPD step (:func:`refuse_bad_teacher_rows`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import numpy as np
import torch

from areal_mega.common.moe_routes import ROUTED_EXPERTS, RouteLayout, check_routes, repeated_expert

__all__ = [
    "TEACHER_LOGPROB_TOL",
    "TEACHER_LOGPROB_MIN",
    "sample_problem",
    "screen_samples",
    "teacher_row_problem",
    "refuse_bad_teacher_rows",
]

log = logging.getLogger(__name__)

#: a log-probability is <= 0; this much above 0 is still rounding (a bf16 teacher)
TEACHER_LOGPROB_TOL = 1e-2
#: below this a teacher logprob is garbage (e^-10000: no softmax of real logits gives it), and
#: in the reverse-KL advantage it would swamp every other token
TEACHER_LOGPROB_MIN = -1e4


def sample_problem(traj, route_layout: Optional[RouteLayout] = None) -> Optional[tuple]:
    """``(source, why)`` for the first value of ``traj`` the trainer must not train on, else
    None: ``rewards`` (non-finite reward), ``rollout_logprobs`` (non-finite behaviour
    logprobs on loss tokens), ``routes`` (with routing replay: a misfit, or an expert repeated
    within one token's top-k)."""
    reward = np.asarray(traj.reward, dtype=np.float64)
    if not np.isfinite(reward).all():
        return "rewards", f"reward {reward.tolist()} is not finite (the workflow's reward)"
    lp = np.asarray(traj.logprobs, dtype=np.float64)[np.asarray(traj.loss_mask, bool)]
    if not np.isfinite(lp).all():
        return (
            "rollout_logprobs",
            "logprobs of generated tokens are not finite (the rollout server's answer)",
        )
    if route_layout is not None:
        problem = check_routes(traj, route_layout)
        if problem is not None:
            return "routes", problem
        rep = repeated_expert(traj.token_extras[ROUTED_EXPERTS])
        if rep is not None:
            t, layer, e = rep
            return "routes", (
                f"token_extras.{ROUTED_EXPERTS}: token {t}, MoE layer {layer} "
                f"names expert {e} twice in its top-k (the rollout server's "
                "routes)"
            )
    return None


def screen_samples(
    trajs: Sequence, route_layout: Optional[RouteLayout] = None, quarantine=None
) -> tuple[list, dict, list]:
    """``(kept trajectories, stats, refused trajectories)``: ``trajs`` split by
    :func:`sample_problem` (each refused one logged with its sample id and source); ``stats``
    counts the refused (``refused/samples`` and ``refused/<source>``; empty when none).
    ``quarantine``: a :class:`~areal_mega.train.quarantine.Quarantine`; its samples are
    refused too (``refused/quarantine``) and written to its file."""
    kept, stats, refused = [], {}, []
    for t in trajs:
        problem = sample_problem(t, route_layout)
        if problem is None and quarantine is not None and t.sample_id in quarantine:
            quarantine.write(t)
            problem = (
                "quarantine",
                f"quarantined: the trainer died on its micro-batch "
                f"({quarantine.reason(t.sample_id)})",
            )
        if problem is None:
            kept.append(t)
            continue
        refused.append(t)
        source, why = problem
        log.warning(
            "refused sample %r (group %r): %s; dropped, the run goes on",
            t.sample_id,
            t.group_id,
            why,
        )
        stats[f"refused/{source}"] = stats.get(f"refused/{source}", 0.0) + 1.0
        stats["refused/samples"] = stats.get("refused/samples", 0.0) + 1.0
    return kept, stats, refused


def teacher_row_problem(lp: torch.Tensor) -> Optional[str]:
    """Why teacher logprobs ``lp`` (one sequence's loss tokens) cannot be trained on: NaN/inf,
    above 0 by more than :data:`TEACHER_LOGPROB_TOL` or below :data:`TEACHER_LOGPROB_MIN`;
    None when they are fine."""
    if lp.numel() == 0:
        return None
    if not bool(torch.isfinite(lp).all()):
        return "non-finite teacher logprobs"
    top, low = float(lp.max()), float(lp.min())
    if top > TEACHER_LOGPROB_TOL:
        return f"a teacher logprob of {top:.4g} > 0"
    if low < TEACHER_LOGPROB_MIN:
        return f"a teacher logprob of {low:.4g} < {TEACHER_LOGPROB_MIN:g}"
    return None


def refuse_bad_teacher_rows(micro_batches: list) -> tuple[list, list]:
    """Check each packed sequence's ``teacher_logprobs`` on its loss tokens; a sequence with
    a bad one (:func:`teacher_row_problem`) is dropped from training: its ``loss_mask`` and
    teacher logprobs are zeroed (new tensors; the inputs are not mutated). Returns (the
    micro-batches, ``[(sample id or index, why)]`` of the refused sequences)."""
    out, refused = [], []
    for mb in micro_batches:
        lp = torch.as_tensor(mb["teacher_logprobs"])
        mask = torch.as_tensor(mb["loss_mask"])
        bad_spans = []
        ids = mb.get("sample_ids")
        for i, (start, n) in enumerate(
            zip(mb["cu_seqlens_padded"].tolist(), mb["seqlens"].tolist())
        ):
            rows = mask[start : start + n].bool()
            why = teacher_row_problem(lp[start : start + n][rows])
            if why is not None:
                bad_spans.append((start, n))
                refused.append((ids[i] if ids is not None and i < len(ids) else i, why))
        if bad_spans:
            lp, mask = lp.clone(), mask.clone()
            for start, n in bad_spans:
                lp[start : start + n] = 0.0
                mask[start : start + n] = 0
            mb = (
                dataclasses.replace(mb, teacher_logprobs=lp, loss_mask=mask)
                if dataclasses.is_dataclass(mb)
                else {**mb, "teacher_logprobs": lp, "loss_mask": mask}
            )
        out.append(mb)
    return out, refused
