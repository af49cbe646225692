"""What one forward of a Gemma 4 model chunk shares between its modules outside their inputs:
the per-layer inputs (``[s, b, layers, size]``, this rank's sequence shard) and the keys /
values the source layers computed, by layer type (:mod:`areal_mega.models.gemma4`).

Without full activation recompute the layers read them directly and autograd sees the reads.
With it (``relayed``) megatron re-runs the layers in backward, outside the graph that made what
they read, so:

* every read goes through the forward's :class:`~areal_mega.models.gradient_relay.GradientRelay`
  (:meth:`Gemma4ForwardState.read`) and every maker hands the gradients on
  (:meth:`Gemma4ForwardState.deliver`): a source layer's query, the embedding's output, a
  pipeline stage's received hidden state;
* each forward's tensors and relay are one :class:`ForwardRecord`, and the chunk's output
  passes an identity whose backward makes its record the active one again
  (:meth:`Gemma4ForwardState.resume_in_backward`): backward reaches it before it re-runs any
  layer, so a recomputed layer reads its own micro-batch's record even when the pipeline
  schedule ran later micro-batches' forwards in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from areal_mega.models.gradient_relay import GradientRelay

__all__ = ["PER_LAYER_INPUT", "PER_LAYER_INPUTS", "ForwardRecord", "Gemma4ForwardState"]

#: relay key of one layer's per-layer input (with the layer's 0-based index)
PER_LAYER_INPUT = "per_layer_input"
#: relay key of all the per-layer inputs (what a pipeline stage sends on)
PER_LAYER_INPUTS = ("per_layer_inputs",)


@dataclass
class ForwardRecord:
    """One forward's shared tensors and, under recompute, its relay."""

    relay: Optional[GradientRelay] = None
    per_layer_inputs: Optional[torch.Tensor] = None
    kv: dict = field(default_factory=dict)


class Gemma4ForwardState:
    """The chunk's active :class:`ForwardRecord` (see the module): :meth:`begin` starts one
    at each forward of the model; without recompute :meth:`begin` again after the decoder's
    forward drops it (autograd keeps what backward needs)."""

    def __init__(self, relayed: bool = False):
        self.relayed = relayed
        self.begin()

    def begin(self) -> None:
        """Start a new record (a new relay under recompute)."""
        self.active = ForwardRecord(relay=GradientRelay() if self.relayed else None)

    @property
    def kv(self) -> dict:
        """Layer type -> (keys, values) of its source layer, this forward's."""
        return self.active.kv

    @property
    def per_layer_inputs(self) -> Optional[torch.Tensor]:
        """This forward's per-layer inputs (None before they are made or received)."""
        return self.active.per_layer_inputs

    @per_layer_inputs.setter
    def per_layer_inputs(self, value: Optional[torch.Tensor]) -> None:
        self.active.per_layer_inputs = value

    def read(self, key, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a reader takes it: itself, or under recompute through the relay."""
        relay = self.active.relay
        return tensor if relay is None else relay.receive(key, tensor)

    def deliver(
        self, carrier: torch.Tensor, kv_kinds: Iterable[str] = (), per_layer_inputs: bool = False
    ) -> torch.Tensor:
        """``carrier``; under recompute the relay's carrier (one that backward reaches after
        every reader) of the gradients of this record's keys / values of ``kv_kinds`` and, with
        ``per_layer_inputs``, of its per-layer inputs, layer by layer and whole."""
        relay = self.active.relay
        if relay is None:
            return carrier
        made = {}
        for kind in kv_kinds:
            key, value = self.active.kv[kind]
            made[(kind, "key")], made[(kind, "value")] = key, value
        if per_layer_inputs:
            inputs = self.active.per_layer_inputs
            made.update({(PER_LAYER_INPUT, i): x for i, x in enumerate(inputs.unbind(2))})
            made[PER_LAYER_INPUTS] = inputs
        return relay.deliver(carrier, made)

    def resume_in_backward(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` (the chunk's); under recompute, when backward reaches it, this forward's
        record becomes the active one again."""
        if not self.relayed or not torch.is_grad_enabled():
            return output
        return _Resume.apply(self, self.active, output)


class _Resume(torch.autograd.Function):
    """Identity; backward makes a forward's record the state's active one."""

    @staticmethod
    def forward(ctx, state: Gemma4ForwardState, record: ForwardRecord, output):
        ctx.state, ctx.record = state, record
        return output.clone()  # not a view: megatron frees a stage's sent output's storage

    @staticmethod
    def backward(ctx, grad):
        ctx.state.active = ctx.record
        return None, None, grad
