"""Logits only where the loss reads them.

A GRPO micro-batch packs prompts and completions; the policy loss reads the log-probabilities
of the completion tokens only (``mb["loss_mask"]``), yet the output layer, the largest GEMM of
a small model (vocabulary × hidden), would run over every packed token, prompts included. A
loss function that reads nothing outside its micro-batch's ``loss_mask`` says so with
:func:`areal_mega.algo.policy_loss.reads_loss_mask_only`; for it the engine hands megatron-core's
``GPTModel`` an
``output_processor`` (:func:`logits_at_rows`) that projects only those rows, and scatters the
log-probabilities back to every position (0 elsewhere, as for positions without a label).
Forward-only log-probabilities (π_prox, the reference, evaluation) keep every row.

Not with sequence parallelism: there the output layer gathers the sequence itself, so the
hidden states it receives are this rank's slice, not the rows the mask names.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from areal_mega.algo.policy_loss import LOSS_MASK_ONLY

__all__ = ["loss_rows", "logits_at_rows", "scatter_rows"]


def loss_rows(
    loss_fn: Optional[Callable],
    mb: dict,
    valid: torch.Tensor,
    index: Optional[torch.Tensor],
    *,
    sequence_parallel: bool,
) -> Optional[torch.Tensor]:
    """The local token rows whose logits ``loss_fn`` needs (this rank's CP share when
    ``index`` is given), or None for every row: an unmarked loss, sequence parallelism, a
    micro-batch without ``loss_mask``, or when the rows are all or none of the tokens."""
    if (
        loss_fn is None
        or not getattr(loss_fn, LOSS_MASK_ONLY, False)
        or sequence_parallel
        or mb.get("loss_mask") is None
    ):
        return None
    mask = torch.as_tensor(mb["loss_mask"]).reshape(-1).bool()
    if index is not None:
        mask = mask[index.to(mask.device)]
    mask = mask.to(valid.device) & valid
    rows = mask.nonzero().reshape(-1)
    return rows if 0 < rows.numel() < mask.numel() else None


def logits_at_rows(
    *,
    hidden_states: torch.Tensor,
    output_layer,
    output_weight,
    context,
    runtime_gather_output=None,
    scale_logits=None,
    **_,
) -> torch.Tensor:
    """megatron-core ``GPTModel`` output processor: the output layer (and its logit scaling)
    on the rows ``context`` of ``hidden_states`` [s, 1, h] only; returns [1, rows, V_local],
    the layout of the model's usual logits."""
    logits, _ = output_layer(
        hidden_states.index_select(0, context),
        weight=output_weight,
        runtime_gather_output=runtime_gather_output,
    )
    if scale_logits is not None:
        logits = scale_logits(logits)
    return logits.transpose(0, 1).contiguous()


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """``values`` of ``rows`` placed in a [total] tensor of zeros (differentiable)."""
    return values.new_zeros(total).index_put((rows,), values)
