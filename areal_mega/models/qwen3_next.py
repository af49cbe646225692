"""Qwen3-Next (``model_type: qwen3_next``) on megatron's local layer spec.

The architecture fields come from Megatron-Bridge's provider: gated delta-net (linear
attention) layers where ``layer_types`` says ``linear_attention`` (megatron-core's
``GatedDeltaNet``, ``linear_attention_freq``), full-attention layers with an output gate
(``attention_output_gate``: the query projection also gives a per-channel sigmoid gate), QK
RMSNorm, zero-centred RMSNorms (``(1 + w)``), partial rotary, and a softmax top-k router with
a gated shared expert. The provider's layer spec is TransformerEngine's; here megatron's local
spec is assembled per layer the same way, with :class:`~areal_mega.models.gemma3.Gemma3RMSNorm`
(transformers' ``Qwen3NextRMSNorm`` is the same ``(1 + w)`` fp32 norm) as every norm, the
gated delta-net's output norm too (:class:`GatedDeltaNetOutputNorm`, its gradient summed over
the TP ranks' heads; transformers' ``Qwen3NextRMSNormGated`` has a plain gain ``w``: the
converters store ``w - 1``), and our packed attention. On the CPU the
gated delta-net runs on :mod:`areal_mega.compat.gdn_cpu`.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from areal_mega.models.gemma3 import Gemma3RMSNorm
from areal_mega.models.varlen_attention import VarlenDotProductAttention

QWEN3_NEXT_MODEL_TYPE = "qwen3_next"
#: the families built here: Qwen3-Next, and Qwen3.5's text models (the same layers with the
#: delta-net's input projection in four checkpoint tensors; dense MLPs, or Qwen3-Next's MoE)
GATED_DELTA_NET_MODEL_TYPES = (QWEN3_NEXT_MODEL_TYPE, "qwen3_5_text", "qwen3_5_moe_text")


def linear_attention_layers(hf: dict) -> tuple:
    """Per layer, 1 for a gated delta-net layer and 0 for full attention (transformers'
    ``layer_types``; without it, every ``full_attention_interval``-th layer is full)."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("full_attention_interval", 4))
        return tuple(0 if (i + 1) % every == 0 else 1 for i in range(n))
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad or len(types) != n:
        raise ValueError(
            f"layer_types: {n} entries of linear_attention / full_attention expected, got "
            f"{len(types)} ({bad or 'lengths differ'})"
        )
    return tuple(1 if t == "linear_attention" else 0 for t in types)


class GatedDeltaNetOutputNorm(Gemma3RMSNorm):
    """The gated delta-net's output norm (``(1 + w)`` RMSNorm over one value head): its weight
    is shared by every head, and a tensor-parallel rank holds some of the heads, so each rank's
    gradient is a partial sum over its heads; the forward passes the weight through megatron's
    copy to the TP region (identity forward, all-reduce backward), with or without sequence
    parallelism (megatron's ``finalize_model_grads`` sums replicated norms over TP under
    sequence parallelism only: the weight is not tagged for it)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        weight = self.weight
        if ps.get_tensor_model_parallel_world_size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + weight.float())).type_as(x)


def rotary_share(hf: dict) -> float:
    """Pure: the share of each head's channels that get rotary, as transformers reads it:
    ``rope_parameters.partial_rotary_factor``, else the top-level ``partial_rotary_factor``
    (which transformers moves there), else ``Qwen3NextConfig``'s default 0.25."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))


def qwen3_next_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk): megatron's local MoE decoder block spec
    (dense / MoE layers by ``moe_layer_freq``) with the gated delta-net as the attention of the
    layers ``config.linear_attention_freq`` marks, zero-centred RMSNorms everywhere and our
    packed attention. ``ValueError`` for TransformerEngine's spec, which is not wired."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if use_te:
        raise ValueError(
            f"{', '.join(GATED_DELTA_NET_MODEL_TYPES)} run on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    plain = copy.copy(config)  # megatron's GPT block spec refuses the variant it does not build
    plain.experimental_attention_variant = None
    block = specs.get_gpt_decoder_block_spec(
        plain, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    linear = get_linear_attention_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=GatedDeltaNetOutputNorm,
            out_proj=RowParallelLinear,
        ),
    )
    layers = []
    for i, spec in enumerate(block.layer_specs):
        spec = copy.deepcopy(spec)
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = Gemma3RMSNorm
        if linear[offset + i]:
            layer.self_attention = gdn
        else:
            attn = layer.self_attention.submodules
            attn.core_attention = VarlenDotProductAttention
            attn.q_layernorm = attn.k_layernorm = Gemma3RMSNorm
        layers.append(spec)
    block.layer_specs = layers
    block.layer_norm = Gemma3RMSNorm
    return block


def qwen3_next_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``qwen3_next``,
    ``qwen3_5_text`` or ``qwen3_5_moe_text`` config (the converters' facts; the megatron config
    comes from the bridge's provider). Raises ``ValueError`` naming the key of any feature this
    implementation lacks.
    Qwen3.5's multimodal rotary (``mrope_section``) is plain rotary on text, whose three
    position ids are equal."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(
            f"rope_parameters.rope_type={kind!r} is not supported for {hf['model_type']}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported (silu only)")
    if hf.get("attention_bias"):
        raise ValueError(
            f"attention_bias=True is not supported for {hf['model_type']} (Megatron-Bridge's "
            "registry maps no attention bias)"
        )
    experts = int(hf.get("num_experts") or 0)
    if experts and not hf.get("norm_topk_prob", True):
        raise ValueError(
            f"norm_topk_prob=False is not supported for {hf['model_type']} (the bridge's "
            "provider renormalises the chosen experts' weights: moe_router_pre_softmax=False)"
        )
    n = int(hf["num_hidden_layers"])
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return dict(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        rope_theta=float(hf.get("rope_theta", rp.get("rope_theta", 10_000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=True,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        rotary_percent=rotary_share(hf),
        num_experts=experts or None,
        moe_topk=int(hf.get("num_experts_per_tok") or 0),
        moe_ffn_hidden_size=int(hf.get("moe_intermediate_size") or 0) or None,
        moe_norm_topk_prob=True,
        moe_layer_pattern=(
            tuple(0 if (i in dense or (i + 1) % step) else 1 for i in range(n)) if experts else None
        ),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        moe_shared_ffn_hidden_size=int(hf.get("shared_expert_intermediate_size") or 0) or None,
        linear_attention_layers=linear_attention_layers(hf),
        gdn_heads=tuple(
            int(hf[k])
            for k in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
            )
        ),
        attention_output_gate=True,
    )
