"""EXAONE (``exaone_moe``: K-EXAONE; ``exaone4``: EXAONE 4.0): HF config facts and refusals.

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
which comes from the bridge's provider. Refused (``ValueError`` naming the key): rope types
other than default, attention biases (transformers' layers have none), activations other than
SiLU, a string ``sliding_window_pattern`` without ``layer_types``.
"""

from __future__ import annotations

from typing import Any

from areal_mega.models.gemma3 import FULL, SLIDING, layer_types_and_window
from areal_mega.models.moe_families import routed_moe_fields

__all__ = [
    "EXAONE_MOE_MODEL_TYPE",
    "exaone_layer_types",
    "nope_layers",
    "window_layers",
    "exaone_rope",
    "exaone_moe_arch_fields",
]

EXAONE_MOE_MODEL_TYPE = "exaone_moe"


def exaone_layer_types(hf: dict) -> tuple:
    """``(layer_types, sliding window or None)`` as transformers reads an EXAONE config:
    ``layer_types`` when given, else every ``sliding_window_pattern``-th layer full and the
    others sliding; no window (``sliding_window: null``): every layer full attention."""
    n_layers = int(hf["num_hidden_layers"])
    if hf.get("sliding_window") is None:
        return (FULL,) * n_layers, None
    pattern = hf.get("sliding_window_pattern", 4)
    if not hf.get("layer_types") and (isinstance(pattern, bool) or not isinstance(pattern, int)):
        raise ValueError(
            f"sliding_window_pattern={pattern!r} without layer_types: give layer_types "
            "(transformers computes them from an integer pattern only)"
        )
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)] if pattern else []
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
    ``rope_theta`` / ``rope_scaling``), which must be the default type (``ValueError`` naming
    the key otherwise)."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(
            f"rope_parameters.rope_type={kind!r} is not supported for {hf.get('model_type')} "
            "(default only)"
        )
    rp.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    return rp


def _check_attention(hf: dict) -> None:
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {hf.get('model_type')}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported (silu only)")


def _attention_fields(hf: dict) -> dict[str, Any]:
    _check_attention(hf)
    rp = exaone_rope(hf)
    layer_types, window = exaone_layer_types(hf)
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    return dict(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(rp["rope_theta"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=True,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        sliding_window=window,
        layer_types=layer_types,
    )


def exaone_moe_arch_fields(hf: dict) -> dict[str, Any]:
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
