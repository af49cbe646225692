"""Engine checkpoint glue: model state through megatron dist_checkpointing (reshardable).

This is the engine's minimal, honest save/load of *model* weights (any TP/PP/EP layout can load
what any other saved). Optimizer, LR-scheduler and RNG state, atomic publishing with
retention, and HF export belong to :mod:`areal_mega.checkpoint` (the conversion/checkpoint
work); when that module provides ``save_engine(engine, directory, extra)`` /
``load_engine(engine, directory)``, :meth:`MegatronEngine.save` / ``load`` delegate to it.

Layout written here: ``<dir>/model/`` (dist_checkpointing), ``<dir>/extra.json`` (rank 0).
Saving writes to ``<dir>.tmp`` and renames on success, so a crash never leaves a directory
that looks complete.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch.distributed as dist

__all__ = ["save", "load", "save_model", "load_model"]


def _delegate(name: str):
    try:
        import areal_mega.checkpoint as ckpt
    except ImportError:  # pragma: no cover
        return None
    return getattr(ckpt, name, None)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_model(engine, directory: str) -> None:
    """Save the model's sharded state dict into ``directory`` (created; must not exist)."""
    from megatron.core import dist_checkpointing
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(engine.sharded_state_dict(), directory)


def load_model(engine, directory: str) -> None:
    """Load model weights saved by :func:`save_model` from any parallel layout."""
    from megatron.core import dist_checkpointing
    sd = dist_checkpointing.load(engine.sharded_state_dict(), directory)
    for i, chunk in enumerate(engine.model_chunks()):
        key = "model" if len(engine.model) == 1 else f"model{i}"
        chunk.load_state_dict(sd[key], strict=True)


def save(engine, directory: str, extra: Optional[dict] = None) -> None:
    """Save ``engine`` to ``directory`` (atomic rename); see module docstring."""
    fn = _delegate("save_engine")
    if fn is not None:
        return fn(engine, directory, extra)
    directory = os.path.abspath(directory)
    tmp = directory + ".tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier()
    save_model(engine, os.path.join(tmp, "model"))
    _barrier()
    if rank0:
        with open(os.path.join(tmp, "extra.json"), "w") as f:
            json.dump({"extra": extra or {}, "step": engine.step_count}, f)
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    _barrier()


def load(engine, directory: str) -> Optional[dict]:
    """Load ``engine`` weights from ``directory``; returns the saved ``extra`` dict."""
    fn = _delegate("load_engine")
    if fn is not None:
        return fn(engine, directory)
    load_model(engine, os.path.join(directory, "model"))
    path = os.path.join(directory, "extra.json")
    if os.path.exists(path):
        with open(path) as f:
            meta = json.load(f)
        engine.step_count = int(meta.get("step", 0))
        return meta.get("extra")
    return None
