"""Helpers for packed batches: per-token data of B sequences laid end to end.

Conventions (see the design doc): ``cu_seqlens`` int32 [B+1] marks sequence b as tokens
``cu_seqlens[b] : cu_seqlens[b+1]``; tokens past ``cu_seqlens[-1]`` are padding (loss_mask 0).
Per-sequence fields have length B; every other tensor whose first dimension is T is per-token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from areal_mega.dataplane.trajectory import FINISH_REASONS

#: Per-sequence [B] fields of a packed batch (everything else with a leading T is per-token).
PER_SEQUENCE_KEYS = frozenset(
    {
        "rewards",
        "group_index",
        "seq_no_eos",
        "prompt_lens",
        "response_lens",
        "sample_ids",
        "group_ids",
        "bootstrap_values",
        "seqlens",
        "min_versions",
        "finish_codes",
        "shaped_rewards",
        "image_counts",
        "image_data",
    }
)
IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})
"""A packed batch's images (all its sequences' in packed order; ``image_counts`` [B] says how
many each sequence has): model inputs, neither per-token nor per-sequence."""


def token_seq_ids(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """Sequence index of every token: ``ids[t] = b`` for ``cu[b] <= t < cu[b+1]``; padding
    tokens (``t >= cu[-1]``) get ``B``, a spare bucket that callers drop. Returns long [T]."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    n_seqs = lengths.numel()
    n_pad = n_tokens - int(cu[-1])
    if n_pad < 0:
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} exceeds the {n_tokens} packed tokens")
    lengths = torch.cat([lengths, lengths.new_tensor([n_pad])])
    return torch.repeat_interleave(torch.arange(n_seqs + 1, device=cu.device), lengths)


def segment_sum(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``out[b] = sum_{t in seq b} x[t]`` (padding ignored); differentiable. Returns [B]."""
    n_seqs = cu_seqlens.numel() - 1
    ids = token_seq_ids(cu_seqlens, x.shape[0]).to(x.device)
    out = x.new_zeros(n_seqs + 1).index_add(0, ids, x)
    return out[:n_seqs]


def broadcast_to_tokens(
    per_seq: Tensor, cu_seqlens: Tensor, n_tokens: int, pad_value: float = 0.0
) -> Tensor:
    """``out[t] = per_seq[b]`` for every token t of sequence b; padding gets ``pad_value``.
    Differentiable w.r.t. ``per_seq``. Returns [T]."""
    ids = token_seq_ids(cu_seqlens, n_tokens).to(per_seq.device)
    padded = torch.cat([per_seq, per_seq.new_full((1,), pad_value)])
    return padded[ids]


def last_token_index(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Index of the last loss-mask token of every sequence (-1 when it has none). Long [B]."""
    n = loss_mask.shape[0]
    pos = torch.arange(n, device=loss_mask.device)
    masked_pos = torch.where(loss_mask.bool(), pos, torch.full_like(pos, -1))
    ids = token_seq_ids(cu_seqlens, n).to(loss_mask.device)
    out = torch.full((cu_seqlens.numel(),), -1, dtype=torch.long, device=loss_mask.device)
    out = out.scatter_reduce(0, ids, masked_pos, reduce="amax", include_self=True)
    return out[:-1]


def select_sequences(batch: dict, index: Sequence[int] | Tensor) -> dict:
    """A new packed batch holding sequences ``index`` (in that order), without padding.

    Per-token tensors are gathered token by token (so autograd flows through them), per-sequence
    tensors (:data:`PER_SEQUENCE_KEYS`) are indexed, ``cu_seqlens`` and ``max_seqlen`` are
    rebuilt, and anything that is not a tensor is copied as is. Used to split a batch into
    micro-batches and to drop filtered groups.
    """
    cu = batch["cu_seqlens"].to(torch.long)
    n_tokens = batch["loss_mask"].shape[0]
    idx = torch.as_tensor(index, dtype=torch.long, device=cu.device).reshape(-1)
    lengths = (cu[1:] - cu[:-1])[idx]
    starts = cu[:-1][idx]
    new_cu = torch.zeros(idx.numel() + 1, dtype=torch.long, device=cu.device)
    new_cu[1:] = torch.cumsum(lengths, 0)
    # token positions in the old batch, sequence by sequence
    offsets = torch.arange(int(new_cu[-1]), device=cu.device) - torch.repeat_interleave(
        new_cu[:-1], lengths
    )
    tok = torch.repeat_interleave(starts, lengths) + offsets
    cu_padded = batch.get("cu_seqlens_padded")
    if cu_padded is not None and not torch.equal(cu_padded.to(torch.long), cu):
        raise ValueError(
            "select_sequences: per-sequence (context-parallel) slot padding is "
            "not supported; select before CP padding"
        )
    out: dict = {}
    if batch.get("pixel_values") is not None:
        out.update(select_images(batch, idx))
    for key, value in batch.items():
        if key in IMAGE_KEYS:
            continue
        if key in ("cu_seqlens", "cu_seqlens_padded"):
            out[key] = new_cu.to(value.dtype)
        elif key in ("max_seqlen", "max_seqlen_padded"):
            out[key] = int(lengths.max()) if lengths.numel() else 0
        elif key == "segment_ids":  # the scheduler's sequence index per token
            out[key] = token_seq_ids(new_cu, int(new_cu[-1])).to(value.dtype)
        elif key in PER_SEQUENCE_KEYS and isinstance(value, (list, tuple)):
            out[key] = [value[i] for i in idx.tolist()]
        elif not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = value
        elif key in PER_SEQUENCE_KEYS:
            out[key] = value[idx.to(value.device)]
        elif value.shape[0] == n_tokens:
            out[key] = value[tok.to(value.device)]
        else:
            raise ValueError(
                f"select_sequences: field {key!r} has leading dim "
                f"{value.shape[0]}, neither T={n_tokens} nor a per-sequence key"
            )
    return out


def select_images(batch: dict, idx: Tensor) -> dict:
    """``pixel_values`` / ``image_grid_thw`` of sequences ``idx`` (in that order) of a packed
    batch with images (``image_counts`` [B]); ``image_counts`` itself is indexed with the other
    per-sequence fields."""
    counts = batch["image_counts"].to(torch.long).cpu()
    grid = batch["image_grid_thw"]
    patches = grid.to(torch.long).prod(-1).cpu()
    first_image = torch.zeros(counts.numel() + 1, dtype=torch.long)
    first_image[1:] = counts.cumsum(0)
    first_patch = torch.zeros(patches.numel() + 1, dtype=torch.long)
    first_patch[1:] = patches.cumsum(0)
    images, rows = [], []
    for b in idx.cpu().tolist():
        lo, hi = int(first_image[b]), int(first_image[b + 1])
        images.append(torch.arange(lo, hi))
        rows.append(torch.arange(int(first_patch[lo]), int(first_patch[hi])))
    images = torch.cat(images) if images else torch.zeros(0, dtype=torch.long)
    rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    pixels = batch["pixel_values"]
    return {
        "pixel_values": pixels.index_select(0, rows.to(pixels.device)),
        "image_grid_thw": grid.index_select(0, images.to(grid.device)),
    }


def split_micro_batches(batch: dict, n: int) -> list[dict]:
    """Split into ``n`` micro-batches of consecutive whole sequences (as even in count as
    possible). A sequence is never split across micro-batches."""
    n_seqs = batch["cu_seqlens"].numel() - 1
    bounds = [round(i * n_seqs / n) for i in range(n + 1)]
    return [select_sequences(batch, range(bounds[i], bounds[i + 1])) for i in range(n)]


def group_index_of(group_ids: Sequence[str]) -> Tensor:
    """``group_index`` [B] long: the integer index of every sequence's ``group_id`` in order of
    first appearance (a derived field for tensor group statistics, not the id itself)."""
    ids: dict = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in group_ids], dtype=torch.long)


def with_algo_fields(packed: dict) -> dict:
    """Add the algorithm's field names to a batch from ``scheduler.pack_sequences``.

    Only derived fields are added (the packed fields keep the trajectory's names, ``logprobs``
    included): ``group_index`` = int index of the string ``group_ids`` (in order of first
    appearance), ``seq_no_eos`` = finished by ``length`` (``finish_codes``), ``response_lens``
    = ``seqlens − prompt_lens``. Existing keys win; returns a new dict sharing the tensors.
    """
    out = dict(packed)
    if "group_index" not in out and "group_ids" in out:
        out["group_index"] = group_index_of(out["group_ids"])
    if "seq_no_eos" not in out and "finish_codes" in out:
        out["seq_no_eos"] = out["finish_codes"] == FINISH_REASONS.index("length")
    if "response_lens" not in out and "seqlens" in out and "prompt_lens" in out:
        out["response_lens"] = out["seqlens"] - out["prompt_lens"]
    return out
