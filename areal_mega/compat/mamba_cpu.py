"""Torch stand-ins for the Mamba-2 kernels megatron-core's ``MambaMixer`` calls (CPU path).

megatron-core 0.19's Mamba-2 mixer (``megatron.core.ssm.mamba_mixer``) imports ``causal_conv1d_fn``
(causal-conv1d, CUDA), the gated RMSNorm and the SSD scans ``mamba_chunk_scan_combined`` /
``mamba_split_conv1d_scan_combined`` (mamba-ssm, Triton) and refuses to build without them.
The functions here take those signatures, including ``seq_idx`` (packed sequences: each
position's sequence number; a sequence's convolution window and SSM state start from zero),
and are plain differentiable torch (autograd gives the backward).

The scan (per head, state ``h`` ``[headdim, d_state]``, ``dt`` after bias / softplus / limits):
``h_t = exp(A dt_t) h_(t-1) + dt_t x_t B_t^T`` and ``y_t = h_t C_t + D x_t``, evaluated in
chunks of ``chunk_size`` positions (the SSD form: a masked quadratic form inside a chunk, the
states passed from chunk to chunk). A packed sequence starts fresh by making its first
position's decay ``exp(-inf) = 0``; every decay is a sum of log decays over an interval (never
a difference of cumulative sums), so the ``-inf`` reaches exactly the products that cross a
sequence start.

:func:`install` puts them into megatron-core's mixer module; :mod:`areal_mega.compat.megatron_cpu`
calls it when it applies the CPU patches.
"""

from __future__ import annotations

import ast
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "RMSNormGated",
    "causal_conv1d_fn",
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "install",
]


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"causal_conv1d_fn: activation {activation!r} (silu / swish / None)")
    return y


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_states_out: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
):
    """Depthwise causal convolution of ``x`` ``[b, d, s]`` with ``weight`` ``[d, w]``
    (causal-conv1d's ``causal_conv1d_fn``): ``y_t = sum_j weight[:, w-1-j] * x_(t-j)``, positions
    before the start of the sequence (of ``seq_idx``' sequence ``[b, s]``, when packed) being
    zero; then ``activation`` (``silu`` / ``swish`` or None)."""
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("causal_conv1d_fn on the CPU: no initial or final states")
    s, w = x.shape[-1], weight.shape[-1]
    y = x * weight[:, w - 1, None]
    for j in range(1, min(w, s)):
        term = x[..., :-j] * weight[:, w - 1 - j, None]
        if seq_idx is not None:
            term = term * (seq_idx[:, j:] == seq_idx[:, :-j]).to(x.dtype)[:, None]
        y = y + F.pad(term, (j, 0))
    if bias is not None:
        y = y + bias[:, None]
    return _activate(y, activation)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``j <= i`` and ``-inf`` above the
    diagonal: each entry a sum over its own interval (no differences of cumulative sums)."""
    n = a.shape[-1]
    below = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    out = a[..., :, None].expand(*a.shape, n).masked_fill(~below, 0.0).cumsum(-2)
    return out.masked_fill(
        ~below.logical_or(torch.eye(n, dtype=torch.bool, device=a.device)), -torch.inf
    )


def _heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """``[b, l, g, n]`` (a group per run of ``nheads / g`` heads) -> ``[b, l, nheads, n]``."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _ssd(x, dt, A, B, C, chunk_size: int, seq_idx):
    """The chunked SSD scan on fp32 ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]`` (final),
    ``B``, ``C`` ``[b, l, h, n]``; returns ``y`` ``[b, l, h, p]`` (no ``D``, no gate) and the
    final states ``[b, h, p, n]``."""
    b, length, h, p = x.shape
    loga = dt * A  # log decay per position
    if seq_idx is not None:
        start = torch.zeros_like(seq_idx, dtype=torch.bool)
        start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        loga = loga.masked_fill(start[..., None], -torch.inf)
    pad = (-length) % chunk_size
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    loga = F.pad(loga, (0, 0, 0, pad))
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (B, C))
    nc = (length + pad) // chunk_size
    xdt, B, C = (t.reshape(b, nc, chunk_size, h, t.shape[-1]) for t in (xdt, B, C))
    loga = loga.reshape(b, nc, chunk_size, h).permute(0, 3, 1, 2)  # [b, h, c, l]
    seg = _segsum(loga)  # [b, h, c, l, l]
    # inside each chunk: y_i = sum_(j<=i) (C_i . B_j) exp(sum a_(j+1..i)) xdt_j
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * seg.exp()
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)
    # each chunk's own contribution to the state at its end, then the states passed along
    to_end = seg[..., -1, :].exp()  # exp(sum a_(j+1..end)), [b, h, c, l]
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], xdt)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    whole = seg[..., -1, :1] + loga[..., :1]  # the chunk's total log decay, [b, h, c, 1]
    passed = _segsum(F.pad(whole[..., 0], (1, 0))).exp()  # [b, h, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", passed, states)
    # the state entering each chunk, decayed to each position: exp(sum a_(start..i))
    from_start = (seg[..., :, :1] + loga[..., None, :1])[..., 0].exp()  # [b, h, c, l]
    y = y + torch.einsum(
        "bclhn,bchpn->bclhp", C * from_start.permute(0, 2, 3, 1)[..., None], states[:, :-1]
    )
    return y.reshape(b, -1, h, p)[:, :length], states[:, -1]


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit=(0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    **_,
):
    """mamba-ssm's ``mamba_chunk_scan_combined``: ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``,
    ``A`` ``[h]``, ``B``, ``C`` ``[b, l, g, n]``, ``D`` ``[h]`` or ``[h, p]``, ``z`` (gate:
    ``y * silu(z)``) ``[b, l, h, p]``, ``seq_idx`` ``[b, l]`` (packed sequences). Computed in
    fp32, returned in ``x``'s dtype (with the final states when ``return_final_states``)."""
    if initial_states is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError(
            "mamba_chunk_scan_combined on the CPU: no initial / varlen states (use seq_idx)"
        )
    dtype, h = x.dtype, x.shape[2]
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y, final = _ssd(
        x.float(), dt, A.float(), _heads(B.float(), h), _heads(C.float(), h), chunk_size, seq_idx
    )
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, final) if return_final_states else y


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: Optional[torch.Tensor],
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    dt_limit=(0.0, float("inf")),
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: Optional[torch.Tensor] = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Optional[torch.Tensor] = None,
    outproj_bias: Optional[torch.Tensor] = None,
    headdim: Optional[int] = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
):
    """mamba-ssm's fused ``mamba_split_conv1d_scan_combined``: ``zxbcdt`` ``[b, l, z | x B C |
    dt]`` split, the causal convolution (``activation``) over ``x B C``, the scan with
    ``dt_softplus`` and ``D``, then the gate ``silu(z)`` (or, with ``rmsnorm_weight``, the gated
    RMSNorm), and ``outproj_weight`` if given. ``seq_idx`` ``[b, l]``: packed sequences."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("mamba_split_conv1d_scan_combined: headdim is needed for a 1-D D")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // (2 * ngroups)
    z, xbc, dt = zxbcdt.split([dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d_fn(
        xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation
    ).transpose(1, 2)
    x, B, C = xbc.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, length = x.shape[:2]
    out = mamba_chunk_scan_combined(
        x.reshape(b, length, nheads, headdim),
        dt,
        A,
        B.reshape(b, length, ngroups, dstate),
        C.reshape(b, length, ngroups, dstate),
        chunk_size,
        D=D,
        z=None if rmsnorm_weight is not None else z.reshape(b, length, nheads, headdim),
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    out, final = out if return_final_states else (out, None)
    out = out.reshape(b, length, dim)
    if rmsnorm_weight is not None:
        out = _gated_rms_norm(out, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


def _gated_rms_norm(x, weight, z, eps: float, group_size: int, norm_before_gate: bool):
    """RMSNorm over groups of ``group_size`` channels, gated by ``silu(z)`` before
    (``norm_before_gate=False``) or after the norm; fp32 inside, ``x``'s dtype out."""
    dtype = x.dtype
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    grouped = xf.unflatten(-1, (-1, group_size))
    xf = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    xf = xf * weight.float()
    if z is not None and norm_before_gate:
        xf = xf * F.silu(z.float())
    return xf.to(dtype)


class RMSNormGated(nn.Module):
    """mamba-ssm's gated RMSNorm (``ops.triton.layernorm_gated.RMSNorm``): per group of
    ``group_size`` channels (all channels when None), ``forward(x, z=None)``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: Optional[int] = None,
        norm_before_gate: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.eps = eps
        self.group_size = group_size or hidden_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _gated_rms_norm(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)


def _packing_supported(for_inference_not_training: bool = True):
    """Packed sequences (``seq_idx``) are supported by these functions for training; megatron's
    dynamic inference path needs its own Triton ops, which stay unavailable."""
    if for_inference_not_training:
        return False, "Mamba inference with packed sequences needs the CUDA kernels"
    return True, None


def _redefine_class(mod, name: str) -> None:
    """Run the source of class ``name`` of ``mod`` again in ``mod``'s namespace: a class defined
    on the placeholder megatron falls back to (a ``MagicMock`` instance: subclassing it gives
    another mock, the class body lost) is then defined on what ``mod`` holds now."""
    tree = ast.parse(inspect.getsource(mod))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    code = compile(ast.Module(body=[node], type_ignores=[]), inspect.getsourcefile(mod), "exec")
    exec(code, mod.__dict__)


def install(mixer_mod) -> None:
    """Serve these functions to megatron-core's Mamba mixer module in place of causal-conv1d's
    and mamba-ssm's: the module-level names, ``HAVE_MAMBA_SSM``, its packing-support check,
    and ``ExtendedRMSNorm`` defined again on :class:`RMSNormGated` (it subclassed a placeholder)."""
    mixer_mod.causal_conv1d_fn = causal_conv1d_fn
    mixer_mod.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    mixer_mod.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    mixer_mod.RMSNormGated = RMSNormGated
    _redefine_class(mixer_mod, "ExtendedRMSNorm")
    mixer_mod._check_mamba_sequence_packing_support = _packing_supported
    mixer_mod.HAVE_MAMBA_SSM = True
