"""Micro-batch scheduling (pure planning on sequence lengths) and packing into flat tensors.

- :mod:`.planner` — micro-batches balanced over DP ranks under a token budget (pure, no torch);
- :mod:`.shared_prefix` — a GRPO group's prompt computed once per micro-batch: layout and plan
  (pure);
- :mod:`.packing` — variable-length sequences packed into one THD batch, and the CP split.

``pack_sequences`` / ``zigzag_cp_shard`` are imported lazily so that importing the planner
does not import torch.
"""

from areal_mega.scheduler.planner import (
    PlanError,
    first_fit_decreasing,
    karmarkar_karp,
    plan_micro_batches,
    plan_stats,
    sequence_costs,
)

__all__ = [
    "PlanError",
    "first_fit_decreasing",
    "karmarkar_karp",
    "plan_micro_batches",
    "plan_stats",
    "sequence_costs",
    "pack_sequences",  # noqa: F822 (these three: the module __getattr__, packing needs torch)
    "zigzag_cp_shard",  # noqa: F822
    "PackingError",  # noqa: F822
]


def __getattr__(name):
    if name in ("pack_sequences", "zigzag_cp_shard", "PackingError"):
        from areal_mega.scheduler import packing

        return getattr(packing, name)
    raise AttributeError(f"module 'areal_mega.scheduler' has no attribute {name!r}")
