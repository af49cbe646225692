"""THD ``PackedSeqParams`` for TransformerEngine attention, built on the host from a packed
micro-batch.

TransformerEngine decides whether there is padding *between* sequences from the
``cu_seqlens_*_padded`` arguments: the ``pad_between_seqs`` auto-detection in
``transformer_engine.pytorch.attention.dot_product_attention.DotProductAttention.forward``,
whose result ``get_attention_backend`` (same package, ``utils``) uses to filter backends:

* TE 2.9 - 2.17: ``pad_between_seqs = cu_seqlens_q_padded is not None and not
  torch.equal(cu_seqlens_q_padded[:-1], cu_seqlens_q[:-1])`` (same for kv) -- a device-side
  comparison, i.e. a host sync in every attention layer, whenever padded tensors are passed;
* TE >= 2.18: ``pad_between_seqs`` is True whenever padded tensors are passed unless they are
  the *same objects* as the unpadded ones; with it TE disables FlashAttention 2/4 and the
  unfused backend (and in fp32, where only those apply, finds no backend at all).

So the padded arguments are passed only when sequences really are padded (context parallelism
pads each sequence to a multiple of 2·CP); otherwise they are None, which both TE lines read as
"no padding between sequences" without touching the device. Exception: TE's context-parallel
THD path divides the padded offsets by CP and needs them, so with CP > 1 and no padding the
unpadded tensor itself is passed (the same object: TE >= 2.18 then sees no padding).

Mamba layers (megatron-core's ``MambaMixer``) read ``seq_idx``, each token's sequence number;
without it they scan the whole pack as one sequence, each sequence's state carried into the
next. ``PackedSeqParams`` derives it on the device from ``total_tokens`` (a
``repeat_interleave`` whose output size the host must first read back); here it is built from
the host offsets and moved, and ``total_tokens`` stays None. Attention reads neither (megatron's
TE attention drops both fields).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["packed_seq_kwargs"]


def packed_seq_kwargs(
    cu_seqlens, cu_seqlens_padded, total: int, cp: int = 1, device: Optional[torch.device] = None
) -> dict:
    """Keyword arguments of megatron's ``PackedSeqParams`` (``qkv_format="thd"``).

    ``cu_seqlens``: [B+1] offsets of the real tokens; ``cu_seqlens_padded``: [B+1] slot
    offsets (None or equal values when sequences are not padded); ``total``: packed length T.
    Tokens past the last slot (trailing padding) become one more sequence, so every token
    belongs to a sequence. The padded offsets are returned only when some sequence is padded;
    otherwise ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` are None, or with ``cp`` > 1
    the very tensor passed as ``cu_seqlens_q``. ``max_seqlen_*`` are host ints (no device
    sync). ``seq_idx`` [1, T] int32 numbers each token's sequence (its slot, padding included),
    as megatron's Mamba mixer reads it."""
    cu = torch.as_tensor(cu_seqlens).to(torch.int32).cpu()
    pad = (
        cu
        if cu_seqlens_padded is None
        else torch.as_tensor(cu_seqlens_padded).to(torch.int32).cpu()
    )
    if pad.shape != cu.shape:
        raise ValueError(
            f"cu_seqlens_padded has shape {tuple(pad.shape)}, cu_seqlens "
            f"{tuple(cu.shape)}: they must have the same length B+1"
        )
    last = int(pad[-1])
    if last > total:
        raise ValueError(f"cu_seqlens_padded ends at {last}, beyond the packed length {total}")
    if last < total:  # trailing padding as one more (ignored) sequence
        cu = torch.cat([cu, cu[-1:] + (total - last)])
        pad = torch.cat([pad, torch.tensor([total], dtype=torch.int32)])
    padded = not torch.equal(cu, pad)  # host tensors: no device sync
    lens = (pad if padded else cu).diff()
    max_len = int(lens.max()) if lens.numel() else 0
    seq_idx = torch.repeat_interleave(
        torch.arange(lens.numel(), dtype=torch.int32), lens.to(torch.int64), output_size=total
    )[None]
    cu_dev = cu.to(device) if device is not None else cu
    if padded:
        pad_dev = pad.to(device) if device is not None else pad
    else:
        pad_dev = cu_dev if cp > 1 else None
    return dict(
        qkv_format="thd",
        cu_seqlens_q=cu_dev,
        cu_seqlens_kv=cu_dev,
        cu_seqlens_q_padded=pad_dev,
        cu_seqlens_kv_padded=pad_dev,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        seq_idx=seq_idx.to(device) if device is not None else seq_idx,
    )
