"""The one extra megatron-core CPU patch checkpoints need, in the style of
:mod:`areal_mega.compat.megatron_cpu` (to be folded into its patch list by its owner).

``dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors`` calls
``torch.cuda.synchronize()`` after staging tensors to host memory; on CPU-only torch that
raises "Torch not compiled with CUDA enabled". ``state_dict_saver`` all-reduces a failure flag
on ``torch.cuda.current_device()``. The patches give those two modules the CPU view of
``torch`` (no-op synchronize, ``current_device()`` = cpu); nothing else changes.
"""
from __future__ import annotations

import torch

_DONE = False


def apply() -> None:
    """Apply the engine's CPU patches and the dist-checkpoint writer patch (idempotent)."""
    global _DONE
    if _DONE or torch.cuda.is_available():
        return
    from areal_mega.compat import megatron_cpu
    megatron_cpu.apply()
    base = "megatron.core.dist_checkpointing.strategies."
    patches = [
        megatron_cpu.Patch("torch_view:filesystem_async", base + "filesystem_async",
                           "torch_view", expect=("torch.cuda.synchronize()",),
                           why="FileSystemWriterAsync.preload_tensors synchronizes CUDA"),
        megatron_cpu.Patch("torch_view:state_dict_saver", base + "state_dict_saver",
                           "torch_view", expect=("device=torch.cuda.current_device()",),
                           why="save finalize all-reduces a flag on the CUDA device"),
    ]
    have = {p.module for p in megatron_cpu.PATCHES}
    patches = [p for p in patches if p.module not in have]  # already in the engine's list
    probs = megatron_cpu.check_targets(patches) if patches else []
    if probs:
        raise megatron_cpu.CompatError("\n".join(probs))
    for p in patches:
        p.apply()
    _DONE = True
