"""The rollout server's decode-step kernels: RMSNorm, one query per row attending over a KV
cache, and choosing one token per row.

A CPU decode step for a few requests is a matmul per weight matrix plus many small ops on
``[rows, hidden]`` or ``[rows, vocab]`` tensors. In torch those small ops cost mostly
dispatch and temporaries: at 32 rows of a 49k vocabulary, sampling alone took 28 ms and the
attention of 30 layers 25 ms of a 230 ms step. Each function here runs the C++ kernel of
``csrc/decode/`` (one pass per row, parallel over rows, the same ISA dispatch as the logprob
kernels) on float32 CPU tensors when the kernels are built and ``AREAL_MEGA_OPS_BACKEND`` is
not ``torch``; otherwise its pure-torch reference below, which the tests compare it with.
Neither has autograd: they serve inference only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _backend


def _native(*tensors: torch.Tensor):
    """The C++ module when every tensor is a float32 CPU tensor and the kernels are built
    (a build from before these kernels counts as not built), else None."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    mod = _backend.select(torch.device("cpu"))
    return mod if mod is not None and hasattr(mod, "sample_rows") else None


def panel_kernels():
    """The C++ module whose ``pack_gemm_panels(w)`` / ``gemm_panels(x, panels, n, bias)``
    compute ``x w^T + bias`` for a few rows of ``x`` (``csrc/decode/``: ``w`` ``[n, K]``
    packed in panels of ``gemm_panel_width()`` output columns, a width that depends on the ISA
    in use), or None when the kernels are not built or ``AREAL_MEGA_OPS_BACKEND=torch``. Its
    reference is ``F.linear`` on the dense weight (:func:`unpack_gemm_panels` undoes a pack)."""
    return _native()


def unpack_gemm_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The dense ``[n, K]`` weight of a ``pack_gemm_panels`` result ``[panels, K, NR]``."""
    P, K, NR = panels.shape
    return panels.transpose(1, 2).reshape(P * NR, K)[:n]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2, -1) + eps))``, the models' RMSNorm over the last
    dimension (computed in float32 for float32 inputs)."""
    mod = _native(x, weight)
    if mod is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return mod.rms_norm(x, weight, eps)


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One decode step's attention for rows ``b = 0..B-1``: writes ``k_new[b]`` / ``v_new[b]``
    (``[B, Hkv, D]``) into the caches (``[rows >= B, Hkv, capacity, D]``) at column
    ``pos[b]``, then returns ``softmax(q k^T * scale) v`` ``[B, H, D]`` for queries ``q``
    ``[B, H, D]`` (query head ``h`` reads KV head ``h // (H / Hkv)``) over columns
    ``0..pos[b]``, or the last ``window`` of them when ``window > 0``."""
    mod = _native(q, k_new, v_new, k_cache, v_cache)
    if mod is None:
        return decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, scale, window)
    return mod.decode_attention(
        q, k_new, v_new, k_cache, v_cache, pos.contiguous(), scale, int(window or 0)
    )


def decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, scale, window=0):
    """:func:`decode_attention` in torch: the cache written by indexing, masked matmuls."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    if B == 0:
        return q.new_empty(B, H, D)
    rows = torch.arange(B)
    k_cache[rows, :, pos] = k_new
    v_cache[rows, :, pos] = v_new
    Lm = int(pos.max()) + 1
    cols, last = torch.arange(Lm).view(1, 1, 1, Lm), pos.view(B, 1, 1, 1)
    masked = cols > last
    if window:
        masked |= cols <= last - window
    scores = (
        torch.matmul(q.reshape(B, Hkv, H // Hkv, D), k_cache[:B, :, :Lm].transpose(-1, -2)) * scale
    )
    probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1)
    return torch.matmul(probs, v_cache[:B, :, :Lm]).reshape(B, H, D)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, greedy: torch.Tensor
) -> tuple:
    """One token per row of ``x = logits / temperature[:, None]`` (``logits`` ``[B, V]``).

    Returns ``(tokens, logprobs, bad)``: a row is *bad* when ``x`` has a NaN or ``+inf``, or
    is ``-inf`` everywhere (its token is -1). Otherwise its token is the first argmax of ``x``
    where ``greedy`` is set, else the draw at ``uniform`` (float64 in [0, 1)) by the inverse
    CDF of ``softmax(x)`` (:func:`inverse_cdf_pick`); its logprob is ``log_softmax(x)`` at the
    token, ``-inf`` clamped to the most negative float."""
    mod = _native(logits, temperature)
    if mod is None:
        return sample_rows_reference(logits, temperature, uniform, greedy)
    return tuple(
        mod.sample_rows(
            logits if logits.stride(-1) == 1 else logits.contiguous(),
            temperature.contiguous(),
            uniform.contiguous(),
            greedy.contiguous(),
        )
    )


def sample_rows_reference(logits, temperature, uniform, greedy) -> tuple:
    """:func:`sample_rows` in torch: ``log_softmax``, then :func:`inverse_cdf_pick`."""
    x = logits.float() / temperature.view(-1, 1)
    bad = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | torch.isneginf(x).all(-1)
    tokens = torch.full((x.shape[0],), -1, dtype=torch.long)
    logprobs = torch.zeros(x.shape[0])
    ok = (~bad).nonzero().view(-1)
    if ok.numel():
        logp = torch.log_softmax(x[ok], -1)
        pick = torch.where(greedy[ok], logp.argmax(-1), inverse_cdf_pick(logp.exp(), uniform[ok]))
        tokens[ok] = pick
        floor = torch.finfo(logp.dtype).min
        logprobs[ok] = logp.gather(1, pick.view(-1, 1)).view(-1).clamp(min=floor)
    return tokens, logprobs, bad


def inverse_cdf_pick(ps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``ps`` ``[B, V]`` (non-negative, unnormalised weights), the index ``i``
    with ``cdf[i-1] <= u * total < cdf[i]``: a draw from the row's distribution given one
    uniform ``u`` in [0, 1) per row. One random number per row instead of the ``V``
    exponentials ``torch.multinomial`` draws per row; the cumulative sums are float64, and a
    token of probability 0 is never chosen (``cdf[i] > cdf[i-1]`` for the chosen ``i``)."""
    cdf = ps.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.view(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).view(-1).clamp_(max=ps.shape[1] - 1)
