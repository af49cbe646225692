"""What Gemma 4's pipeline stages pass each other besides the hidden state: the keys / values
a later stage's key/value-shared layers read and the per-layer inputs the first stage made
(:mod:`areal_mega.models.gemma4`).

megatron's pipeline schedules send one tensor from a model chunk to the next, the hidden state
``[s, b, hidden]``, and with ``variable_seq_lengths`` its shape goes first. So a chunk that
does not end the model appends what is in flight after its last layer on the last dimension
(:func:`send`), and a chunk that does not start it splits its received input back
(:func:`receive`): the hidden state goes to the decoder, the rest to the chunk's
:class:`~areal_mega.models.gemma4_forward_state.Gemma4ForwardState`. Both sides read the list
of what is in flight from the config (:func:`in_flight`), so they agree without a header. The
gradients take the same way back: megatron returns the gradient of the whole received tensor,
and the slices are ordinary autograd views of it (under full recompute the stage's readers
and the receive meet through the forward's gradient relay, as the layers do).

A tensor rides as ``[s, b, channels]`` for the stage's ``s`` tokens: the per-layer inputs are
sequence-sharded like the hidden state, the keys / values hold every token of this rank's KV
heads, so under sequence parallelism each token row carries ``tp`` tokens' worth of them (the
row-major order of ``[tp * s, b, heads, dim]`` read as ``[s, b, tp * heads * dim]``).
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

from areal_mega.models.gemma3 import FULL, SLIDING
from areal_mega.models.gemma4_forward_state import PER_LAYER_INPUTS

__all__ = ["InFlight", "in_flight", "kv_head_shape", "send", "receive"]

#: one tensor in flight: (what it is, its shape per token, whether it holds the whole sequence):
#: ``(layer type, "key" | "value")`` or ``PER_LAYER_INPUTS``
InFlight = Tuple[tuple, Tuple[int, ...], bool]


def kv_head_shape(config, kind: str, tp: int) -> Tuple[int, int]:
    """``(KV heads on this rank, head dim)`` of a ``kind`` layer's keys and values."""
    if kind == SLIDING:
        return config.num_query_groups // tp, config.kv_channels
    groups = config.global_query_groups if config.attention_k_eq_v else config.num_query_groups
    return groups // tp, config.global_kv_channels


def in_flight(config, after: int, tp: int) -> List[InFlight]:
    """Pure: what passes the boundary after 1-based global layer ``after`` (a chunk's last
    layer; ``after`` = the next chunk's first layer - 1): per layer type whose key/value
    source is at or before ``after`` while one of its shared layers follows, the source's
    keys then values; then the per-layer inputs while layers follow."""
    n = config.num_layers
    if not 0 < after < n:
        return []
    out: List[InFlight] = []
    for kind in (SLIDING, FULL):
        layers = [i for i in range(1, n + 1) if config.layer_types[i - 1] == kind]
        sources = [i for i in layers if config.stores_kv(i)]
        readers = [i for i in layers if i > after and config.is_shared(i)]
        if sources and sources[0] <= after and readers:
            shape = kv_head_shape(config, kind, tp)
            out += [((kind, "key"), shape, True), ((kind, "value"), shape, True)]
    if config.per_layer_input_size:
        out.append((PER_LAYER_INPUTS, (n, config.per_layer_input_size), False))
    return out


def _get(state, key: tuple) -> torch.Tensor:
    if key == PER_LAYER_INPUTS:
        return state.per_layer_inputs
    return state.kv[key[0]][0 if key[1] == "key" else 1]


def send(hidden: torch.Tensor, state, items: List[InFlight]) -> torch.Tensor:
    """The chunk's output: ``hidden`` [s, b, h] with each tensor of ``items`` (read from
    ``state`` as its layers read it: through the relay under recompute) appended on the last
    dimension; ``hidden`` itself when nothing is in flight."""
    if not items:
        return hidden
    s, b = hidden.shape[:2]
    parts = [state.read(key, _get(state, key)).reshape(s, b, -1) for key, _, _ in items]
    return torch.cat([hidden] + parts, -1)


def receive(wide: torch.Tensor, hidden_size: int, state, items: List[InFlight], seq_factor: int):
    """Split a received ``wide`` [s, b, h + extra] (the previous chunk's :func:`send`): the
    hidden state (returned; under recompute the relay's carrier of the received tensors'
    gradients), and each tensor of ``items`` into ``state``; ``seq_factor``: the TP size
    under sequence parallelism, else 1. ``RuntimeError`` when the widths disagree."""
    s, b, width = wide.shape
    need = hidden_size + sum(
        math.prod(shape) * (seq_factor if whole else 1) for _, shape, whole in items
    )
    if width != need:
        raise RuntimeError(
            f"gemma4_text: the previous pipeline stage sent {width} channels per token, this "
            f"stage expects {need} (hidden {hidden_size} and {[k for k, _, _ in items]})"
        )
    parts, start = {}, hidden_size
    for key, shape, whole in items:
        rows = s * (seq_factor if whole else 1)
        stop = start + math.prod(shape) * rows // s
        parts[key] = wide[..., start:stop].contiguous().view(rows, b, *shape)
        start = stop
    kinds = [key[0] for key in parts if key != PER_LAYER_INPUTS and key[1] == "key"]
    for kind in kinds:
        state.kv[kind] = (parts[(kind, "key")], parts[(kind, "value")])
    if PER_LAYER_INPUTS in parts:
        state.per_layer_inputs = parts[PER_LAYER_INPUTS]
    hidden = wide[..., :hidden_size].contiguous()
    return state.deliver(hidden, kv_kinds=kinds, per_layer_inputs=PER_LAYER_INPUTS in parts)
