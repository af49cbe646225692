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

from areal_mega.models.moe_families import moe_pattern_of_layer_types, routed_moe_fields

__all__ = [
    "MLA_MODEL_TYPES",
    "deepseek_v3_fields",
    "deepseek_v2_fields",
    "glm4_moe_lite_fields",
    "mla_full_shapes",
]

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")


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


def deepseek_v2_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``deepseek_v2`` config:
    DeepSeek-V3's attention and a softmax router (transformers: softmax over all experts, top-k,
    no renormalisation whatever ``norm_topk_prob`` says, times ``routed_scaling_factor``; megatron:
    ``moe_router_pre_softmax``), always-on shared experts, dense first layers."""
    method = hf.get("topk_method") or "greedy"
    topk = int(hf["num_experts_per_tok"])
    if method == "group_limited_greedy" and int(hf.get("topk_group") or 0) != topk:
        raise ValueError(
            f"topk_method='group_limited_greedy' with topk_group={hf.get('topk_group')} and "
            f"num_experts_per_tok={topk}: transformers scores a group by its best expert, "
            "megatron by its top (num_experts_per_tok / topk_group); they agree only when "
            "that is 1"
        )
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={method!r} is not supported (greedy, group_limited_greedy)")
    if not hf.get("n_shared_experts"):
        raise ValueError("n_shared_experts must be set (transformers adds the shared experts)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported for deepseek_v2")
    fields = deepseek_v3_fields(
        dict(hf, norm_topk_prob=topk > 1, n_group=1, topk_group=1, rope_interleave=True), n_layers
    )
    grouped = method == "group_limited_greedy"
    fields.update(
        moe_norm_topk_prob=False,
        moe_score_function="softmax",
        moe_expert_bias=False,
        moe_num_groups=int(hf["n_group"]) if grouped else None,
        moe_group_topk=int(hf["topk_group"]) if grouped else None,
    )
    return fields


def glm4_moe_lite_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``glm4_moe_lite`` config
    (GLM-4.7-Flash): DeepSeek-V3's attention and router, the dense layers from
    ``mlp_layer_types``."""
    fields = deepseek_v3_fields(dict(hf, first_k_dense_replace=0), n_layers)
    fields["moe_layer_pattern"] = moe_pattern_of_layer_types(hf, n_layers)
    return fields


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
