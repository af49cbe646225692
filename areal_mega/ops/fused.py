"""Forward-only fused LM head + label log-probabilities, chunked over tokens and vocabulary.

For the reference-policy and proximal-policy passes, which need no gradient: the logits of a
``token_chunk x vocab_chunk`` tile are computed from the hidden states and the LM-head weight,
reduced to per-token statistics by the same kernels as :func:`packed_logprobs`, merged online
across vocabulary tiles, then all-reduced over the TP group.  Peak extra memory is one tile of
logits (plus its float32 view inside the torch backend), never ``[T, V]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .logprob import _tp_info, finalize, global_stats, local_stats, merge_stats


@torch.no_grad()
def packed_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    token_chunk: int = 1024,
    vocab_chunk: int = 16384,
    return_entropy: bool = False,
    bias: Optional[torch.Tensor] = None,
):
    """Log-probabilities of ``labels`` under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: ``[T, H]`` final hidden states (already gathered across sequence parallelism).
        weight: ``[V_local, H]`` this TP rank's shard of the output layer (rank ``r`` owns
            vocabulary ids ``[r * V_local, (r + 1) * V_local)``).
        labels: ``[T]`` global token ids (negative = padding, logprob 0).
        temperature, tp_group, return_entropy: as in :func:`packed_logprobs`.
        token_chunk, vocab_chunk: tile sizes of the logits computed at a time.
        bias: optional ``[V_local]`` output-layer bias.

    Returns:
        ``logprobs`` float32 ``[T]`` or ``(logprobs, entropy)``; identical on every TP rank.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V_local, H] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T]={hidden.shape[0]}, got {tuple(labels.shape)}")
    if token_chunk <= 0 or vocab_chunk <= 0:
        raise ValueError("token_chunk and vocab_chunk must be positive")
    rank, _ = _tp_info(tp_group)
    T, V_local = hidden.shape[0], weight.shape[0]
    labels = labels.to(device=hidden.device, dtype=torch.long)
    parts = []
    for a in range(0, T, token_chunk):
        b = min(T, a + token_chunk)
        h = hidden[a:b]
        acc = None
        for v0 in range(0, V_local, vocab_chunk):
            v1 = min(V_local, v0 + vocab_chunk)
            logits = h @ weight[v0:v1].T
            if bias is not None:
                logits += bias[v0:v1]
            st = local_stats(
                logits,
                labels[a:b],
                vocab_start=rank * V_local + v0,
                temperature=temperature,
                with_entropy=return_entropy,
            )
            acc = st if acc is None else merge_stats(acc, st)
            del logits
        parts.append(acc)
    cat = [torch.cat([p[i] for p in parts]) if parts else None for i in range(3)]
    u = torch.cat([p[3] for p in parts]) if (parts and return_entropy) else None
    if not parts:
        empty = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        return (empty, empty.clone()) if return_entropy else empty
    m, s, xlab, u = global_stats(cat[0], cat[1], cat[2], u, tp_group)
    lp, ent, _, _ = finalize(m, s, xlab, u, labels)
    return (lp, ent) if return_entropy else lp
