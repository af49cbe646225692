"""Decode-sized matmuls on CPU with weights prepacked once.

A decode step multiplies a few rows (one per running request) by every weight matrix of the
model, so its cost is reading the weights. ``F.linear`` on CPU goes to MKL's sgemm, which on
small ``M`` reads fp32 weights at about a quarter of the memory bandwidth (and less on AMD
CPUs, where MKL does not take its fast paths). Two prepacked paths replace it:

* up to :data:`PANEL_ROWS_MAX` rows (decode): the C++ kernel of ``csrc/decode/``
  (:func:`areal_mega.ops.decode.panel_kernels`), which streams a weight packed in panels of
  a few output columns once, in order, with the next block prefetched. On a 2-core AVX2 EPYC
  the 121 matmuls of a 135M model's decode step took 39.8 ms at 8 rows against oneDNN's
  75.4 ms, and 92.6 against 105.4 at 32 (``bench/rollout.py`` prints the end-to-end effect);
* more rows (prefill): oneDNN's matmul on a weight reordered into its blocked layout for the
  machine's ISA (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking torch's inductor
  uses for CPU linears), the faster one there (100-140 GFLOPS against the panels' ~100).

:func:`pack_linear_layers` routes every ``nn.Linear`` of a model through these paths. The
dense parameter stays the source of truth: the packed copies are rebuilt on the first
forward after the weight changes (a different storage, or an in-place write such as the
servers' weight updates, which bumps the tensor's version counter). The paths are used only
without autograd and for fp32 CPU tensors, or bf16 ones where oneDNN has bf16 GEMMs (a bf16
server): those take oneDNN's prepacked matmul at every size (the panels are fp32), the same
values as ``F.linear``, which reorders the weight at each call; on a 2-core Intel Xeon with AMX
(1 thread) a decode step's products of 1-64 rows 1.3-2.4x faster (the 135M model's output
layer at 64 rows 3.5 ms against 6.4). On a CPU without bf16 GEMMs
(:mod:`areal_mega.common.cpu_bf16`) a bf16 weight is packed widened to fp32 and its
products computed in fp32, rounded to bf16 once (torch's bf16 product there is a scalar
loop). Anything else goes to ``F.linear``.
:func:`fused_linear` does the same for several projections of one input at once (q/k/v,
gate/up): one matmul, one packed weight, the layers' forward hooks applied to their slices
of the output. The price is memory: each weight is held in both packed layouts besides the
dense parameter.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from areal_mega.common.cpu_bf16 import bf16_in_fp32, bf16_products_in_fp32, has_bf16_gemm
from areal_mega.ops import decode as decode_ops

PANEL_ROWS_MAX = 32  # rows up to which the panel kernel beats oneDNN (measured above)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with MKLDNN)."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
    except (AttributeError, RuntimeError):
        return False


def _version_key(t) -> tuple:
    """What identifies a tensor's current values: its storage, version counter and shape."""
    return () if t is None else (t.data_ptr(), t._version, tuple(t.shape))


def _onednn_mm(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """``x @ w.T + b`` with ``w`` prepacked by ``_reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


class PackedWeight:
    """A weight ``[N, K]`` and bias in the layouts its products use: panels for the C++
    few-rows kernel, oneDNN's blocked layout for more rows (each where available), and the
    dense weight where a product still needs it."""

    def __init__(self, w: torch.Tensor, b, owned: bool):
        """``owned``: ``w`` is a copy made for this object (a concatenation), dropped once
        the packed layouts serve every product."""
        kernels = self.kernels = decode_ops.panel_kernels()
        self.widened = bf16_in_fp32(w)
        if self.widened:  # no bf16 GEMMs here: the products of a widened copy
            w, b, owned = w.float(), None if b is None else b.float(), True
        self.out_features, self.bias = w.shape[0], b
        fp32 = w.dtype == torch.float32
        self.panels = kernels.pack_gemm_panels(w) if kernels is not None and fp32 else None
        self.onednn = (
            torch.ops.mkldnn._reorder_linear_weight(w, None) if onednn_linear_available() else None
        )
        self.dense = None if owned and self.onednn is not None else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.widened:
            return self._product(x.float()).to(torch.bfloat16)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if self.panels is not None and rows <= PANEL_ROWS_MAX:
            return self.kernels.gemm_panels(x, self.panels, self.out_features, self.bias)
        if self.onednn is not None:
            return _onednn_mm(x, self.onednn, self.bias)
        return F.linear(x, self.dense, self.bias)


def _layout_key() -> tuple:
    """What the packed layouts depend on beyond the weights: the panel width of the ISA in
    use (a test or a bench may switch it)."""
    kernels = decode_ops.panel_kernels()
    return (None if kernels is None else kernels.gemm_panel_width(), bf16_products_in_fp32())


def _packed_weight(mod: torch.nn.Linear) -> PackedWeight:
    """``mod``'s weight packed, rebuilt when the dense weight or bias changed."""
    key = (_version_key(mod.weight), _version_key(mod.bias), _layout_key())
    cached = mod.__dict__.get("_packed_weight")
    if cached is None or cached[0] != key:
        bias = None if mod.bias is None else mod.bias.detach()
        cached = (key, PackedWeight(mod.weight.detach(), bias, owned=False))
        mod.__dict__["_packed_weight"] = cached
    return cached[1]


def _bf16_onednn() -> bool:
    """Whether oneDNN's prepacked matmul takes bf16 here (AVX-512 BF16 or AMX)."""
    global _BF16
    if _BF16 is None:
        try:
            _BF16 = onednn_linear_available() and has_bf16_gemm()
        except (AttributeError, RuntimeError):
            _BF16 = False
    return _BF16


_BF16 = None


def _plain_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` must go to ``F.linear`` (autograd, another dtype or device)."""
    packable = x.dtype == w.dtype and (
        x.dtype == torch.float32
        or (x.dtype == torch.bfloat16 and (_bf16_onednn() or bf16_in_fp32(x, w)))
    )
    return (
        not packable
        or x.device.type != "cpu"
        or w.device.type != "cpu"
        or x.numel() == 0
        or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
    )


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _plain_path(x, self.weight):
        return F.linear(x, self.weight, self.bias)
    return _packed_weight(self)(x)


def fused_linear(x: torch.Tensor, layers: tuple) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` as one matmul over the concatenated
    weights (e.g. q/k/v or gate/up projections), prepacked (:class:`PackedWeight`). The
    concatenation is cached on ``layers[0]`` and rebuilt when any weight or bias changes."""
    if any(type(m) is not torch.nn.Linear or _plain_path(x, m.weight) for m in layers):
        return torch.cat([m(x) for m in layers], -1)
    key = (tuple((_version_key(m.weight), _version_key(m.bias)) for m in layers), _layout_key())
    cached = layers[0].__dict__.get("_fused_weights")
    if cached is None or cached[0] != key:
        w = torch.cat([m.weight.detach() for m in layers])
        b = None
        if any(m.bias is not None for m in layers):
            b = torch.cat(
                [
                    m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features)
                    for m in layers
                ]
            )
        cached = (key, PackedWeight(w, b, owned=True))
        layers[0].__dict__["_fused_weights"] = cached
    y = cached[1](x)
    if any(m._forward_hooks for m in layers):
        y = _run_hooks(x, layers, y)
    return y


def _run_hooks(x: torch.Tensor, layers: tuple, y: torch.Tensor) -> torch.Tensor:
    """Apply each layer's forward hooks to its slice of the fused output ``y``, as calling
    the layers one by one would (e.g. LoRA, :mod:`areal_mega.inference.lora_layers`)."""
    outs, changed, start = [], False, 0
    for m in layers:
        out = y[..., start : start + m.out_features]
        start += m.out_features
        for hook in m._forward_hooks.values():
            r = hook(m, (x,), out)
            if r is not None:
                out, changed = r, True
        outs.append(out)
    return torch.cat(outs, -1) if changed else y


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`_packed_forward` (see the module
    docstring); returns how many layers were routed (0 when neither oneDNN nor the C++
    kernels are available)."""
    if not onednn_linear_available() and decode_ops.panel_kernels() is None:
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.forward = types.MethodType(_packed_forward, mod)
            n += 1
    return n


def unpack_linear_layers(model: torch.nn.Module) -> None:
    """Undo :func:`pack_linear_layers` and drop the packed copies."""
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop("_packed_weight", None)
            mod.__dict__.pop("_fused_weights", None)
