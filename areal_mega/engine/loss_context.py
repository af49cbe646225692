"""The data side of the engine's loss contract: what a loss function receives, and how the
engine turns its numerators and statistics into the step's loss and stats.

On the last pipeline stage the engine calls ``loss_fn(logprobs, entropy, mb)`` with ``mb`` =
:func:`loss_view` of the packed micro-batch:

* every tensor is on the compute device (``logprobs.device``), except the segment layout
  ``cu_seqlens`` / ``cu_seqlens_padded``: int tensors kept on the host, since segment sums only
  do index arithmetic with them (no device synchronisation);
* ``cu_seqlens`` and ``cu_seqlens_padded`` are both the *slot* layout of the tokens the loss
  sees: slot ``b`` is ``[cu_seqlens[b], cu_seqlens[b+1])`` and holds sequence ``b`` followed by
  its per-slot (context-parallel) padding, whose ``loss_mask`` is 0;
* with context parallelism (CP > 1) every per-token tensor is cut to this rank's zigzag share
  (the same index the model input was cut with), and the layout is the share's own: rank r
  keeps chunks r and 2·CP−1−r of every slot, contiguous, so slot b occupies
  ``cu_seqlens_padded[b] / CP ..`` of the share (:func:`~areal_mega.engine.packed.shard_bounds`);
* ``mb["cp_shard"]`` is a :class:`CPShard` (None without CP): a per-token sum is additive over
  the CP ranks (the engine adds numerators and stats over DP × CP), but a per-sequence quantity
  (a sequence's mean log-ratio, its loss-token count) must add every rank's partial sum with
  ``cp_shard.sum`` — differentiable — and be reported by one rank only (``cp_shard.owner``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from areal_mega.algo.packing import PER_SEQUENCE_KEYS
from areal_mega.engine.packed import shard_bounds

__all__ = [
    "CPShard",
    "loss_view",
    "compute_loss",
    "global_denominator",
    "reduce_stats",
    "LAYOUT_KEYS",
]

#: Keys that stay on the host: the segment layout of the tokens the loss sees.
LAYOUT_KEYS = ("cu_seqlens", "cu_seqlens_padded")


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is again an all-reduce (sum) of the incoming gradients:
    the total loss is Σ_r L_r, so each rank's input gets Σ_r ∂L_r/∂(sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CPShard:
    """One context-parallel rank's place in its CP group, for sequence-level loss terms.

    Args:
        group: the CP process group (``mesh.cp_group``).
        size: CP size.
        rank: this rank's index in the CP group.
    """

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, int(size), int(rank)

    @property
    def owner(self) -> bool:
        """Whether this rank reports per-sequence statistics (exactly one rank per group)."""
        return self.rank == 0

    def sum(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Per-sequence partial sums [B] added over the CP ranks (differentiable; collective:
        every rank of the group must call it, in the same order)."""
        return _SumOverGroup.apply(per_seq, self.group)


def loss_view(
    mb: dict,
    device: torch.device,
    index: Optional[torch.Tensor] = None,
    shard: Optional[CPShard] = None,
) -> dict:
    """The micro-batch as the loss function sees it (see the module docstring).

    ``index``: this CP rank's token indices (None without CP); ``shard``: its :class:`CPShard`.
    Per-token tensors are those whose leading dimension is the packed length T (known
    per-sequence fields excepted)."""
    total = int(torch.as_tensor(mb["input_ids"]).numel())
    bounds = torch.as_tensor(mb.get("cu_seqlens_padded", mb["cu_seqlens"])).long().cpu()
    if index is not None:
        bounds = torch.tensor(shard_bounds(bounds.tolist(), shard.size), dtype=torch.long)
        index = index.cpu()
    out = {}
    for k, v in mb.items():
        # routes and images are model input, not loss input
        if k in LAYOUT_KEYS or k in ("routed_experts", "pixel_values", "image_grid_thw"):
            continue
        if isinstance(v, torch.Tensor):
            if (
                index is not None
                and v.dim() >= 1
                and v.shape[0] == total
                and k not in PER_SEQUENCE_KEYS
            ):
                v = v.index_select(0, index.to(v.device))
            v = v.to(device, non_blocking=True)
        out[k] = v
    out["cu_seqlens"] = bounds.to(torch.int32)
    out["cu_seqlens_padded"] = out["cu_seqlens"]
    out["cp_shard"] = shard
    return out


def compute_loss(
    loss_fn: Callable,
    logprobs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    mb: dict,
    *,
    denominator: torch.Tensor,
    valid: torch.Tensor,
    index: Optional[torch.Tensor] = None,
    shard: Optional[CPShard] = None,
):
    """One micro-batch's ``(loss, n_tokens, stats)`` for megatron's schedule.

    Calls ``loss_fn(logprobs, entropy, loss_view(mb, logprobs.device, index, shard))``;
    ``loss = numerator / denominator`` (the global denominator); stats are detached fp32
    scalars plus ``loss``. ``valid``: this rank's tokens that have a next-token label."""
    numerator, stats = loss_fn(logprobs, entropy, loss_view(mb, logprobs.device, index, shard))
    loss = numerator / denominator
    n_tok = valid.sum().to(torch.int)
    reduced = {k: torch.as_tensor(v).detach().float().reshape(()) for k, v in (stats or {}).items()}
    reduced["loss"] = loss.detach().float().reshape(())
    return loss, n_tok, reduced


def global_denominator(
    micro_batches: Sequence[dict], denominator_fn: Callable, mesh
) -> torch.Tensor:
    """Σ over micro-batches and DP ranks of ``denominator_fn(mb)`` on the full (not CP-split)
    micro-batches (fp32 scalar on ``mesh.device``; CP ranks all hold the same value)."""
    local = sum(
        (torch.as_tensor(denominator_fn(mb), dtype=torch.float64) for mb in micro_batches),
        torch.zeros((), dtype=torch.float64),
    )
    t = local.reshape(1).to(mesh.device)
    if mesh.dims.dp > 1:
        dist.all_reduce(t, group=mesh.dp_group)
    return t.reshape(()).float()


def reduce_stats(records: list, mesh) -> dict:
    """Sum the per-micro-batch stats of the last stage over micro-batches and DP × CP ranks
    (CP ranks hold partial sums), then hand them to every pipeline stage."""
    keys = None
    vec = None
    if mesh.is_last_stage:
        keys = sorted({k for r in records for k in r})
        vec = torch.zeros(len(keys), dtype=torch.float64)
        for r in records:
            for i, k in enumerate(keys):
                if k in r:
                    vec[i] += float(r[k])
        vec = vec.to(mesh.device)
        if mesh.dims.dp * mesh.dims.cp > 1:
            dist.all_reduce(vec, group=mesh.dp_cp_group)
    if mesh.dims.pp > 1:
        holder = [keys, None if vec is None else vec.cpu().tolist()]
        dist.broadcast_object_list(holder, src=mesh.last_stage_global_rank(), group=mesh.pp_group)
        keys, values = holder
    else:
        values = vec.cpu().tolist()
    return dict(zip(keys, values))
