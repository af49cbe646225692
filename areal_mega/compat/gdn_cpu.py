"""Torch stand-ins for the fla kernels megatron-core's ``GatedDeltaNet`` calls (CPU path).

megatron-core 0.19's gated delta-net layer (``megatron.core.ssm.gated_delta_net``) imports
``causal_conv1d``, ``l2norm`` and ``chunk_gated_delta_rule`` from fla (flash-linear-attention,
Triton kernels for CUDA) and refuses to build without it. Its own torch fallback
(``torch_chunk_gated_delta_rule``, deterministic mode) refuses packed sequences. The three
functions here take fla's signatures, including ``cu_seqlens`` (packed variable-length
sequences, batch 1: each sequence's convolution window and recurrent state start from zero),
and are plain differentiable torch (autograd gives the backward).

The math (per value head; ``S`` is the ``[dk, dv]`` state, ``a_t = exp(g_t)``):
``S_t = a_t (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t``,
evaluated in chunks of :data:`CHUNK` positions: inside a chunk the corrections
``u = (I + A)^-1 (b v - b e^G K S_0)`` (``A`` strictly lower triangular,
``A_ij = b_i e^(G_i - G_j) k_i . k_j``, ``G`` the cumulative log decay) come from one
triangular solve, and the state is carried from chunk to chunk. Packed sequences are laid out
as a padded batch (zero decay log, zero key and ``b`` at the padding, which lies after each
sequence's end and so never reaches a real position).

:func:`install` puts them into megatron-core's modules; :mod:`areal_mega.compat.megatron_cpu`
calls it when it applies the CPU patches.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "l2norm", "causal_conv1d", "chunk_gated_delta_rule", "install"]

#: positions per chunk of the chunked gated delta rule (fla's chunk size)
CHUNK = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over ``dim`` (fla's ``l2norm``), computed in fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _positions_in_sequence(cu_seqlens: Optional[torch.Tensor], length: int, device) -> torch.Tensor:
    """Each packed position's index inside its own sequence (``arange`` without packing)."""
    pos = torch.arange(length, device=device)
    if cu_seqlens is None:
        return pos
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.bucketize(pos, cu[1:], right=True)
    return pos - cu[:-1][seq]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **_,
):
    """Depthwise causal convolution of ``x`` ``[b, s, d]`` with ``weight`` ``[d, w]`` (fla's
    ``causal_conv1d``): ``y_t = sum_j weight[:, w-1-j] * x_(t-j)``, positions before the start
    of the sequence (of ``cu_seqlens``' sequence, when packed) being zero; then ``activation``
    (``silu`` / ``swish`` or None). Returns ``(y, None)``."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("causal_conv1d on the CPU: no initial or final state")
    b, s, d = x.shape
    w = weight.shape[-1]
    inside = _positions_in_sequence(cu_seqlens, s, x.device)
    y = x * weight[:, w - 1]
    for j in range(1, w):
        shifted = F.pad(x, (0, 0, j, 0))[:, :s]
        keep = (inside >= j).to(x.dtype)[None, :, None]
        y = y + shifted * keep * weight[:, w - 1 - j]
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (silu / swish / None)")
    return y, None


def _to_padded(t: torch.Tensor, cu: list, lmax: int) -> torch.Tensor:
    """``[1, T, ...]`` packed -> ``[N, lmax, ...]`` zero-padded at each sequence's end."""
    parts = [t[0, a:b] for a, b in zip(cu[:-1], cu[1:])]
    return torch.stack([F.pad(p, (0, 0) * (p.dim() - 1) + (0, lmax - p.shape[0])) for p in parts])


def _from_padded(t: torch.Tensor, cu: list) -> torch.Tensor:
    """Inverse of :func:`_to_padded`: ``[N, lmax, ...]`` -> ``[1, T, ...]``."""
    return torch.cat([t[i, : b - a] for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])[None]


def _chunked_rule(q, k, v, g, beta, scale, state):
    """The chunked gated delta rule on ``[B, H, L, d]`` fp32 tensors (``L`` a multiple of
    :data:`CHUNK`), ``state`` ``[B, H, dk, dv]``. Returns (outputs ``[B, H, L, dv]``, final
    state)."""
    B, H, L, dk = k.shape
    n = L // CHUNK
    q, k, v = (t.reshape(B, H, n, CHUNK, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(B, H, n, CHUNK) for t in (g, beta))
    G = g.cumsum(-1)  # cumulative log decay inside each chunk
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, 0.0)
    decay = diff.exp().masked_fill(~lower, 0.0)  # e^(G_i - G_j), j <= i
    kb = k * beta[..., None]
    strict = lower & ~torch.eye(CHUNK, dtype=torch.bool, device=k.device)
    A = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(CHUNK, dtype=k.dtype, device=k.device)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    qk = (q @ k.transpose(-1, -2)) * decay  # causal, decayed, inside the chunk
    outs = []
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ state
        o = (q[:, :, c] * G[:, :, c, :, None].exp()) @ state + qk[:, :, c] @ u
        outs.append(o * scale)
        last = G[:, :, c, -1]
        state = (
            state * last.exp()[..., None, None]
            + (k[:, :, c] * (last[..., None] - G[:, :, c]).exp()[..., None]).transpose(-1, -2) @ u
        )
    return torch.stack(outs, dim=2).reshape(B, H, L, -1), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **_,
):
    """fla's ``chunk_gated_delta_rule``: ``q``, ``k`` ``[b, s, h, dk]``, ``v`` ``[b, s, h, dv]``,
    ``g`` (log decay) and ``beta`` ``[b, s, h]``; ``cu_seqlens`` (batch 1): packed sequences,
    each starting from a zero state. Computed in fp32, returned in ``q``'s dtype, with the
    final states ``[N, h, dk, dv]`` when ``output_final_state``."""
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens needs batch 1, got {q.shape[0]}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        lmax = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        q, k, v, g, beta = (_to_padded(t, cu, lmax) for t in (q, k, v, g, beta))
    B, L, H, dk = k.shape
    pad = (-L) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2) for t in (g, beta))
    state = (
        torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float()
    )
    out, state = _chunked_rule(q, k, v, g, beta, scale, state)
    out = out[:, :, :L].transpose(1, 2)
    if cu_seqlens is not None:
        out = _from_padded(out, cu)
    return out.to(dtype).contiguous(), (state if output_final_state else None)


def install(common_mod, gdn_mod) -> None:
    """Serve these functions to megatron-core's gated delta-net modules in place of fla's:
    ``common`` (which holds ``HAVE_FLA`` and calls ``l2norm``) and ``gdn`` (which imported
    ``causal_conv1d`` and ``chunk_gated_delta_rule`` by name)."""
    for mod in (common_mod, gdn_mod):
        for name, fn in (
            ("causal_conv1d", causal_conv1d),
            ("l2norm", l2norm),
            ("chunk_gated_delta_rule", chunk_gated_delta_rule),
        ):
            if name in vars(mod):
                setattr(mod, name, fn)
    common_mod.HAVE_FLA = True
