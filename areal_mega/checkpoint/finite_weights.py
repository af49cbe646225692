"""Checkpoints never hold non-finite weights: the check on saving and on loading."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from areal_mega.checkpoint.verify import CheckpointError, gather_all

__all__ = ["NonFiniteWeightsError", "nonfinite_parameters"]


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint's model weights hold NaN/inf: refused when saving (nothing written) and
    when loading; the message names the parameter and the rank."""


def nonfinite_parameters(model: Sequence[torch.nn.Module]) -> Optional[str]:
    """``"parameter <name> (rank r)"`` for the first parameter of ``model``'s chunks that holds
    a NaN/inf on any rank, else None; every rank returns the same. ``model``: bare chunks (no
    DDP wrapper). Collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = None
    for i, c in enumerate(model):
        # a view of a chunk (the critic's trunk for an LM checkpoint) checks the chunk
        c = c if hasattr(c, "named_parameters") else getattr(c, "chunk", None)
        for name, p in c.named_parameters() if c is not None else ():
            if not bool(torch.isfinite(p.detach()).all()):
                mine = (
                    f"parameter {name}"
                    + (f" of chunk {i}" if len(model) > 1 else "")
                    + f" (rank {rank})"
                )
                break
        if mine:
            break
    return next((b for b in gather_all(mine) if b), None)
