"""On-policy distillation (OPD): the teacher's per-token reverse-KL signal as an advantage.

The student samples; a teacher scores the student's own tokens. On a loss token t the
single-sample reverse-KL estimate is ``log π_student(y_t) − log π_teacher(y_t)`` (its
expectation under the student is KL(π_student ‖ π_teacher) at that position), and the OPD
advantage is its negative, scaled::

    A_t^opd = −coef · (log π_student(y_t) − log π_teacher(y_t))

``log π_student`` is the proximal logprob the trainer recomputes (``prox_logprobs``), so the
signal is the same for every PPO minibatch of a step. ``mode="pure"`` replaces the outcome
advantages with it; ``mode="add"`` adds it to the outcome advantages (GRPO, PPO, ... as
``algorithm.adv_estimator`` gave them). Non-loss tokens (prompt, padding, tool output) get 0.
Pure tensor functions: no engine, no distributed state.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["OPD_MODES", "opd_advantages", "reverse_kl_sums"]

#: ``algorithm.opd`` values.
OPD_MODES = ("off", "pure", "add")


def opd_advantages(
    advantages: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    mode: str,
    coef: float = 1.0,
) -> Tensor:
    """The per-token advantages with the OPD term applied (a new tensor; inputs untouched).

    All tensors are ``[T]`` in one layout (the packed next-token layout in the trainer).
    ``mode``: ``off`` returns ``advantages`` unchanged (a copy), ``pure`` returns
    ``−coef·(student − teacher)`` on loss tokens, ``add`` returns ``advantages`` plus that term
    on loss tokens. Outside the loss mask the result is 0 (``pure``/``add``). Computed in fp32
    at least (fp64 inputs stay fp64). Raises ValueError for an unknown mode or mismatched
    shapes."""
    if mode not in OPD_MODES:
        raise ValueError(f"opd mode must be one of {OPD_MODES}, got {mode!r}")
    shapes = {tuple(t.shape) for t in (advantages, student_logprobs, teacher_logprobs, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"opd_advantages: tensors of different shapes {sorted(shapes)}")
    dtype = torch.promote_types(advantages.dtype, torch.float32)
    if mode == "off":
        return advantages.to(dtype).clone()
    mask = loss_mask.bool()
    term = -float(coef) * (student_logprobs.to(dtype) - teacher_logprobs.to(dtype))
    base = advantages.to(dtype) if mode == "add" else torch.zeros_like(term)
    return torch.where(mask, base + term, torch.zeros_like(term))


def reverse_kl_sums(
    student_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor
) -> Tensor:
    """``[Σ_t (student − teacher), Σ_t |student − teacher|, n]`` over the loss tokens, in fp64:
    the sums behind ``opd/reverse_kl`` (their mean per loss token) and ``opd/abs_log_ratio``,
    to be added over micro-batches and DP ranks before dividing."""
    mask = loss_mask.bool()
    diff = (student_logprobs.double() - teacher_logprobs.double())[mask]
    return torch.stack(
        [diff.sum(), diff.abs().sum(), torch.tensor(float(mask.sum()), dtype=torch.float64)]
    )
