"""A tensor one module makes and a later module of the same forward reads, with the reader's
gradient carried back to the maker outside the autograd path between them.

megatron's full activation recompute runs each chunk of layers without autograd and runs it
again in backward from the chunk's saved inputs (a reentrant checkpoint: the chunk's own
backward is a nested ``torch.autograd.backward``). A tensor a layer reads from elsewhere than
its inputs, the keys / values an earlier layer made or the per-layer inputs the embedding made,
is then a tensor without history when the chunk first runs, and when it is recomputed the
path back to its maker belongs to another graph (the outer one, or another chunk's). So its
gradient would be lost.

The relay cuts that path on purpose and carries the gradient across by hand:

* the reader takes :meth:`GradientRelay.receive`: the values as a leaf of its own graph, whose
  gradient, once backward has computed it, is added to the relay's mailbox under a key;
* the maker passes a tensor of its own graph through :meth:`GradientRelay.deliver`, one that
  backward reaches only after every reader's backward (the maker's query, the embedding's
  output): unchanged in forward, in backward it hands the mailbox's gradients to the made
  tensors, which then flow on through the maker's graph.

A reader must come after its maker in the forward, so that backward reaches the reader first;
:meth:`deliver`'s backward raises ``RuntimeError`` naming the key if a reader's gradient has
not arrived. Without autograd (an inference forward, a checkpoint's first run) the relay only
passes the values on.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable, Mapping

import torch

__all__ = ["GradientRelay"]


class GradientRelay:
    """The mailbox of one forward: gradients of relayed tensors by key (see the module)."""

    def __init__(self):
        self._grads: dict = {}
        self._pending: dict = {}

    def receive(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values detached from the graph that made them; under autograd a leaf
        whose gradient goes to the mailbox under ``key`` (summed over readers) instead of its
        ``.grad``."""
        leaf = tensor.detach()
        if not torch.is_grad_enabled():
            return leaf
        leaf.requires_grad_()
        self._pending[key] = self._pending.get(key, 0) + 1
        leaf.register_post_accumulate_grad_hook(functools.partial(self._keep, key))
        return leaf

    def deliver(self, carrier: torch.Tensor, made: Mapping[Hashable, torch.Tensor]):
        """``carrier`` unchanged; in backward, when the carrier's gradient is reached, each
        tensor of ``made`` receives the gradient its readers left under its key (none if it
        was not read)."""
        if not torch.is_grad_enabled():
            return carrier
        return _Deliver.apply(self, tuple(made), carrier, *made.values())

    def _keep(self, key: Hashable, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        have = self._grads.get(key)
        self._grads[key] = grad if have is None else have + grad
        self._pending[key] -= 1

    def _take(self, key: Hashable):
        waiting = self._pending.get(key, 0)
        if waiting:
            raise RuntimeError(
                f"gradient relay: {waiting} reader(s) of {key!r} had not run backward when its "
                "maker's did (a reader must come after its maker in the forward)"
            )
        return self._grads.pop(key, None)


class _Deliver(torch.autograd.Function):
    """Identity on the carrier; backward adds the relayed gradients of the made tensors."""

    @staticmethod
    def forward(ctx, relay: GradientRelay, keys: tuple, carrier, *made):
        ctx.relay, ctx.keys = relay, keys
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad) -> tuple[Any, ...]:
        relayed = [ctx.relay._take(key) for key in ctx.keys]
        needed = ctx.needs_input_grad[3:]
        return (None, None, grad, *(g if n else None for g, n in zip(relayed, needed)))
