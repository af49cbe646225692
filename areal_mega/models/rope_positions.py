"""Rotary embeddings at given token positions, for micro-batches whose rows are not laid out
as whole sequences (shared prompt prefixes, :mod:`areal_mega.scheduler.shared_prefix`).

megatron-core's ``GPTModel`` asks its ``RotaryEmbedding`` for the table of positions
``0 .. max_seqlen - 1`` and its THD rotation restarts every packed sequence at position 0. Its
rotation also accepts a table with one row per packed token (``freqs.size(0) ==
cu_seqlens[-1]``, megatron-core >= 0.19: ``_apply_rotary_pos_emb_thd``'s exact mapping, made for
multimodal positions), which it applies row by row. :func:`rope_at_positions` makes the
model's rotary module return that table, the rows of the given positions, for one forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["gpt_module", "positions_supported", "rope_at_positions"]


def gpt_module(chunk):
    """The ``GPTModel`` inside a (DDP-, Float16-) wrapped model chunk."""
    m = chunk
    while hasattr(m, "module"):
        m = m.module
    return m


def positions_supported(chunk) -> bool:
    """Whether :func:`rope_at_positions` (or the position ids themselves) place every token:
    plain RoPE (not YaRN, multimodal, Gemma 3's dual tables, nor multi-latent attention),
    learned absolute positions, or none."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    gpt = gpt_module(chunk)
    kind = getattr(gpt, "position_embedding_type", None)
    if kind in ("learned_absolute", "none"):
        return True
    return (
        kind == "rope"
        and type(getattr(gpt, "rotary_pos_emb", None)) is RotaryEmbedding
        and not gpt.config.multi_latent_attention
    )


@contextmanager
def rope_at_positions(chunk, positions: torch.Tensor) -> Iterator[None]:
    """Within the block, the chunk's rotary module returns the rows ``positions`` [T] of its
    table (one per packed token) whatever length it is asked for."""
    rope = getattr(gpt_module(chunk), "rotary_pos_emb", None)
    if rope is None:
        yield
        return
    table_len = int(positions.max()) + 1 if positions.numel() else 1
    cls_forward = type(rope).forward

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        return cls_forward(rope, table_len, offset, packed_seq, cp_group).index_select(0, positions)

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward
