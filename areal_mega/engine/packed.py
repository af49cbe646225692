"""Pure helpers for packed micro-batches (no torch.distributed): the labels check, the
block-diagonal causal mask (the dense reference of the packed attention), and the zigzag
context-parallel split and its inverse.

Packed layout (from :func:`areal_mega.scheduler.packing.pack_sequences`): sequence ``b`` lives at
``[cu_seqlens_padded[b], cu_seqlens_padded[b] + L_b)`` with ``L_b = cu_seqlens[b+1] -
cu_seqlens[b]``; without context parallelism ``cu_seqlens_padded == cu_seqlens``. Tokens beyond
``cu_seqlens_padded[-1]`` are trailing padding.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from areal_mega.scheduler.packing import zigzag_index  # noqa: F401 (re-exported)
from areal_mega.scheduler.packing import zigzag_shard_bounds as shard_bounds  # noqa: F401

__all__ = [
    "slot_offsets",
    "micro_batch_labels",
    "segment_ids_from_cu",
    "block_causal_mask",
    "zigzag_index",
    "zigzag_split",
    "zigzag_merge",
    "shard_bounds",
    "cp_token_index",
]


def slot_offsets(mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts [B], lengths [B]) of the real tokens of each sequence in a packed batch."""
    cu = torch.as_tensor(mb["cu_seqlens"]).long()
    lens = cu[1:] - cu[:-1]
    starts = torch.as_tensor(mb.get("cu_seqlens_padded", cu)).long()[:-1]
    return starts, lens


def micro_batch_labels(mb: dict, total: int) -> torch.Tensor:
    """The micro-batch's ``labels`` [T] as int64 (the next token of each position's sequence,
    -1 where there is none), checked. Labels are made once, with the data
    (``train.batches.next_token_layout``); the engine never shifts tokens itself."""
    if "labels" not in mb:
        raise ValueError(
            "micro-batch has no 'labels' field (the next-token targets): build its "
            "samples with areal_mega.train.batches.next_token_layout"
        )
    labels = torch.as_tensor(mb["labels"])
    if labels.is_floating_point() or labels.dtype == torch.bool or tuple(labels.shape) != (total,):
        raise ValueError(
            f"micro-batch field 'labels' must be integer [{total}] like "
            f"input_ids, got {labels.dtype} {tuple(labels.shape)}"
        )
    return labels.long()


def segment_ids_from_cu(
    total: int, starts: torch.Tensor, lens: torch.Tensor, slot_ends: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Segment id per token: ``b`` inside slot ``b``, ``B`` for trailing padding."""
    b = starts.shape[0]
    seg = torch.full((total,), b, dtype=torch.long)
    ends = slot_ends if slot_ends is not None else starts + lens
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        seg[s:e] = i
    return seg


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [1, 1, T, T], True = masked (megatron convention): token i may
    attend to token j iff j <= i and both are in the same segment. Trailing padding forms its
    own segment so no row is fully masked."""
    t = segment_ids.shape[0]
    same = segment_ids[:, None] == segment_ids[None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril_()
    return (~(same & causal))[None, None]


def zigzag_split(
    x: torch.Tensor, bounds: Sequence[int], cp_size: int, cp_rank: int, dim: int = 0
) -> torch.Tensor:
    """This CP rank's share of a packed per-token tensor (see :func:`zigzag_index`)."""
    idx = zigzag_index(bounds, x.shape[dim], cp_size, cp_rank).to(x.device)
    return x.index_select(dim, idx)


def zigzag_merge(
    shards: Sequence[torch.Tensor], bounds: Sequence[int], total: int, dim: int = 0
) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: reassemble the full tensor from every rank's share
    (``shards[r]`` from rank r, e.g. after an all-gather over the CP group)."""
    cp = len(shards)
    ref = shards[0]
    shape = list(ref.shape)
    shape[dim] = total
    out = ref.new_empty(shape)
    for r, part in enumerate(shards):
        idx = zigzag_index(bounds, total, cp, r).to(part.device)
        out.index_copy_(dim, idx, part)
    return out


def cp_token_index(mb: dict, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices of a packed micro-batch kept by CP rank ``cp_rank``: the engine's split of
    the model inputs, labels and of the micro-batch its loss function sees."""
    bounds = torch.as_tensor(mb.get("cu_seqlens_padded", mb["cu_seqlens"])).tolist()
    total = int(torch.as_tensor(mb["input_ids"]).numel())
    return zigzag_index(bounds, total, cp_size, cp_rank)
