"""Decode-sized matmuls on CPU through oneDNN with weights prepacked once.

A decode step multiplies a few rows (one per running request) by every weight matrix of the
model, so its cost is reading the weights. ``F.linear`` on CPU goes to MKL's sgemm, which on
small ``M`` reads fp32 weights at about a quarter of the memory bandwidth (and less on AMD
CPUs, where MKL does not take its fast paths). oneDNN's matmul on a weight reordered into its
blocked layout for the machine's ISA (``torch.ops.mkldnn._reorder_linear_weight``, the
prepacking torch's inductor uses for CPU linears) runs the same product 2.5-3x faster at
``M`` = 1-32 (``bench/rollout.py`` prints the end-to-end effect).

:func:`pack_linear_layers` routes every ``nn.Linear`` of a model through that path. The dense
parameter stays the source of truth: the packed copy is rebuilt on the first forward after the
weight changes (a different storage, or an in-place write such as the servers' weight
updates, which bumps the tensor's version counter). The path is used only without autograd
and for fp32 CPU tensors; anything else goes to ``F.linear``. :func:`fused_linear` does the
same for several projections of one input at once (q/k/v, gate/up): one matmul, one packed
weight, the layers' forward hooks applied to their slices of the output.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with MKLDNN)."""
    try:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def _version_key(t) -> tuple:
    """What identifies a tensor's current values: its storage, version counter and shape."""
    return () if t is None else (t.data_ptr(), t._version, tuple(t.shape))


def _onednn_mm(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """``x @ w.T + b`` with ``w`` prepacked by ``_reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def _packed_weight(mod: torch.nn.Linear) -> torch.Tensor:
    """``mod``'s weight in oneDNN's layout, rebuilt when the dense weight changed."""
    w = mod.weight
    key = _version_key(w)
    cached = mod.__dict__.get("_onednn_packed")
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        mod.__dict__["_onednn_packed"] = cached
    return cached[1]


def _plain_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` must go to ``F.linear`` (autograd, another dtype or device)."""
    return (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
            or w.device.type != "cpu" or x.numel() == 0
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if _plain_path(x, w):
        return F.linear(x, w, self.bias)
    bias = None if self.bias is None else self.bias.detach()
    return _onednn_mm(x, _packed_weight(self), bias)


def fused_linear(x: torch.Tensor, layers: tuple) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` as one matmul over the concatenated
    weights (e.g. q/k/v or gate/up projections), prepacked for oneDNN where available. The
    concatenation is cached on ``layers[0]`` and rebuilt when any weight or bias changes."""
    if any(type(m) is not torch.nn.Linear or _plain_path(x, m.weight) for m in layers):
        return torch.cat([m(x) for m in layers], -1)
    key = tuple((_version_key(m.weight), _version_key(m.bias)) for m in layers)
    cached = layers[0].__dict__.get("_fused_weights")
    if cached is None or cached[0] != key:
        w = torch.cat([m.weight.detach() for m in layers])
        b = None
        if any(m.bias is not None for m in layers):
            b = torch.cat([m.bias.detach() if m.bias is not None
                           else w.new_zeros(m.out_features) for m in layers])
        if onednn_linear_available():
            w = torch.ops.mkldnn._reorder_linear_weight(w, None)
        cached = (key, w, b)
        layers[0].__dict__["_fused_weights"] = cached
    _, w, b = cached
    y = _onednn_mm(x, w, b) if w.is_mkldnn else F.linear(x, w, b)
    if any(m._forward_hooks for m in layers):
        y = _run_hooks(x, layers, y)
    return y


def _run_hooks(x: torch.Tensor, layers: tuple, y: torch.Tensor) -> torch.Tensor:
    """Apply each layer's forward hooks to its slice of the fused output ``y``, as calling
    the layers one by one would (e.g. LoRA, :mod:`areal_mega.inference.lora_layers`)."""
    outs, changed, start = [], False, 0
    for m in layers:
        out = y[..., start:start + m.out_features]
        start += m.out_features
        for hook in m._forward_hooks.values():
            r = hook(m, (x,), out)
            if r is not None:
                out, changed = r, True
        outs.append(out)
    return torch.cat(outs, -1) if changed else y


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`_onednn_forward` (see the module
    docstring); returns how many layers were routed (0 when oneDNN is unavailable)."""
    if not onednn_linear_available():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.forward = types.MethodType(_onednn_forward, mod)
            n += 1
    return n


def unpack_linear_layers(model: torch.nn.Module) -> None:
    """Undo :func:`pack_linear_layers` and drop the packed copies."""
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop("_onednn_packed", None)
            mod.__dict__.pop("_fused_weights", None)
