"""The model inputs of one packed micro-batch (the engine's ``_prepare``).

Besides the tokens, positions, next-token labels and THD ``PackedSeqParams`` (per rank of a
context-parallel group), a micro-batch whose samples share prompts is *compressed*
(:mod:`areal_mega.scheduler.shared_prefix`): the model runs on ``input_ids`` with each shared
prompt once, and ``expand`` maps every packed token to its row there. ``labels`` / ``valid``
stay in the packed layout (what the loss reads); ``model_labels`` are the labels of the model's
rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from areal_mega.engine.packed import (
    cp_token_index,
    micro_batch_labels,
    segment_ids_from_cu,
    slot_offsets,
)
from areal_mega.engine.packed_params import packed_seq_kwargs
from areal_mega.scheduler.shared_prefix import plan_shared_prefix

__all__ = ["prepare_micro_batch", "model_rows"]


def prepare_micro_batch(
    mb: dict, mesh, *, use_te: bool, replay=None, share_prefix: bool = False
) -> dict:
    """Model inputs for one packed micro-batch (``input_ids`` [1, T'], ``position_ids``,
    ``packed_seq_params``, ``labels`` / ``valid`` [T], ``model_labels`` [T'], ``index``: this CP
    rank's tokens or None, ``expand``: [T] rows of the shared-prefix layout or None,
    ``n_total`` T). ``share_prefix``: compress shared prompts (no CP, no SP, no routing
    replay: the caller checks)."""
    ids = torch.as_tensor(mb["input_ids"]).long().reshape(-1)
    total = ids.shape[0]
    tp = mesh.dims.tp
    if mesh.sequence_parallel and total % tp:
        raise ValueError(
            f"packed length {total} must be a multiple of TP={tp} with "
            "sequence parallelism (pack with pad_to_multiple=TP)"
        )
    pos = torch.as_tensor(mb["position_ids"]).long().reshape(-1) if "position_ids" in mb else None
    starts, lens = slot_offsets(mb)
    labels = micro_batch_labels(mb, total)
    valid = labels >= 0
    bounds = torch.as_tensor(mb.get("cu_seqlens_padded", mb["cu_seqlens"])).long()
    if pos is None:
        seg0 = segment_ids_from_cu(total, starts, lens, bounds[1:])
        pos = torch.arange(total) - torch.cat([bounds, torch.tensor([total])])[seg0]
    batch: dict[str, Any] = {
        "n_total": total,
        "labels": labels,
        "valid": valid,
        "index": None,
        "expand": None,
    }
    cp = mesh.dims.cp
    dev = mesh.device
    if cp > 1 and not use_te:
        raise RuntimeError("context parallelism needs TransformerEngine (GPU)")
    from megatron.core.packed_seq_params import PackedSeqParams

    layout = None
    if share_prefix and mb.get("loss_mask") is not None:
        mask = torch.as_tensor(mb["loss_mask"]).reshape(-1).tolist()
        layout = plan_shared_prefix(ids.tolist(), labels.tolist(), bounds.tolist(), mask)
    if layout is not None:
        from areal_mega.models.varlen_attention import SharedPrefixSeqParams

        keep = torch.tensor(layout.keep)
        batch["expand"] = torch.tensor(layout.expand).to(dev)
        cu = [u[0] for u in layout.units] + [len(layout.keep)]
        batch["packed_seq_params"] = SharedPrefixSeqParams(
            units=layout.units, **packed_seq_kwargs(cu, None, len(layout.keep), device=dev)
        )
        ids, pos, model_labels = ids[keep], pos[keep], labels[keep]
    else:
        # THD packed attention: TE's, or the local spec's per-sequence SDPA
        # (models/varlen_attention.py); padded offsets only where sequences are padded (CP):
        # see engine/packed_params.py
        batch["packed_seq_params"] = PackedSeqParams(
            **packed_seq_kwargs(mb["cu_seqlens"], bounds, total, cp=cp, device=dev)
        )
        model_labels = labels
    batch["attention_mask"] = None
    if cp > 1:
        idx = cp_token_index(mb, cp, mesh.cp_rank)
        batch["index"] = idx
        ids, pos = ids[idx], pos[idx]
        batch["labels"], batch["valid"] = batch["labels"][idx], valid[idx]
        model_labels = batch["labels"]
    if replay is not None:
        batch["routes"] = replay.local_routes(mb, batch["index"])
    batch["input_ids"] = ids[None].to(dev)
    batch["position_ids"] = pos[None].to(dev)
    batch["labels"] = batch["labels"].to(dev)
    batch["model_labels"] = model_labels.to(dev)
    batch["valid"] = batch["valid"].to(dev)
    return batch


def model_rows(batch: dict, rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The model's rows of packed token ``rows`` (the same ones unless shared prefixes were
    compressed; loss rows are never shared, so they map one to one)."""
    if rows is None or batch.get("expand") is None:
        return rows
    return batch["expand"].index_select(0, rows)
