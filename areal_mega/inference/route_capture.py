"""Capture of the routed experts of every token a forward feeds through a MoE model (SGLang's
``--enable-return-routed-experts``; format in :mod:`areal_mega.common.moe_routes`).

The HF MoE blocks run as modules inside the engine's forwards (:mod:`.kv_cache`), so a forward
hook on each block's router records the ids the block itself uses: the router's own output
indices where it returns them (transformers' ``Qwen3MoeTopKRouter``: softmax over the gate
logits, top-k), or the same softmax / top-k over the logits of a plain linear gate. Hooks are
installed only when the server is started with the flag, and record only between
:meth:`RouteCapture.begin` and :meth:`RouteCapture.end`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from areal_mega.common.moe_routes import RouteLayout


def _moe_gates(model) -> dict:
    """``{layer index: router module}`` of the model's sparse MoE blocks."""
    layers = getattr(getattr(model, "model", None), "layers", None) or ()
    gates = {}
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is not None and hasattr(mlp, "experts"):
            gates[i] = gate
    return gates


class RouteCapture:
    """Records, per forward, ``[tokens, num_hidden_layers, topk]`` int32 expert ids (dense
    layers' rows 0, as SGLang leaves them)."""

    def __init__(self, model):
        self.layout = RouteLayout.from_hf_config(model.config)
        gates = _moe_gates(model)
        if self.layout is None or not gates:
            raise ValueError(
                f"--enable-return-routed-experts: {type(model).__name__} "
                f"(model_type={getattr(model.config, 'model_type', None)!r}) has "
                "no mixture-of-experts layers to report"
            )
        # an expert bias on the gate (DeepSeek-style sigmoid routers) or in its moe_statics
        # (Ernie 4.5's softmax router, whose output tuple also puts the ids elsewhere)
        biased = [
            i
            for i, g in gates.items()
            if hasattr(g, "e_score_correction_bias") or hasattr(g, "moe_statics")
        ]
        if biased:
            raise ValueError(
                f"--enable-return-routed-experts: {type(model).__name__} routes "
                "with an expert bias (layers "
                f"{biased}); only the softmax top-k router is captured"
            )
        if tuple(sorted(gates)) != self.layout.moe_layers:
            raise ValueError(
                f"--enable-return-routed-experts: the model's MoE blocks are in "
                f"layers {sorted(gates)}, its config says "
                f"{list(self.layout.moe_layers)}"
            )
        self._rows: Optional[dict] = None
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in gates.items()]

    def _hook(self, layer: int):
        topk = self.layout.topk

        def record(_mod, _inp, out):
            if self._rows is None:
                return
            if isinstance(out, tuple):  # a router module: (logits, weights, indices)
                ids = out[-1]
            else:  # a linear gate: the block's softmax / top-k
                probs = torch.softmax(out, dim=-1, dtype=torch.float)
                ids = torch.topk(probs, topk, dim=-1).indices
            self._rows[layer] = ids.reshape(-1, topk)

        return record

    def begin(self) -> None:
        """Record the next forward."""
        self._rows = {}

    def end(self, n_tokens: int) -> np.ndarray:
        """Stop recording; the ids of the forward's ``n_tokens`` tokens in its flattened
        (row-major batch x position) order."""
        rows, self._rows = self._rows, None
        lay = self.layout
        out = np.zeros((n_tokens, lay.num_hidden_layers, lay.topk), np.int32)
        for layer, ids in (rows or {}).items():
            out[:, layer] = ids.numpy()
        return out

    def remove(self) -> None:
        """Uninstall the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
