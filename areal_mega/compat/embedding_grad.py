"""A word embedding whose backward adds its rows straight into the weight's main gradient.

megatron-core's ``VocabParallelEmbedding`` looks its rows up with ``F.embedding``, whose
backward builds a dense gradient of the whole table: ``[vocab, hidden]`` zeros filled in, the
rows of the batch added, and (with tied embeddings) that table added to the output layer's
weight gradient before DDP adds the sum into the fp32 main gradient. For the 135M model's
``[49,152, 576]`` table that is three passes over 56 MiB (bf16) or 113 MiB (fp32) to move a
few hundred rows, and the fresh table is above glibc's 32 MiB mmap ceiling, so its pages fault
in on every micro-batch (:mod:`areal_mega.common.malloc`).

:func:`embedding` looks the rows up the same way. When the weight is trained under megatron's
DDP (it has a ``main_grad``) its backward adds the batch's rows into ``main_grad`` in fp32
with ``index_add_``, and hands autograd no gradient for the weight. DDP's backward hook still
runs: with a tied output layer it adds that layer's gradient (``param.grad``) as before; with
an untied embedding ``param.grad`` is ``None`` and the hook adds nothing, which megatron
allows while ``overlap_grad_reduce`` is off (the engine never turns it on).
A weight without ``main_grad`` (a frozen one, a model outside DDP) takes ``F.embedding``
unchanged.

The sum is the same as the dense path's up to rounding: the rows are added in fp32 in the
batch's order, where the dense path added them in the weight's dtype first.
:mod:`areal_mega.compat.megatron_cpu` makes ``VocabParallelEmbedding`` call it on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embedding"]


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; backward: ``weight.main_grad.index_add_`` of the rows."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
        main_grad.index_add_(0, ids.reshape(-1), rows)
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``, whose gradient goes into ``weight.main_grad`` directly
    when the weight has one and autograd records the call (see the module docstring)."""
    if (
        torch.is_grad_enabled()
        and weight.requires_grad
        and getattr(weight, "main_grad", None) is not None
    ):
        return _EmbeddingIntoMainGrad.apply(ids, weight)
    return F.embedding(ids, weight)
