"""Micro-batch scheduling (pure planning on sequence lengths) and packing into flat tensors.

``pack_sequences`` / ``zigzag_cp_shard`` are imported lazily so that importing the planner
does not import torch.
"""


def __getattr__(name):
    if name in ("pack_sequences", "zigzag_cp_shard", "PackingError"):
        from areal_mega.scheduler import packing
        return getattr(packing, name)
    raise AttributeError(f"module 'areal_mega.scheduler' has no attribute {name!r}")
