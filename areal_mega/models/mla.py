"""DeepSeek-V3 (``deepseek_v3``): multi-latent attention (MLA) on megatron-core's own
``MLASelfAttention`` (local spec: ``get_gpt_decoder_block_spec`` with
``config.multi_latent_attention``), and the DeepSeek-style router of
:mod:`areal_mega.models.moe_families`.

HF fields -> ``MLATransformerConfig``: Megatron-Bridge's DeepSeek provider maps them
(:mod:`areal_mega.models.bridge_provider`, with its one correction for configs without rope
scaling); these are the facts the converters and the export read:
``q_lora_rank`` (None: one ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim`` -> ``qk_head_dim``,
``qk_rope_head_dim`` -> ``qk_pos_emb_head_dim``, ``v_head_dim``. The latent RMSNorms
(``q_a_layernorm``, ``kv_a_layernorm``) are megatron's ``q_layernorm`` / ``kv_layernorm``
(``qk_layernorm=True``). megatron's MLA always applies rotary in the interleaved (even/odd
channel) layout, which is transformers' ``rope_interleave=True`` (its default); a config with
``rope_interleave=False`` is refused. Rope scaling (YaRN) is refused by the builder's rope check.
"""

from __future__ import annotations

from areal_mega.models.moe_families import routed_moe_fields

__all__ = ["MLA_MODEL_TYPES", "deepseek_v3_fields", "mla_full_shapes"]

MLA_MODEL_TYPES = ("deepseek_v3",)


def deepseek_v3_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``deepseek_v3`` config beyond
    the common ones. ``ValueError`` for what megatron's MLA cannot reproduce."""
    if hf.get("rope_interleave", True) is False:
        raise ValueError(
            "rope_interleave=False: megatron-core's MLA applies rotary in the "
            "interleaved layout only"
        )
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for multi-latent attention")
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    q_lora = hf.get("q_lora_rank")
    heads = int(hf["num_attention_heads"])
    return dict(
        routed_moe_fields(hf, n_layers),
        qk_norm=True,
        qkv_bias=False,
        num_kv_heads=heads,
        head_dim=nope + rope,
        mla_q_lora_rank=int(q_lora) if q_lora else None,
        mla_kv_lora_rank=int(hf["kv_lora_rank"]),
        mla_qk_nope_head_dim=nope,
        mla_qk_rope_head_dim=rope,
        mla_v_head_dim=int(hf["v_head_dim"]),
    )


def mla_full_shapes(arch) -> dict:
    """Full (un-split) megatron shapes of the MLA projections, by canonical name (for the live
    export's tensor-parallel gather; every one is split along one axis under TP)."""
    h, n = arch.hidden_size, arch.num_heads
    q_head = arch.mla_qk_nope_head_dim + arch.mla_qk_rope_head_dim
    q_in = arch.mla_q_lora_rank or h
    a = "self_attention."
    return {
        a + "linear_q_proj.weight": (n * q_head, h),
        a + "linear_q_down_proj.weight": (arch.mla_q_lora_rank, h),
        a + "linear_q_up_proj.weight": (n * q_head, q_in),
        a + "linear_kv_down_proj.weight": (arch.mla_kv_lora_rank + arch.mla_qk_rope_head_dim, h),
        a + "linear_kv_up_proj.weight": (
            n * (arch.mla_qk_nope_head_dim + arch.mla_v_head_dim),
            arch.mla_kv_lora_rank,
        ),
        a + "linear_proj.weight": (h, n * arch.mla_v_head_dim),
    }
