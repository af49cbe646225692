"""Per-row LoRA in the rollout engine's forwards: ``y = W x + scaling * B A x`` for the rows
whose request names an adapter, the plain ``W x`` for the others, in one batched forward.

:class:`LoraLayers` knows every served linear whose name ends in an enabled target
(``--lora-target-modules``); the engine tells it, before each forward, which adapter each batch
row uses (:meth:`LoraLayers.set_rows`). While some row uses an adapter, each of those linears
has a forward hook adding ``scaling * (x A^T) B^T`` to the output rows of that adapter (PEFT's
``lora_B(lora_A(x)) * scaling``); the fused q/k/v and gate/up matmuls of
:mod:`~areal_mega.inference.kv_cache` honour these hooks
(:func:`~areal_mega.inference.cpu_linear.fused_linear`). A forward whose rows all run the base
model has no hooks installed: it is exactly the model's own (prepacked, fused) forward. Hooks
and rows are used on the engine thread only.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

__all__ = ["LoraLayers", "take_admissible"]


class LoraLayers:
    """The LoRA hooks of one model and the adapters of the current forward's rows."""

    def __init__(self, model: torch.nn.Module, targets: tuple, max_per_batch: Optional[int] = None):
        """Hook the ``nn.Linear`` modules of ``model`` whose last name is in ``targets``
        (MoE expert projections and a vision tower's layers excepted: their rows are tokens
        routed together or image patches, not requests; a vision-language model's adapters
        are on its language model). ``max_per_batch``: the engine's
        ``--max-loras-per-batch``."""
        self.max_per_batch = max_per_batch
        self.modules: dict = {}
        self._groups: Optional[list] = None  # [(adapter, row index tensor)] or None
        self._handles: list = []  # the hooks, installed while rows use adapters
        self._rows = 0
        for name, mod in model.named_modules():
            if (
                isinstance(mod, torch.nn.Linear)
                and name.split(".")[-1] in targets
                and ".experts." not in f".{name}."
                and ".visual." not in f".{name}."
            ):
                self.modules[name] = mod

    def set_rows(self, adapters: list) -> None:
        """The adapter (or None) of each row of the next forward, in batch order. The hooks
        are installed while some row has an adapter and removed otherwise, so a base-only
        forward is exactly the model's own."""
        groups: dict = {}
        for i, a in enumerate(adapters):
            if a is not None:
                groups.setdefault(id(a), (a, []))[1].append(i)
        self._groups = [(a, torch.tensor(rows)) for a, rows in groups.values()] or None
        self._rows = len(adapters)
        if self._groups is not None and not self._handles:
            self._handles = [
                mod.register_forward_hook(self._hook_of(name)) for name, mod in self.modules.items()
            ]
        elif self._groups is None and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _hook_of(self, name: str):
        def hook(_mod, args, out):
            groups = self._groups
            if groups is None:
                return None
            x = args[0]
            if x.shape[0] != self._rows:  # e.g. a layer fed tokens flattened across rows
                raise RuntimeError(
                    f"LoRA on {name}: its input has {x.shape[0]} rows, the "
                    f"batch {self._rows} requests"
                )
            out = out.clone()
            for adapter, rows in groups:
                ab = adapter.weights.get(name)
                if ab is None:
                    continue
                a, b = ab
                delta = (x.index_select(0, rows) @ a.T) @ b.T
                out.index_add_(0, rows, delta, alpha=adapter.scaling)
            return out

        return hook


def take_admissible(waiting: deque, room: int, running: list, limit: Optional[int]) -> list:
    """Take up to ``room`` requests off ``waiting`` in order, skipping (and keeping queued)
    any whose adapter would bring the distinct adapters of ``running`` plus those taken
    (the base model counting as one, as in SGLang's LoRA memory pool) above ``limit``
    (``--max-loras-per-batch``; None: no limit)."""
    taken: list = []
    if limit is None:
        while waiting and room > 0:
            taken.append(waiting.popleft())
            room -= 1
        return taken
    used = {id(getattr(r, "lora", None)) for r in running}
    skipped: list = []
    while waiting and room > 0:
        r = waiting.popleft()
        key = id(getattr(r, "lora", None))
        if key in used or len(used) < limit:
            used.add(key)
            taken.append(r)
            room -= 1
        else:
            skipped.append(r)
    waiting.extendleft(reversed(skipped))
    return taken
