"""EXAONE (``exaone_moe``: K-EXAONE; ``exaone4``: EXAONE 4.0) on megatron's local spec.

Both families share transformers' ``Exaone4Attention``: grouped-query attention with a per-head
QK RMSNorm, ``layer_types`` choosing per layer between sliding-window attention (window
``sliding_window``) and full attention, and rotary on the sliding layers only: when the config
has a window, its full-attention layers take no position embedding at all (NoPE); without a
window (``sliding_window: null``) every layer is full attention *with* rotary.

megatron-core expresses this per layer with two config lists, both indexed by the global
(1-based ``layer_number`` - 1) layer index, so every pipeline stage reads its own layers' entries:
``window_attn_skip_freq`` (1: the layer uses ``window_size``; read by ``DotProductAttention``,
hence by our packed attention, :mod:`areal_mega.models.varlen_attention`) and
``no_rope_freq`` (1: ``Attention.forward`` drops the rotary embedding of that layer, on every
path: packed, masked, shared-prefix). Megatron-Bridge's EXAONE-MoE provider sets both from
``layer_types``; :func:`nope_layers` and :func:`window_layers` are transformers' reading,
which ``tests/test_bridge_provider.py`` checks the provider against.

EXAONE-MoE's layer is pre-norm with DeepSeek-V3's router (sigmoid scores, the expert bias
``e_score_correction_bias`` for the choice only, group-limited top-k, the chosen weights
renormalised times ``routed_scaling_factor``), ``num_shared_experts`` shared experts and dense
layers from ``mlp_layer_types`` (default: the first ``first_k_dense_replace``), every field of
which comes from the bridge's provider.

EXAONE 4's dense layer is post-norm only: no norm before attention or the MLP, and an RMSNorm
of each sublayer's output before its residual add (``post_attention_layernorm``,
``post_feedforward_layernorm``). That is Gemma 3's post-norm slot without its pre-norms:
:func:`exaone4_block_spec` is :func:`~areal_mega.models.gemma3.post_norm_block_spec` with no
pre-norm (megatron's ``IdentityOp``) and :class:`ExaoneRMSNorm` inside the output projections
(parameter names ``self_attention.linear_proj.post_layernorm.weight`` and
``mlp.linear_fc2.post_layernorm.weight``, the bridge's registry's). The bridge's EXAONE 4
provider sets no window and no per-layer lists (its TE spec is for the all-global 1.2B model):
:data:`~areal_mega.models.bridge_provider.CORRECTIONS` sets them from :func:`window_layers` /
:func:`nope_layers`.

RoPE: the default, or ``llama3`` (real EXAONE 4 configs) with megatron's fixed constants
(``low_freq_factor`` 1, ``high_freq_factor`` 4, ``original_max_position_embeddings`` 8192:
``RotaryEmbedding._apply_scaling``, given only the factor by ``GPTModel``). Refused
(``ValueError`` naming the key): other rope types or constants, attention biases (transformers'
layers have none), activations other than SiLU, a string ``sliding_window_pattern`` without
``layer_types``. EXAONE 4's bridge registry maps no ``lm_head`` (its 1.2B model ties the
embeddings); untied configs (32B) take Llama's output-layer row
(:mod:`areal_mega.checkpoint.hf_mapping`).
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.gemma3 import (
    FULL,
    SLIDING,
    RowParallelLinearWithPostNorm,
    layer_types_and_window,
    post_norm_block_spec,
)
from areal_mega.models.moe_families import routed_moe_fields

__all__ = [
    "EXAONE_MOE_MODEL_TYPE",
    "exaone_layer_types",
    "nope_layers",
    "window_layers",
    "exaone_rope",
    "exaone_moe_arch_fields",
    "EXAONE4_MODEL_TYPE",
    "exaone4_arch_fields",
    "ExaoneRMSNorm",
    "RowParallelLinearWithExaonePostNorm",
    "exaone4_block_spec",
]

EXAONE_MOE_MODEL_TYPE = "exaone_moe"
EXAONE4_MODEL_TYPE = "exaone4"
#: llama3 rope constants megatron's RotaryEmbedding applies (it takes only the factor)
LLAMA3_CONSTANTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def exaone_layer_types(hf: dict) -> tuple:
    """``(layer_types, sliding window or None)`` as transformers reads an EXAONE config:
    ``layer_types`` when given, else every ``sliding_window_pattern``-th layer full and the
    others sliding; no window (``sliding_window: null``): every layer full attention."""
    n_layers = int(hf["num_hidden_layers"])
    if hf.get("sliding_window") is None:
        return (FULL,) * n_layers, None
    if hf.get("layer_types"):
        return layer_types_and_window(hf, [])
    pattern = hf.get("sliding_window_pattern", 4)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"sliding_window_pattern={pattern!r} without layer_types: give layer_types "
            "(transformers computes them from a positive integer pattern only)"
        )
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    return layer_types_and_window(hf, default)


def nope_layers(hf: dict) -> tuple:
    """Per layer 1 where transformers applies no rotary (full-attention layers of a config
    with a window), else 0: megatron's ``no_rope_freq``."""
    layer_types, window = exaone_layer_types(hf)
    return tuple(int(window is not None and t == FULL) for t in layer_types)


def window_layers(hf: dict) -> tuple:
    """Per layer 1 where the sliding window applies, else 0: megatron's
    ``window_attn_skip_freq`` (a list of 1s is where ``window_size`` is used)."""
    layer_types, window = exaone_layer_types(hf)
    return tuple(int(window is not None and t == SLIDING) for t in layer_types)


def exaone_rope(hf: dict) -> dict:
    """The RoPE parameters of an EXAONE config (``rope_parameters``, or the hub's
    ``rope_theta`` / ``rope_scaling``): the default type, or ``llama3`` with megatron's
    constants (:data:`LLAMA3_CONSTANTS`); ``ValueError`` naming the key otherwise."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", None, "llama3"):
        raise ValueError(
            f"rope_parameters.rope_type={kind!r} is not supported for {hf.get('model_type')} "
            "(default or llama3)"
        )
    if kind == "llama3":
        for key, want in LLAMA3_CONSTANTS.items():
            if float(rp.get(key, want)) != want:
                raise ValueError(
                    f"rope_parameters.{key}={rp[key]!r} is not supported (llama3 rope: "
                    f"megatron-core's RotaryEmbedding fixes it at {want})"
                )
        if not float(rp.get("factor", 0)) > 0:
            raise ValueError(f"rope_parameters.factor={rp.get('factor')!r}: llama3 needs one")
    rp.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    return rp


def _is_llama3(rp: dict) -> bool:
    return rp.get("rope_type", rp.get("type")) == "llama3"


def _check_attention(hf: dict) -> None:
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {hf.get('model_type')}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported (silu only)")


def _attention_fields(hf: dict) -> dict:
    _check_attention(hf)
    rp = exaone_rope(hf)
    layer_types, window = exaone_layer_types(hf)
    return dict(
        decoder_fields(
            hf, model_type=hf["model_type"], max_position_embeddings=2048, rms_norm_eps=1e-5
        ),
        rope_theta=float(rp["rope_theta"]),
        qkv_bias=False,
        qk_norm=True,
        sliding_window=window,
        layer_types=layer_types,
        rope_scaling_factor=float(rp["factor"]) if _is_llama3(rp) else 1.0,
    )


def exaone_moe_arch_fields(hf: dict) -> dict:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of an ``exaone_moe`` config
    dict. Raises ``ValueError`` naming the key of any feature this implementation lacks."""
    n_layers = int(hf["num_hidden_layers"])
    fields = _attention_fields(hf)
    k_dense = int(hf.get("first_k_dense_replace", 1) or 0)
    types = hf.get("mlp_layer_types") or ["dense"] * k_dense + ["sparse"] * (n_layers - k_dense)
    if len(types) != n_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types!r}: need {n_layers} of 'dense' / 'sparse'")
    moe = routed_moe_fields(
        dict(
            hf,
            n_routed_experts=hf["num_experts"],
            n_shared_experts=hf.get("num_shared_experts", 1),
            first_k_dense_replace=0,
        ),
        n_layers,
    )
    moe["moe_layer_pattern"] = tuple(int(t == "sparse") for t in types)
    return dict(fields, **moe)


def exaone4_arch_fields(hf: dict) -> dict:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of an ``exaone4`` config
    dict. Raises ``ValueError`` naming the key of any feature this implementation lacks."""
    return _attention_fields(hf)


class ExaoneRMSNorm(torch.nn.Module):
    """transformers' ``Exaone4RMSNorm`` with megatron's norm signature: normalised in fp32,
    cast back to the input's dtype, then scaled by ``weight`` (starts at one)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # replicated across TP: with sequence parallelism its gradient is a partial sum
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * out.type_as(x)


class RowParallelLinearWithExaonePostNorm(RowParallelLinearWithPostNorm):
    """The row-parallel output projection followed by :class:`ExaoneRMSNorm` (EXAONE 4's
    post-attention / post-feedforward norm)."""

    post_norm = ExaoneRMSNorm


def exaone4_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk) of an EXAONE 4 model: megatron's local
    layer without pre-norms, the post-norms in the output projections, per-head QK norms and
    the final norm :class:`ExaoneRMSNorm`, our packed attention (which reads the layer's
    window from ``config.window_attn_skip_freq``)."""
    from megatron.core.transformer.identity_op import IdentityOp

    from areal_mega.models.varlen_attention import VarlenDotProductAttention

    return post_norm_block_spec(
        config,
        norm=ExaoneRMSNorm,
        pre_norm=IdentityOp,
        post_linear=RowParallelLinearWithExaonePostNorm,
        core_attention=VarlenDotProductAttention,
        model_type="exaone4 models",
        use_te=use_te,
        vp_stage=vp_stage,
    )
