"""Which rows of a family's table a configuration has, for the DeepSeek-style MoE families
(GLM-4 MoE, DeepSeek-V3) and the optional parts of the others.

The tables themselves are Megatron-Bridge's (:mod:`areal_mega.checkpoint.bridge_tables`); a
registry lists every tensor its architecture may have. Beyond the Qwen3-MoE rows, a GLM-4 MoE
layer has the router's ``expert_bias`` buffer (``mlp.gate.e_score_correction_bias``) and the
shared experts (``mlp.shared_experts.{gate,up,down}_proj``); DeepSeek-V3's multi-latent
attention has ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` <-> ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (or ``linear_q_proj`` <-> ``q_proj`` without
``q_lora_rank``), ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` <->
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, every one a plain copy.
:func:`optional_map_present` drops the rows a config lacks (QKV bias, QK norms, the query's
low-rank pair or its single projection, shared experts, expert bias, a shared-expert gate,
which the builder never makes). Multi-token-prediction layers (``num_nextn_predict_layers``: HF
layers numbered from ``num_hidden_layers`` on; EXAONE-MoE: tensors under ``mtp.``) are not part
of the trained model; transformers ignores them too. Ernie 4.5 MoE keeps its
multi-token-prediction modules outside the layers (``mtp_block.<i>``, ``mtp_linear_proj``, ...),
which transformers skips by the name ``mtp`` whatever the config says; so do the converters.
"""

from __future__ import annotations

import re

__all__ = ["optional_map_present", "is_mtp_tensor"]


def optional_map_present(arch, mcore_suffix: str) -> bool:
    """False for a table entry the architecture does not have (QKV bias, QK norms, shared
    experts, expert bias, a shared-expert gate; MLA: the query's low-rank pair or its single
    projection, a fused QKV)."""
    if mcore_suffix == "self_attention.linear_q_proj.weight":
        return arch.mla_q_lora_rank is None
    if mcore_suffix in (
        "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.weight",
    ):
        return arch.mla_q_lora_rank is not None
    if arch.is_mla and mcore_suffix.startswith("self_attention.linear_qkv."):
        return False  # GLM-5's registry also maps a fused QKV, which MLA layers do not have
    if arch.is_mla and mcore_suffix == "self_attention.q_layernorm.weight":
        return arch.mla_q_lora_rank is not None
    if mcore_suffix == "self_attention.linear_qkv.bias":
        return arch.qkv_bias
    if mcore_suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return arch.qk_norm
    if mcore_suffix == "mlp.shared_experts.router.weight":  # a shared-expert gate
        return False
    if mcore_suffix.startswith("mlp.shared_experts."):
        return bool(arch.moe_shared_ffn_hidden_size)
    if mcore_suffix == "mlp.router.expert_bias":
        return arch.moe_expert_bias
    return True


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
#: Ernie 4.5 MoE's multi-token-prediction modules (a name component starting with ``mtp``)
_ERNIE_MTP = re.compile(r"(^|\.)mtp")
#: families whose multi-token-prediction tensors live under ``mtp.`` (``mtp.layers.*``,
#: ``mtp.fc``, ``mtp.norm``, ...), which transformers skips on load whatever the config says
_MTP_PREFIX_MODEL_TYPES = ("exaone_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def is_mtp_tensor(arch, hf_name: str) -> bool:
    """True for a tensor of a multi-token-prediction layer (not converted)."""
    if arch.model_type == "ernie4_5_moe":
        return bool(_ERNIE_MTP.search(hf_name))
    if arch.model_type in _MTP_PREFIX_MODEL_TYPES:
        return hf_name.startswith("mtp.")
    m = _LAYER.match(hf_name)
    return bool(arch.mtp_layers and m and int(m.group(1)) >= arch.num_layers)
