"""OLMoE (``model_type: olmoe``, ``OlmoeForCausalLM``) on megatron's local spec.

OLMoE is a Llama-style MoE decoder (a softmax router over every expert, top-k, the chosen
weights renormalised only with ``norm_topk_prob``; no shared experts; every layer MoE) whose QK
norm differs from megatron-core's: transformers' ``OlmoeAttention`` applies one RMSNorm to the
whole query projection (``num_heads · head_dim`` channels at once) and one to the whole key
projection, where megatron's ``qk_layernorm`` normalises each head over ``head_dim``.

:class:`WholeProjectionRMSNorm` is that norm under tensor parallelism: a rank holds its heads'
slice of the projection and of the norm weight (marked tensor-parallel on dim 0, so the
converters, the checkpoints and the weight export shard and gather it), and the mean square
is summed over the TP group with a differentiable all-reduce (each rank's gradient of the
statistic reaches the others). :class:`WholeProjectionQKAttention` puts one on the queries and
one on the keys of megatron's ``SelfAttention`` (Megatron-Bridge's own ``OLMoESelfAttention``
sizes the norm by the whole projection on every rank, which holds at TP 1 only).
The architecture fields (sizes, router, experts) come from the bridge's provider. MiniMax-M2
(``minimax_m2``) has the same QK norms and uses this attention too (its router and rotary
share: :func:`areal_mega.models.moe_families.minimax_m2_fields`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.varlen_attention import VarlenDotProductAttention

OLMOE_MODEL_TYPE = "olmoe"
#: megatron config fields the engine sets over the provider's: ``qk_layernorm`` off, as the QK
#: norms are :class:`WholeProjectionQKAttention`'s own. With it on, megatron's
#: ``finalize_model_grads`` sums the gradients of every ``q_layernorm`` / ``k_layernorm``
#: parameter over the TP group (right for its per-head norms, replicated on every rank), which
#: would add up the different slices of ours
CONFIG_OVERRIDES = {"qk_layernorm": False}


class WholeProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of a ``[..., heads, head_dim]`` projection at once, this rank
    holding ``heads`` of ``heads · tp`` (weight ``[heads · head_dim]``, its TP slice)."""

    def __init__(self, config, heads: int, head_dim: int, eps: float, tp_group=None):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.eps, self.heads, self.head_dim = eps, heads, head_dim
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.weight = torch.nn.Parameter(torch.ones(heads * head_dim, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` [..., heads, head_dim] over its last two dimensions (and the other
        ranks' heads) in fp32; same shape and dtype back."""
        xf = x.float().flatten(-2)
        sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            sq = dist.nn.functional.all_reduce(sq, group=self.tp_group)
        ms = sq / (xf.shape[-1] * self.tp_size)
        out = xf * torch.rsqrt(ms + self.eps) * self.weight.float()
        return out.type_as(x).view_as(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as this rank's TP slice (dim 0) of the whole projection's norm."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


class WholeProjectionQKAttention(SelfAttention):
    """megatron ``SelfAttention`` with OLMoE's QK norms (:class:`WholeProjectionRMSNorm` on
    the queries and on the keys) in place of the per-head ones."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # no norms: config.qk_layernorm is off
        tp = self.pg_collection.tp
        hd = self.hidden_size_per_attention_head
        eps = config.layernorm_epsilon
        self.q_layernorm = WholeProjectionRMSNorm(
            config, self.num_attention_heads_per_partition, hd, eps, tp
        )
        self.k_layernorm = WholeProjectionRMSNorm(
            config, self.num_query_groups_per_partition, hd, eps, tp
        )


def olmoe_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of an ``olmoe`` config dict
    (the converters' facts; the megatron config comes from the bridge's provider). Raises
    ``ValueError`` naming the key of any feature this implementation lacks."""
    if hf.get("clip_qkv") is not None:
        raise ValueError(
            f"clip_qkv={hf['clip_qkv']!r} is not supported (clamping the q/k/v projections); "
            "set it to null"
        )
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for olmoe")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope type {rp.get('rope_type', rp.get('type'))!r} is not supported")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    n_layers = int(hf["num_hidden_layers"])
    experts = int(hf.get("num_experts") or hf.get("num_local_experts"))
    return dict(
        decoder_fields(
            hf,
            model_type=OLMOE_MODEL_TYPE,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            head_dim=hidden // heads,
        ),
        qkv_bias=False,
        qk_norm=True,
        num_experts=experts,
        moe_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["intermediate_size"]),
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layer_pattern=(1,) * n_layers,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
    )


def olmoe_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk): megatron's MoE decoder block spec with
    :class:`WholeProjectionQKAttention` and our packed attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        raise ValueError(
            "olmoe runs on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    spec = specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    for layer in spec.layer_specs:
        layer.submodules.self_attention.module = WholeProjectionQKAttention
        layer.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    return spec
