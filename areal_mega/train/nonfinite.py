"""Skipped training steps: a non-finite loss or gradient never becomes an update.

The engine refuses the optimizer step itself (:meth:`MegatronEngine.optimizer_step`, a flag
all-reduced over the trainer ranks, so every rank skips together). This module keeps the
count for the metrics (``train/skipped``, ``train/skipped_steps``,
``train/skip_reason/<source>``), names the likely source from what in the step's micro-batches
was non-finite, and stops the run after ``actor.max_consecutive_skips`` skipped steps in a row
(:class:`NonFiniteStepsError`, fatal: a relaunch would feed the same inputs again).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["NonFiniteStepsError", "SkipGuard", "nonfinite_fields", "likely_source", "FIELD_SOURCES"]

#: micro-batch fields checked on a skipped step, in the order a cause is named, and the source
#: each points at (the first non-finite one is the likely cause of the rest)
FIELD_SOURCES = {
    "teacher_logprobs": "teacher",
    "rewards": "rewards",
    "reward": "rewards",
    "token_rewards": "rewards",
    "logprobs": "rollout logprobs",
    "ref_logprobs": "reference model",
    "values": "critic",
    "returns": "critic",
    "advantages": "advantages",
    "prox_logprobs": "learning rate",
}
SOURCE_HINTS = {
    "teacher": "the teacher's logprobs (teacher.server_addrs / teacher.path)",
    "rewards": "the rewards (the workflow's reward function)",
    "rollout logprobs": "the rollout servers' logprobs",
    "reference model": "the reference model's logprobs (ref.path)",
    "critic": "the critic's values or returns",
    "advantages": "the advantages (algorithm.adv_estimator / its normalisation)",
    "learning rate": "the learning rate (optimizer.lr): the policy's own logprobs or "
    "gradients are non-finite although its inputs are finite",
    "routes": "the MoE routes replayed from the rollout (algorithm.routing_replay) or the "
    "learning rate (optimizer.lr)",
}


class NonFiniteStepsError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient; the message names
    the steps and the likely source. Fatal: the weights are finite (no such update was
    applied) and the last checkpoint holds finite weights."""


def nonfinite_fields(micro_batches: Sequence) -> list:
    """The :data:`FIELD_SOURCES` fields holding a NaN or ±inf in any of ``micro_batches``."""
    bad = []
    for name in FIELD_SOURCES:
        for mb in micro_batches:
            v = mb.get(name) if hasattr(mb, "get") else None
            if v is None:
                continue
            a = v.detach().float().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
            if a.dtype.kind in "fc" and not np.isfinite(a).all():
                bad.append(name)
                break
    return bad


def likely_source(
    fields: Sequence[str], lr: Optional[float] = None, routing_replay: bool = False
) -> str:
    """The source named for a skipped step: that of the first non-finite input field, else
    the learning rate when it is itself non-finite, else routes (with routing replay) or the
    learning rate."""
    for name in FIELD_SOURCES:
        if name in fields:
            return FIELD_SOURCES[name]
    if lr is not None and not math.isfinite(lr):
        return "learning rate"
    return "routes" if routing_replay else "learning rate"


class SkipGuard:
    """Counts skipped steps and stops the run after ``max_consecutive`` in a row.

    :meth:`record` is collective (every trainer rank, once per step); :meth:`check` raises
    :class:`NonFiniteStepsError` on every rank alike."""

    def __init__(self, max_consecutive: int, routing_replay=False):
        """``routing_replay``: whether the actor replays rollout routes (a bool, or
        ``algorithm.routing_replay``: anything but ``"off"`` is on)."""
        self.max_consecutive = max_consecutive
        self.routing_replay = bool(routing_replay) and routing_replay != "off"
        self.total = 0
        self.consecutive = []  # (step, source) of the current run of skipped steps

    def record(self, step: int, train_stats: dict, micro_batches: Sequence) -> dict:
        """The step's ``train/*`` metrics; ``train_stats``: the merged engine stats
        (``skipped_minibatches`` present when an optimizer step was skipped)."""
        if not train_stats.get("skipped_minibatches"):
            self.consecutive = []
            return {"train/skipped": 0.0, "train/skipped_steps": float(self.total)}
        fields = nonfinite_fields(micro_batches)
        mask = torch.tensor([float(n in fields) for n in FIELD_SOURCES])
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank names the same
            dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        fields = [n for n, m in zip(FIELD_SOURCES, mask.tolist()) if m > 0]
        source = likely_source(fields, train_stats.get("lr"), self.routing_replay)
        self.total += 1
        self.consecutive.append((step, source, fields))
        print(
            f"[areal-mega] step {step}: non-finite "
            f"{'loss' if train_stats.get('nonfinite_loss') else 'gradients'}; optimizer step "
            f"skipped (likely source: {source}; non-finite inputs: {fields or 'none'})",
            flush=True,
        )
        return {
            "train/skipped": 1.0,
            "train/skipped_steps": float(self.total),
            f"train/skip_reason/{source.replace(' ', '_')}": 1.0,
        }

    def check(self) -> None:
        """Raise :class:`NonFiniteStepsError` once ``max_consecutive`` steps in a row were
        skipped."""
        if len(self.consecutive) < self.max_consecutive:
            return
        steps = [s for s, _, _ in self.consecutive]
        sources = [src for _, src, _ in self.consecutive]
        source = max(set(sources), key=sources.count)
        fields = sorted({f for _, _, fs in self.consecutive for f in fs})
        raise NonFiniteStepsError(
            f"{len(steps)} training steps in a row (steps {steps[0]}..{steps[-1]}) had a "
            f"non-finite loss or gradient and were skipped (no update applied); likely source: "
            f"{SOURCE_HINTS[source]} (non-finite inputs: {', '.join(fields) or 'none'}). The "
            f"weights and checkpoints are finite: fix the source and resume "
            f"(actor.max_consecutive_skips sets how many skips in a row are tolerated)"
        )
