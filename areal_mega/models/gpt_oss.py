"""GPT-OSS (``model_type: gpt_oss``, ``GptOssForCausalLM``) on megatron's local spec.

A MoE decoder whose pieces megatron-core has as options, set by Megatron-Bridge's provider:
attention sinks (``softmax_type="learnable"``: one learnt logit per head in every row's
softmax, :mod:`areal_mega.models.varlen_attention` on the CPU), biases on every attention
projection, layers alternating between a sliding window and full attention, YaRN RoPE, a
softmax over the top-k router logits (router with a bias), and experts with biases whose GLU is
``(clamp(up, ±7) + 1) · quick_gelu(clamp(gate, max=7))`` (``glu_linear_offset``,
``activation_func_clamp_value``). Its checkpoints hold each layer's experts as one tensor, gate
and up interleaved (the ``fused_expert*`` kinds of :mod:`areal_mega.checkpoint.hf_mapping`).

What the provider does not read from the config and this module corrects
(:func:`correct_provider_fields`): the YaRN parameters (the provider writes the released
models' constants: factor 32 over 4096 positions, betas 32 / 1) and which layers slide (the
provider alternates from layer 0; ``layer_types`` may say otherwise).
"""

from __future__ import annotations

from typing import Optional

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.gemma3 import FULL, SLIDING, layer_types_and_window
from areal_mega.models.sliding_window import mcore_window_size
from areal_mega.parallel.allocation import expert_tp_size

GPT_OSS_MODEL_TYPE = "gpt_oss"
#: why expert TP > 1 is refused: megatron-core takes expert biases only at expert-TP 1 (the
#: experts' tensor parallel size is the TP's unless the allocation gives them their own)
TP_REFUSED = (
    "gpt_oss: expert tensor parallelism {tp} is not supported: megatron-core allows biased "
    "experts only with expert tensor parallelism 1. The experts take the attention's TP unless "
    "the allocation gives them their own: e.g. megatron:(attn:d1t2|ffn:t1) for TP 2 with the "
    "experts at TP 1 (--etp 1 for the converters)"
)


def layout_refusal(tp: int, etp: Optional[int]) -> Optional[str]:
    """Why GPT-OSS cannot run with these TP / expert TP sizes (None when it can; ``etp`` None:
    the experts take ``tp``)."""
    expert_tp = expert_tp_size(tp, etp)
    return TP_REFUSED.format(tp=expert_tp) if expert_tp > 1 else None


#: transformers' GptOssExperts constants (not config fields): quick-GELU's alpha and the clamp
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def yarn_parameters(hf: dict) -> dict:
    """The YaRN fields of a ``gpt_oss`` config (``rope_parameters``, or the hub's
    ``rope_scaling`` + ``rope_theta``) as megatron's ``yarn_*`` config attributes; ``ValueError``
    naming the key for another RoPE type or an option megatron's YaRN lacks."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "yarn":
        raise ValueError(f"rope_parameters.rope_type={kind!r}: gpt_oss is built with YaRN only")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rp.get(key) is not None:
            raise ValueError(f"rope_parameters.{key}={rp[key]!r} is not supported for gpt_oss")
    return dict(
        yarn_rotary_scaling_factor=float(rp["factor"]),
        yarn_original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
        yarn_beta_fast=float(rp.get("beta_fast", 32.0)),
        yarn_beta_slow=float(rp.get("beta_slow", 1.0)),
        # transformers' `truncate` (default True) rounds the correction range to integers
        yarn_correction_range_round_to_int=bool(rp.get("truncate", True)),
        yarn_mscale=None,
        yarn_mscale_all_dim=None,
    )


def _layer_types_and_window(hf: dict) -> tuple:
    """``(layer_types, window)``; without ``layer_types`` sliding and full layers alternate
    from layer 0 (transformers' default)."""
    n_layers = int(hf["num_hidden_layers"])
    return layer_types_and_window(hf, [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)])


def gpt_oss_arch_fields(hf: dict) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``gpt_oss`` config; raises
    ``ValueError`` naming the key for options the engine does not reproduce."""
    n_layers = int(hf["num_hidden_layers"])
    layer_types, window = _layer_types_and_window(hf)
    yarn = yarn_parameters(hf)
    if hf.get("attention_bias") is False:
        raise ValueError("attention_bias=false: gpt_oss's attention projections have biases")
    if int(hf["num_experts_per_tok"]) < 1:
        raise ValueError(f"num_experts_per_tok={hf['num_experts_per_tok']!r} must be >= 1")
    return dict(
        decoder_fields(
            hf,
            model_type=GPT_OSS_MODEL_TYPE,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=150000.0,
        ),
        rope_scaling_factor=yarn["yarn_rotary_scaling_factor"],
        qkv_bias=True,
        qk_norm=False,
        sliding_window=window,
        layer_types=layer_types,
        num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
        moe_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["intermediate_size"]),
        moe_norm_topk_prob=True,  # a softmax over the chosen logits
        moe_layer_pattern=(1,) * n_layers,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0))
        if hf.get("output_router_logits")
        else 0.0,
        activation="quick_gelu",
    )


def correct_provider_fields(hf: dict, fields: dict, gpt: dict) -> None:
    """The provider's fields made to say what the config says: YaRN from
    ``rope_parameters``, the sliding layers from ``layer_types`` (megatron's
    ``window_attn_skip_freq`` as a per-layer list: 1 = windowed), the window from
    ``sliding_window``."""
    layer_types, window = _layer_types_and_window(hf)
    fields.update(yarn_parameters(hf))
    fields["window_attn_skip_freq"] = [1 if t == SLIDING else 0 for t in layer_types]
    fields["window_size"] = mcore_window_size(window)
