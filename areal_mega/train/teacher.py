"""On-policy distillation (``algorithm.opd``) in the RL step and the trainer session.

* :func:`build_teacher` — the in-trainer teacher (``teacher.path``): a forward-only
  :class:`~areal_mega.engine.megatron_engine.MegatronEngine` (``role="ref"``) on the trainer's
  mesh and layout, with its own HF config and dtype (``teacher.dtype``, default
  ``model.dtype``). The session loads its weights from ``<run_dir>/init_mcore_teacher``
  (converted once from ``teacher.path``; never from ``checkpoint.load``, which holds the
  student), on a fresh run and on a resume alike.
* :func:`teacher_logprobs` — the ONE place teacher logprobs come from: the in-trainer engine's
  forward at ``actor.temperature`` (as the proximal and reference logprobs). A teacher served
  by SGLang-compatible servers (``teacher.server_addrs``) plugs in here.
* :func:`opd_step` — attaches ``teacher_logprobs`` to the micro-batches, replaces (``pure``) or
  shifts (``add``) their advantages with :func:`~areal_mega.algo.distill.opd_advantages`
  student = ``prox_logprobs``) and returns the ``opd/*`` and ``time/teacher`` statistics.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from areal_mega.algo.distill import opd_advantages, reverse_kl_sums
from areal_mega.config_schema import ConfigError
from areal_mega.train import batches

__all__ = ["build_teacher", "teacher_model_config", "teacher_logprobs", "opd_step"]


def teacher_model_config(cfg):
    """``cfg.model`` with the teacher's path and dtype (``teacher.dtype`` or ``model.dtype``);
    the other model keys (vocab padding, attention backend) are the trainer's."""
    return dataclasses.replace(cfg.model, path=cfg.teacher.path,
                               dtype=cfg.teacher.dtype or cfg.model.dtype,
                               recompute_granularity=None)


def build_teacher(cfg, mesh):
    """The in-trainer teacher engine of ``cfg`` (RL, ``algorithm.opd`` on, ``teacher.path``
    set), or None (no OPD, or a served teacher). Its weights are loaded by the session."""
    if cfg.mode != "rl" or cfg.algorithm.opd == "off" or not cfg.teacher.path:
        return None
    from areal_mega.engine.megatron_engine import MegatronEngine

    return MegatronEngine(teacher_model_config(cfg), hf_config=cfg.teacher.path, role="ref",
                          mesh=mesh, seed=cfg.seed)


def teacher_logprobs(session, micro_batches: list) -> list:
    """The teacher's log p(token t+1 | tokens ≤ t) for every micro-batch, as fp32 ``[T]`` CPU
    tensors in the micro-batches' next-token layout (0 where ``labels`` is -1), computed at
    ``actor.temperature``. Collective over the trainer ranks (the in-trainer teacher runs the
    trainer's pipeline schedule). ``teacher.server_addrs`` raises :class:`ConfigError` (not
    in this build)."""
    cfg = session.cfg
    if session.teacher is not None:
        return session.teacher.forward_logprobs(micro_batches,
                                                temperature=cfg.actor.temperature)
    raise ConfigError(f"teacher.server_addrs={cfg.teacher.server_addrs!r}: a teacher scored "
                      "by servers is not available in this build yet; use teacher.path")


def _dp_sum(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t`` summed over the DP ranks (every rank of one DP replica holds the same data)."""
    if mesh.dims.dp > 1 and dist.is_initialized():
        t = t.to(mesh.device)
        dist.all_reduce(t, group=mesh.dp_group)
    return t.cpu()


def opd_step(session, micro_batches: list) -> tuple[list, dict]:
    """With ``algorithm.opd`` on: new micro-batches with ``teacher_logprobs`` attached and the
    OPD advantages (``pure``: replaced, ``add``: outcome + term; after GRPO / GAE
    normalisation), and the statistics ``opd/reverse_kl`` (mean over the step's loss tokens,
    all DP ranks, of ``prox_logprobs − teacher_logprobs``), ``opd/abs_log_ratio`` (mean
    absolute value) and ``time/teacher``. With OPD off: the inputs and ``{}``. Needs
    ``prox_logprobs`` attached; collective over the trainer ranks."""
    alg = session.cfg.algorithm
    if alg.opd == "off":
        return micro_batches, {}
    t0 = time.time()
    mbs = batches.attach(micro_batches, teacher_logprobs=teacher_logprobs(session, micro_batches))
    advs, sums = [], torch.zeros(3, dtype=torch.float64)
    for mb in mbs:
        advs.append(opd_advantages(mb["advantages"], mb["prox_logprobs"],
                                   mb["teacher_logprobs"], mb["loss_mask"], mode=alg.opd,
                                   coef=alg.opd_coef))
        sums += reverse_kl_sums(mb["prox_logprobs"], mb["teacher_logprobs"], mb["loss_mask"])
    total, total_abs, n = _dp_sum(sums, session.mesh).tolist()
    mbs = batches.attach(mbs, advantages=advs)
    n_safe = max(n, 1.0)
    return mbs, {"opd/reverse_kl": total / n_safe, "opd/abs_log_ratio": total_abs / n_safe,
                 "time/teacher": time.time() - t0}
