"""HF config fields and megatron-core options of the DeepSeek-style MoE families.

GLM-4 MoE (``glm4_moe``, GLM-4.5 / 4.6) routes like DeepSeek-V3: a sigmoid score per expert, an
expert bias (``e_score_correction_bias``) added for the *choice* of experts only, optionally
group-limited top-k (``n_group`` / ``topk_group``), renormalised top-k weights
(``norm_topk_prob``) times ``routed_scaling_factor``, plus always-on shared experts
(``n_shared_experts`` × ``moe_intermediate_size``) and the first ``first_k_dense_replace`` layers
dense. Attention is grouped-query attention with a QKV bias (``attention_bias``), optional
per-head QK RMSNorm (``use_qk_norm``) and partial rotary: rotary on the first
``partial_rotary_factor · head_dim`` channels of each head in the half-split (``rotate_half``)
layout, the rest passed through (transformers' ``apply_rotary_pos_emb`` of ``glm4_moe``, which
is megatron's non-interleaved rotary with ``rotary_percent``).

megatron-core 0.19.2 options for these (set by megatron-bridge's GLM-4.5 / DeepSeek providers,
which the builder takes them from: :mod:`areal_mega.models.bridge_provider`):
``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias`` (the router's
``expert_bias`` buffer, mapped from ``e_score_correction_bias``), ``moe_router_num_groups`` /
``moe_router_group_topk``, ``moe_router_topk_scaling_factor``,
``moe_shared_expert_intermediate_size`` and ``moe_layer_freq``.

The expert bias is not trained by gradient. In pretraining megatron nudges it after every
step by ``moe_router_bias_update_rate`` toward balanced expert loads (aux-loss-free balancing);
here the rate is 0, so it stays the checkpoint's value: the rollout servers route with the
checkpoint's bias, and a trainer-side drift would make the trainer choose other experts than
the policy that generated the samples, for a balance objective RL does not optimise.

HY-V3 (``hy_v3``, Hy3) routes the same way without groups: sigmoid scores, the expert bias
(``e_score_correction_bias``; ``mlp.expert_bias`` in its checkpoints) for the choice only, the
chosen weights always renormalised (``/ (sum + 1e-20)``, as megatron's) times
``router_scaling_factor``, shared experts of ``moe_intermediate_size · num_shared_experts``,
and its dense layers from ``mlp_layer_types`` (:func:`hy_v3_fields`).

MiniMax-M2 (``minimax_m2``) routes like HY-V3 without shared experts and without a scaling
factor (every layer MoE), with OLMoE's whole-projection QK norms (:mod:`areal_mega.models.olmoe`)
and rotary on part of each head (:func:`minimax_m2_fields`).

Two differences between megatron and transformers are refused rather than approximated:
megatron's sigmoid router renormalises the top-k weights whenever ``topk > 1`` (transformers
only when ``norm_topk_prob``), and megatron scores an expert group by the sum of its top
``topk / topk_group`` scores (transformers: its top 2).
"""

from __future__ import annotations

__all__ = [
    "EXPERT_BIAS_ROUTER_MODEL_TYPES",
    "SIGMOID_ROUTER_MODEL_TYPES",
    "glm4_moe_fields",
    "hy_v3_fields",
    "minimax_m2_fields",
    "moe_pattern_of_layer_types",
    "routed_moe_fields",
]

#: families whose router is sigmoid + expert bias (DeepSeek-V3 style)
SIGMOID_ROUTER_MODEL_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "hy_v3", "minimax_m2")
#: families whose router chooses experts with an expert bias: the sigmoid ones and Ernie 4.5's
#: softmax router (:mod:`areal_mega.models.ernie4_5_moe`)
EXPERT_BIAS_ROUTER_MODEL_TYPES = SIGMOID_ROUTER_MODEL_TYPES + ("ernie4_5_moe",)


def _partial_rotary_factor(hf: dict) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` or the top level; transformers'
    ``Glm4MoeConfig`` defaults it to 0.5 when a config has neither."""
    rp = hf.get("rope_parameters") or {}
    return float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))


def routed_moe_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` MoE fields of a DeepSeek-style config
    (GLM-4 MoE, DeepSeek-V3): sigmoid router with expert bias, groups, scaling, shared experts,
    dense first layers. Raises ``ValueError`` for options megatron cannot reproduce."""
    n_exp = int(hf.get("n_routed_experts") or hf.get("num_local_experts"))
    topk = int(hf["num_experts_per_tok"])
    n_group = int(hf.get("n_group") or 1)
    topk_group = int(hf.get("topk_group") or 1)
    norm = bool(hf.get("norm_topk_prob", True))
    if norm != (topk > 1):
        raise ValueError(
            f"norm_topk_prob={norm} with num_experts_per_tok={topk}: megatron's "
            "sigmoid router renormalises the top-k weights exactly when top-k > 1"
        )
    grouped = 1 < n_group and topk_group < n_group
    if n_group > 1 and n_exp % n_group:
        raise ValueError(f"n_routed_experts={n_exp} is not divisible by n_group={n_group}")
    if grouped and topk // topk_group != 2:
        raise ValueError(
            f"group-limited routing with num_experts_per_tok={topk}, topk_group="
            f"{topk_group}: transformers scores a group by its top-2 experts, "
            "megatron by its top (num_experts_per_tok / topk_group); they agree "
            "only when that is 2"
        )
    k_dense = int(hf.get("first_k_dense_replace") or 0)
    n_shared = int(hf.get("n_shared_experts") or 0)
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(
        num_experts=n_exp,
        moe_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_norm_topk_prob=norm,
        moe_layer_pattern=tuple(0 if i < k_dense else 1 for i in range(n_layers)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=n_group if grouped else None,
        moe_group_topk=topk_group if grouped else None,
        moe_routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_shared_ffn_hidden_size=moe_ffn * n_shared if n_shared else None,
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def glm4_moe_fields(hf: dict, n_layers: int, head_dim: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``glm4_moe`` config (beyond
    the common attention fields). Raises ``ValueError`` for options megatron cannot reproduce."""
    factor = _partial_rotary_factor(hf)
    rot = head_dim * factor
    if not (0 < factor <= 1) or rot != int(rot) or int(rot) % 2:
        raise ValueError(
            f"partial_rotary_factor={factor} with head_dim={head_dim}: the rotary "
            "part must be a positive even number of channels"
        )
    return dict(
        routed_moe_fields(hf, n_layers),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        rotary_percent=factor,
    )


def moe_pattern_of_layer_types(hf: dict, n_layers: int) -> tuple:
    """1 = MoE, 0 = dense per layer from ``mlp_layer_types`` (``"dense"`` / ``"sparse"``;
    transformers' GLM-4-MoE-Lite and HY-V3 default: the first layer dense, the rest sparse)."""
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    if len(types) != n_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types!r}: need {n_layers} of 'dense' / 'sparse'")
    return tuple(int(t == "sparse") for t in types)


def hy_v3_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``hy_v3`` config (beyond the
    common attention fields): per-head QK RMSNorm, the sigmoid router with expert bias and
    ``router_scaling_factor``, shared experts, dense layers from ``mlp_layer_types``. Raises
    ``ValueError`` for options megatron cannot reproduce.

    ``enable_moe_fp32_combine`` (add routed and shared expert outputs in fp32, then cast) is
    accepted either way: both outputs are already in the model's dtype, and PyTorch adds two
    bf16 / fp16 tensors in fp32 and rounds once, which is what the fp32 combine does."""
    topk = int(hf["num_experts_per_tok"])
    if topk < 2:
        raise ValueError(
            f"num_experts_per_tok={topk}: transformers renormalises the chosen weight of a "
            "top-1 sigmoid router to 1, megatron's sigmoid router renormalises only when "
            "top-k > 1 (it would weight the expert by its sigmoid score)"
        )
    n_shared = int(hf.get("num_shared_experts") or 0)
    if n_shared < 1:
        raise ValueError(
            f"num_shared_experts={hf.get('num_shared_experts')!r}: transformers then builds "
            "a shared MLP of intermediate_size (its size 0 falls back to it), which the "
            "bridge's provider does not describe"
        )
    if hf.get("attention_bias"):
        raise ValueError(
            "attention_bias=True is not supported for hy_v3: transformers then biases o_proj "
            "too, which megatron-core ties to biases on every linear layer (MLPs included)"
        )
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported for hy_v3")
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(
        qk_norm=True,
        qkv_bias=False,
        num_experts=int(hf["num_experts"]),
        moe_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_norm_topk_prob=True,
        moe_layer_pattern=moe_pattern_of_layer_types(hf, n_layers),
        router_aux_loss_coef=0.0,
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_routed_scaling_factor=float(hf["router_scaling_factor"]),
        moe_shared_ffn_hidden_size=moe_ffn * n_shared,
    )


def minimax_m2_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of a ``minimax_m2`` config (beyond
    the common attention fields): the QK RMSNorm over the whole query / key projection (OLMoE's,
    :mod:`areal_mega.models.olmoe`), rotary on ``partial_rotary_factor`` (or ``rotary_dim``) of
    each head, a sigmoid router with the expert bias for the choice only and the chosen weights
    always renormalised, no shared experts, every layer MoE. Raises ``ValueError`` for options
    megatron cannot reproduce."""
    topk = int(hf["num_experts_per_tok"])
    if topk < 2:
        raise ValueError(
            f"num_experts_per_tok={topk}: transformers renormalises the chosen weight of a "
            "top-1 sigmoid router to 1, megatron's sigmoid router renormalises only when "
            "top-k > 1"
        )
    if hf.get("router_jitter_noise"):
        raise ValueError(
            f"router_jitter_noise={hf['router_jitter_noise']!r} is not supported (set it to 0)"
        )
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    rp = hf.get("rope_parameters") or {}
    if hf.get("rotary_dim"):
        factor = int(hf["rotary_dim"]) / head_dim
    else:
        factor = float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return dict(
        qk_norm=True,
        qkv_bias=False,
        rotary_percent=factor,
        num_experts=int(hf.get("num_local_experts") or hf.get("num_experts")),
        moe_topk=topk,
        moe_ffn_hidden_size=int(hf["intermediate_size"]),
        moe_norm_topk_prob=True,
        moe_layer_pattern=(1,) * n_layers,
        router_aux_loss_coef=0.0,
        moe_score_function="sigmoid",
        moe_expert_bias=True,
    )
