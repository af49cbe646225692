"""RoPE over packed (THD) sequences in one call, as megatron-core 0.16 applied it.

megatron-core 0.19's unfused ``_apply_rotary_pos_emb_thd`` (the path used without
TransformerEngine's fused kernel, i.e. on the CPU) applies the rotary embedding one packed
sequence at a time when the frequencies cover one sequence length (the usual case): a Python
loop of a dozen small ops per sequence and per attention call. A GRPO micro-batch packs dozens
of short samples, so this loop cost more than the attention itself (the CPU demo's logprob
pass took 2x as long as on 0.16). The rotation is elementwise, so gathering each sequence's
frequency slice first and rotating the whole packed tensor once gives the same numbers bit for
bit; :func:`packed_thd_rope` does that and leaves every other case (frequencies for the whole
packed batch, the deprecated ``multi_latent_attention`` keyword, a missing ``cp_group``) to
upstream's function.
"""

from __future__ import annotations

import torch

__all__ = ["install", "packed_thd_rope"]


def packed_thd_rope(upstream, rope_utils):
    """The replacement for ``rope_utils._apply_rotary_pos_emb_thd`` (``upstream``)."""

    def apply_thd(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        mla_rotary_interleaved=False,
        mscale=1.0,
        cp_group=None,
        multi_latent_attention=None,
    ):
        if (
            cp_group is None
            or multi_latent_attention is not None
            or (freqs.dim() >= 1 and freqs.size(0) == int(cu_seqlens[-1]))
        ):
            return upstream(
                t,
                cu_seqlens,
                freqs,
                rotary_interleaved=rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved,
                mscale=mscale,
                cp_group=cp_group,
                multi_latent_attention=multi_latent_attention,
            )
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
        packed = torch.cat(
            [
                rope_utils._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs)
                for x in torch.split(t, seqlens)
            ],
            dim=0,
        )
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            packed,
            rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale,
        ).squeeze(1)

    apply_thd.__wrapped_original__ = upstream
    apply_thd.__doc__ = upstream.__doc__
    return apply_thd


def install(rope_utils) -> None:
    """Replace ``_apply_rotary_pos_emb_thd`` in ``rope_utils`` (and the name imported from it
    by ``rotary_pos_embedding``)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    upstream = rope_utils._apply_rotary_pos_emb_thd
    upstream = getattr(upstream, "__wrapped_original__", upstream)
    patched = packed_thd_rope(upstream, rope_utils)
    rope_utils._apply_rotary_pos_emb_thd = patched
    if hasattr(rotary_pos_embedding, "_apply_rotary_pos_emb_thd"):
        rotary_pos_embedding._apply_rotary_pos_emb_thd = patched
