"""HF <-> megatron tensor tables of the DeepSeek-style MoE families (GLM-4 MoE, DeepSeek-V3).

Beyond the Qwen3-MoE tables of :mod:`areal_mega.checkpoint.hf_mapping`, a GLM-4 MoE layer has
(checked against megatron-bridge 0.6.2's GLM-4.5 mapping):

======================================================  ========================================
megatron (local spec)                                    HF (``Glm4MoeForCausalLM``)
======================================================  ========================================
``...mlp.router.expert_bias`` (a buffer, fp32)           ``mlp.gate.e_score_correction_bias``
``...mlp.shared_experts.linear_fc1.weight`` [gate; up]   ``mlp.shared_experts.{gate,up}_proj``
``...mlp.shared_experts.linear_fc2.weight``              ``mlp.shared_experts.down_proj.weight``
======================================================  ========================================

DeepSeek-V3's multi-latent attention (every tensor a plain copy, as in megatron-bridge's
DeepSeek mapping): ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` <->
``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``linear_q_proj`` <-> ``q_proj`` without
``q_lora_rank``), ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` <->
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``.

The QKV bias and the QK norms are optional in GLM-4 MoE (``attention_bias``, ``use_qk_norm``):
the family's tables list them and :func:`optional_map_present` drops the ones a config lacks.
Multi-token-prediction layers (``num_nextn_predict_layers``: HF layers numbered from
``num_hidden_layers`` on) are not part of the trained model; transformers ignores them too.
"""
from __future__ import annotations

import re

__all__ = ["moe_families", "optional_map_present", "is_mtp_tensor"]

_M = "model.layers.{L}.mlp."
_S = _M + "shared_experts."


def moe_families(TensorMap, Family, attn, qkv_bias, qk_norm, dense_mlp, moe_mlp) -> dict:
    """``{model_type: Family}`` of these families, built from the base tables (passed in so
    that this module does not import its importer)."""
    router_bias = TensorMap("mlp.router.expert_bias", (_M + "gate.e_score_correction_bias",))
    shared = (TensorMap("mlp.shared_experts.linear_fc1.weight",
                        (_S + "gate_proj.weight", _S + "up_proj.weight"), "glu"),
              TensorMap("mlp.shared_experts.linear_fc2.weight", (_S + "down_proj.weight",)))
    attention = attn + qkv_bias + qk_norm
    moe = moe_mlp + (router_bias,) + shared
    a = "model.layers.{L}.self_attn."
    mla = (
        TensorMap("input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        TensorMap("self_attention.linear_q_proj.weight", (a + "q_proj.weight",)),
        TensorMap("self_attention.linear_q_down_proj.weight", (a + "q_a_proj.weight",)),
        TensorMap("self_attention.q_layernorm.weight", (a + "q_a_layernorm.weight",)),
        TensorMap("self_attention.linear_q_up_proj.weight", (a + "q_b_proj.weight",)),
        TensorMap("self_attention.linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",)),
        TensorMap("self_attention.kv_layernorm.weight", (a + "kv_a_layernorm.weight",)),
        TensorMap("self_attention.linear_kv_up_proj.weight", (a + "kv_b_proj.weight",)),
        TensorMap("self_attention.linear_proj.weight", (a + "o_proj.weight",)),
        TensorMap("pre_mlp_layernorm.weight",
                  ("model.layers.{L}.post_attention_layernorm.weight",)),
    )
    return {"glm4_moe": Family("glm4_moe", ("Glm4MoeForCausalLM",), attention + dense_mlp,
                               attention + moe),
            "deepseek_v3": Family("deepseek_v3", ("DeepseekV3ForCausalLM",), mla + dense_mlp,
                                  mla + moe)}


def optional_map_present(arch, mcore_suffix: str) -> bool:
    """False for a table entry the architecture does not have (QKV bias, QK norms, shared
    experts, expert bias; MLA: the query's low-rank pair or its single projection)."""
    if mcore_suffix == "self_attention.linear_q_proj.weight":
        return arch.mla_q_lora_rank is None
    if mcore_suffix in ("self_attention.linear_q_down_proj.weight",
                        "self_attention.linear_q_up_proj.weight"):
        return arch.mla_q_lora_rank is not None
    if arch.is_mla and mcore_suffix == "self_attention.q_layernorm.weight":
        return arch.mla_q_lora_rank is not None
    if mcore_suffix == "self_attention.linear_qkv.bias":
        return arch.qkv_bias
    if mcore_suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return arch.qk_norm
    if mcore_suffix.startswith("mlp.shared_experts."):
        return bool(arch.moe_shared_ffn_hidden_size)
    if mcore_suffix == "mlp.router.expert_bias":
        return arch.moe_expert_bias
    return True


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_tensor(arch, hf_name: str) -> bool:
    """True for a tensor of a multi-token-prediction layer (not converted)."""
    m = _LAYER.match(hf_name)
    return bool(arch.mtp_layers and m and int(m.group(1)) >= arch.num_layers)
