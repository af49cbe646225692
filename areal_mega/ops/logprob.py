"""Log-probabilities (and entropy) of label tokens over packed tokens, vocab-parallel aware.

Each backend (CUDA, C++ CPU, pure torch) returns per-token statistics of the local vocabulary
shard (see :mod:`areal_mega.ops.reference`); this module merges them across the tensor-parallel
group by all-reducing ``[T]``-sized tensors only, and implements the autograd function whose
backward is computed shard-locally from the saved global ``log-sum-exp`` and ``E[x]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import _backend
from .reference import logprob_backward_torch, logprob_stats_torch


def _tp_info(tp_group) -> Tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def local_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float,
    with_entropy: bool,
    chunk_size: Optional[int] = None,
):
    """Per-token ``(m, s, xlab, u)`` of this shard using the selected backend."""
    mod = _backend.select(logits.device)
    if mod is None:
        return logprob_stats_torch(
            logits,
            labels,
            vocab_start=vocab_start,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
        )
    m, s, xlab, u = mod.logprob_stats(
        logits, labels, int(vocab_start), 1.0 / float(temperature), bool(with_entropy)
    )
    return m, s, xlab, (u if with_entropy else None)


def merge_stats(a, b):
    """Merge the statistics of two disjoint vocabulary ranges of the same tokens."""
    m1, s1, x1, u1 = a
    m2, s2, x2, u2 = b
    m = torch.maximum(m1, m2)
    c1 = torch.exp(m1 - m)
    c2 = torch.exp(m2 - m)
    s = s1 * c1 + s2 * c2
    u = None
    if u1 is not None:
        u = c1 * (u1 + (m1 - m) * s1) + c2 * (u2 + (m2 - m) * s2)
    return m, s, x1 + x2, u


def finalize(m, s, xlab, u, labels):
    """From merged statistics to ``(logprob, entropy, lse, ex)``; entropy/ex ``None`` w/o ``u``.

    ``lse`` is the log-sum-exp of ``x = logits / T`` and ``ex = E_p[x]``.
    """
    log_s = torch.log(s)
    lse = m + log_s
    lp = xlab - lse
    lp = torch.where(labels < 0, torch.zeros_like(lp), lp)
    if u is None:
        return lp, None, lse, None
    w = u / s
    return lp, log_s - w, lse, m + w


def global_stats(m, s, xlab, u, tp_group):
    """All-reduce per-token statistics over ``tp_group`` (two collectives of ``[k, T]``)."""
    if tp_group is None or dist.get_world_size(group=tp_group) == 1:
        return m, s, xlab, u
    gmax = m.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
    scale = torch.exp(m - gmax)
    parts = [s * scale, xlab]
    if u is not None:
        parts.append(torch.where(scale > 0, scale * (u + (m - gmax) * s), torch.zeros_like(u)))
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
    return gmax, stacked[0], stacked[1], (stacked[2] if u is not None else None)


# autograd nodes that pass their input's memory on as a view (or a fresh copy) and nodes whose
# backward reads none of their output: logits reached through the first from one of the second
# are read by nothing but the logprob loss (see logits_read_by_loss_only)
_PASS_THROUGH_NODES = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
    }
)
_OUTPUT_UNREAD_NODES = frozenset(
    {
        # megatron-core's tensor-parallel linear layers (the output layer): input and weight
        "LinearWithGradAccumulationAndAsyncCommunicationBackward",
        "MaskedFillBackward0",  # the padded-vocabulary mask: saves the mask only
        "CloneBackward0",
        "ToCopyBackward0",
    }
)


def logits_read_by_loss_only(logits: torch.Tensor) -> bool:
    """Whether autograd holds ``logits`` for no node but the one consuming them: they come,
    through views only, from a node whose backward does not read its output (megatron's
    output layer, a mask, a copy). Then :func:`packed_logprobs` may write the gradient over
    them (``grad_in_logits``). Unknown producers answer False."""
    fn = logits.grad_fn
    while fn is not None and type(fn).__name__ in _PASS_THROUGH_NODES:
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__ in _OUTPUT_UNREAD_NODES


class _PackedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, labels, temperature, tp_group, chunk_size, return_entropy, grad_in_logits
    ):
        rank, _ = _tp_info(tp_group)
        vocab_start = rank * logits.shape[1]
        stats = local_stats(
            logits,
            labels,
            vocab_start=vocab_start,
            temperature=temperature,
            with_entropy=return_entropy,
            chunk_size=chunk_size,
        )
        m, s, xlab, u = global_stats(*stats, tp_group)
        lp, ent, lse, ex = finalize(m, s, xlab, u, labels)
        ctx.temperature = temperature
        ctx.vocab_start = vocab_start
        ctx.chunk_size = chunk_size
        ctx.return_entropy = return_entropy
        ctx.grad_in_logits = grad_in_logits
        if return_entropy:
            ctx.save_for_backward(logits, labels, lse, ex)
        else:
            ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(labels)
        if ent is None:
            ent = torch.zeros(0, dtype=lp.dtype, device=logits.device)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        if ctx.return_entropy:
            logits, labels, lse, ex = ctx.saved_tensors
        else:
            (logits, labels, lse), ex = ctx.saved_tensors, None
            grad_ent = None
        if grad_lp is None:
            grad_lp = torch.zeros_like(lse)
        grad_lp = torch.where(labels < 0, torch.zeros_like(grad_lp), grad_lp.to(lse.dtype))
        if grad_ent is not None:
            grad_ent = grad_ent.to(lse.dtype).contiguous()
        mod = _backend.select(logits.device)
        # on a CPU a fresh [T, V_local] buffer is mapped and faulted in page by page (~0.3 ms
        # per MB); CUDA's caching allocator hands one out for free, its kernel keeps writing anew
        in_place = ctx.grad_in_logits and logits.device.type == "cpu"
        if mod is None:
            grad = logprob_backward_torch(
                logits,
                labels,
                lse,
                grad_lp,
                ex=ex,
                grad_entropy=grad_ent,
                vocab_start=ctx.vocab_start,
                temperature=ctx.temperature,
                chunk_size=ctx.chunk_size,
                out=logits if in_place else None,
            )
        else:
            grad = mod.logprob_backward(
                logits,
                labels,
                int(ctx.vocab_start),
                1.0 / float(ctx.temperature),
                lse,
                grad_lp.contiguous(),
                ex,
                grad_ent,
                **({"in_place": True} if in_place else {}),
            )
        if in_place:
            # a node that saved the logits after all fails loudly in its backward
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None, None, None


def packed_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: Optional[int] = None,
    return_entropy: bool = False,
    grad_in_logits: bool = False,
):
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[T, V_local]`` in any float dtype: this TP rank's vocabulary shard (rank ``r``
            owns global ids ``[r * V_local, (r + 1) * V_local)``, Megatron's layout).
        labels: ``[T]`` integer global token ids; a negative label (padding) gives logprob 0
            and no gradient through the logprob.
        temperature: sampling temperature (> 0).
        tp_group: tensor-parallel process group, or ``None`` when the vocabulary is whole.
            Only per-token statistics are all-reduced; the result is identical on every rank.
        chunk_size: tokens per chunk for the pure-torch backend (bounds its float32
            temporaries to ``chunk_size x V_local``); the native kernels stream and ignore it.
        return_entropy: also return the entropy of ``softmax(logits / temperature)``.
        grad_in_logits: on a CPU, write the gradient over ``logits`` instead of a new
            ``[T, V_local]`` tensor: no buffer to fault in, one less of that size at the peak.
            Only where nothing else reads ``logits`` after the forward
            (:func:`logits_read_by_loss_only`); their version is bumped, so a node that
            saved them fails in its backward instead of reading the gradient.

    Returns:
        ``logprobs`` float32 ``[T]`` (float64 for float64 logits, e.g. for gradcheck), or
        ``(logprobs, entropy)``; differentiable w.r.t. ``logits``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be [T]={logits.shape[0]}, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[1] == 0:
        raise ValueError("logits has an empty vocabulary dimension")
    labels = labels.to(device=logits.device, dtype=torch.long)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lp, ent = _PackedLogprobs.apply(
        logits,
        labels,
        float(temperature),
        tp_group,
        chunk_size,
        bool(return_entropy),
        bool(grad_in_logits),
    )
    return (lp, ent) if return_entropy else lp
