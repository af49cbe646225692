"""Evaluation during RL training, on the trainer's side (``eval.*`` keys).

When an evaluation is due (:func:`eval_due`: step 0 of a fresh run, every
``eval.every_steps`` steps, and the last step), trainer rank 0 sends ``evaluate`` with the
version it just published to the rollout worker and waits for the ``eval/*`` scalars
(:mod:`areal_mega.eval.worker_hook` runs it); the caller logs them in the step's metrics row
(``metrics.jsonl``, TensorBoard, the plot). Waiting keeps the weights fixed during the
evaluation; the worker keeps generating training samples meanwhile.
"""

from __future__ import annotations


def eval_due(eval_cfg, step: int, total_steps: int) -> bool:
    """Whether an evaluation follows step ``step`` (0: before training): off when
    ``eval.every_steps`` is 0 or ``eval.data`` is empty; else at step 0, at every multiple of
    ``every_steps`` and at ``total_steps``."""
    every = eval_cfg.every_steps
    if not every or not eval_cfg.data:
        return False
    return step % every == 0 or step == total_steps


def evaluate_if_due(session, step: int) -> dict:
    """The ``eval/*`` metrics of the weights of version ``step`` when an evaluation is due
    (``{}`` otherwise, and on ranks other than 0). Blocks rank 0 until the worker answers
    (within ``rollout.request_timeout_s``) and writes the completions it sends back to the
    samples log (``kind: eval``); a refused or failed evaluation raises
    :class:`~areal_mega.dataplane.control.ControlError`."""
    cfg = session.cfg
    if not session.is_rank0 or not eval_due(cfg.eval, step, cfg.total_steps):
        return {}
    reply = session.link.request(
        {"cmd": "evaluate", "version": int(step)}, timeout_s=cfg.rollout.request_timeout_s
    )
    if int(reply.get("version", -1)) != step:
        raise RuntimeError(
            f"evaluation answered for version {reply.get('version')!r}, asked for {step}"
        )
    session.logger.log_eval_samples(step, reply.get("samples") or [])  # completions
    return {**reply["metrics"], "eval/version": step}


def evaluate_before_training(session) -> None:
    """A fresh run's baseline: evaluate the initial weights (version 0) and log them as the
    metrics row of step 0 (nothing when resuming, when eval is off, or off rank 0)."""
    if session.start_step != 0:
        return
    metrics = evaluate_if_due(session, 0)
    if metrics:
        session.logger.log(0, metrics)
