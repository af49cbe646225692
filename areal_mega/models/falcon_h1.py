"""Falcon-H1 (``model_type`` ``falcon_h1``): megatron-core's ``GPTModel`` whose every layer runs a
Mamba-2 mixer beside the attention, then the MLP, with transformers' muP multipliers.

Why not the bridge's model: Megatron-Bridge builds Falcon-H1 as its own ``FalconH1Model``, whose
forward takes no packed sequences (packed samples would share SSM state and attention), whose
final norm is TransformerEngine's whatever the spec, whose MLP input norm exists only inside TE's
fused norm + linear, and whose Mamba mixer is given ``norm_before_gate`` from the config, which
megatron's mixer refuses; ``tests/test_bridge_provider.py::
test_upstream_falcon_h1_model_still_lacks_what_its_not_built_reason_names`` checks those facts
and fails once upstream changes them. The architecture (sizes, Mamba sizes, multipliers) still
comes from the bridge's provider; the model here is megatron-core's ``GPTModel`` with a local
layer spec (:func:`falcon_h1_layer_spec`):

* the input norm and the pre-MLP norm are the layer's own local RMSNorms, the final norm the
  block's (transformers' ``input_layernorm``, ``pre_ff_layernorm``, ``final_layernorm``);
* :class:`FalconH1Mixer` is the layer's ``self_attention``: megatron's self-attention (our packed
  attention, :mod:`areal_mega.models.varlen_attention`) on ``x * attention_in_multiplier`` with
  the keys times ``key_multiplier``, beside megatron's ``MambaMixer`` (``mamba_mixer``), whose
  packed sequences stay apart through ``PackedSeqParams.seq_idx``; the output is
  ``mamba * ssm_out_multiplier + attention * attention_out_multiplier`` (on the CPU the mixer
  runs :mod:`areal_mega.compat.mamba_cpu`);
* the Mamba input projection (:class:`FalconH1InProj`) takes ``x * ssm_in_multiplier`` and scales
  its five sections (z, x, B, C, dt) by ``ssm_multipliers`` (transformers' ``mup_vector``), on a
  tensor-parallel rank its slice of each;
* :class:`FalconH1MLP`: ``down(up(x) * silu(gate(x) * g)) * d`` (``mlp_multipliers`` g, d);
* the embeddings are scaled by ``embedding_multiplier`` and the logits by
  ``lm_head_multiplier`` (:func:`finish_falcon_h1_model`).

Refused here, naming the key: biases, an activation other than SiLU, no convolution bias, a
``mamba_d_ssm`` other than heads x head width, a finite ``time_step_limit``, RoPE scaling, the
gated Mamba norm (``mamba_rms_norm``) with ``mamba_norm_before_gate`` (megatron's mixer gates
before its norm) or with an epsilon other than megatron's fixed 1e-5; context parallelism
(megatron's Mamba context parallelism with packed sequences is not checked here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_mega.models.bridge_provider import ARCH_FIELDS, provider_for
from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.nemotron_h import mamba_mixer_shapes

__all__ = [
    "FALCON_H1_MODEL_TYPE",
    "FalconH1Multipliers",
    "falcon_h1_normalized",
    "falcon_h1_refusals",
    "falcon_h1_arch_fields",
    "falcon_h1_config_fields",
    "falcon_h1_gpt_kwargs",
    "falcon_h1_full_shapes",
    "MAMBA_FIELDS",
    "MULTIPLIERS_ATTR",
]

FALCON_H1_MODEL_TYPE = "falcon_h1"
#: the ``TransformerConfig`` attribute that carries the multipliers to the modules
#: (:mod:`areal_mega.models.falcon_h1_layers`)
MULTIPLIERS_ATTR = "falcon_h1_multipliers"


@dataclasses.dataclass(frozen=True)
class FalconH1Multipliers:
    """transformers' Falcon-H1 muP multipliers (the bridge's provider's fields)."""

    embedding: float = 1.0
    lm_head: float = 1.0
    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt sections of the Mamba in_proj
    mlp: tuple = (1.0, 1.0)  # gate (before the activation), down (after the projection)


def _float(v) -> float:
    """A config float as transformers 5 writes it to JSON (``{"__float__": "Infinity"}``)."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def falcon_h1_normalized(hf: dict) -> dict:
    """``hf`` with ``time_step_limit`` as plain floats (transformers' config class refuses the
    JSON form of infinity it writes itself)."""
    if hf.get("time_step_limit") is None:
        return dict(hf)
    return dict(hf, time_step_limit=[_float(v) for v in hf["time_step_limit"]])


#: HF config key -> (value megatron-core's modules / our conversion assume, why another is refused)
_REQUIRED = {
    "hidden_act": ("silu", "megatron's Mamba mixer applies SiLU, and the MLP here is SiLU-gated"),
    "mamba_conv_bias": (True, "megatron's Mamba mixer always has a convolution bias"),
    "mamba_proj_bias": (False, "megatron's Mamba mixer has no projection biases"),
    "projectors_bias": (False, "linear biases are not mapped by the conversion"),
    "attention_bias": (False, "attention biases are not mapped by the conversion"),
    "mlp_bias": (False, "MLP biases are not mapped by the conversion"),
}


def falcon_h1_refusals(hf: dict) -> list:
    """Why the engine cannot build this Falcon-H1 config (empty: it can), each naming the key."""
    out = []
    for key, (want, why) in _REQUIRED.items():
        got = hf.get(key, want)
        if got != want:
            out.append(f"{key}={got!r} ({why})")
    heads, head_dim = int(hf.get("mamba_n_heads", 128)), int(hf.get("mamba_d_head", 64))
    d_ssm = hf.get("mamba_d_ssm")
    if d_ssm is None:
        d_ssm = int(hf.get("mamba_expand", 2) * int(hf["hidden_size"]))
    if int(d_ssm) != heads * head_dim:
        out.append(
            f"mamba_d_ssm={d_ssm} (megatron's Mamba mixer's width is mamba_n_heads x "
            f"mamba_d_head = {heads * head_dim})"
        )
    if heads % int(hf.get("mamba_n_groups", 1)):
        out.append("mamba_n_heads is not a multiple of mamba_n_groups")
    limit = [_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        out.append(f"time_step_limit={limit!r} (megatron's mixer does not limit dt)")
    if hf.get("mamba_rms_norm"):
        if hf.get("mamba_norm_before_gate", True):
            out.append(
                "mamba_rms_norm=True with mamba_norm_before_gate=True (megatron's Mamba mixer "
                "gates before its norm)"
            )
        if float(hf.get("rms_norm_eps", 1e-5)) != 1e-5:
            out.append(
                f"rms_norm_eps={hf.get('rms_norm_eps')} with mamba_rms_norm=True (megatron's "
                "gated Mamba norm has its epsilon fixed at 1e-5)"
            )
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", None):
        out.append(f"rope_parameters.rope_type={kind!r} (plain RoPE only)")
    return out


def falcon_h1_arch_fields(hf: dict) -> dict:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a Falcon-H1 config (its
    transformers defaults for omitted keys). ValueError naming the keys it refuses
    (:func:`falcon_h1_refusals`)."""
    bad = falcon_h1_refusals(hf)
    if bad:
        raise ValueError("falcon_h1: " + "; ".join(bad))
    heads = int(hf["num_attention_heads"])
    fields = decoder_fields(
        hf,
        model_type=FALCON_H1_MODEL_TYPE,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
    )
    return dict(fields, qkv_bias=False, qk_norm=False, mamba_beside_attention=True)


def _multipliers(p) -> FalconH1Multipliers:
    return FalconH1Multipliers(
        embedding=float(p.embedding_multiplier),
        lm_head=float(p.lm_head_multiplier),
        key=float(p.key_multiplier),
        attention_in=float(p.attention_in_multiplier),
        attention_out=float(p.attention_out_multiplier),
        ssm_in=float(p.ssm_in_multiplier),
        ssm_out=float(p.ssm_out_multiplier),
        ssm=tuple(float(v) for v in p.ssm_multipliers),
        mlp=tuple(float(v) for v in p.mlp_multipliers),
    )


#: the provider's Mamba fields (``TransformerConfig`` fields megatron's mixer reads)
MAMBA_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def falcon_h1_config_fields(hf: dict) -> tuple:
    """``(config_fields, multipliers, mixer_params)`` of a Falcon-H1 HF config from the bridge's
    provider: the architecture fields of
    :data:`~areal_mega.models.bridge_provider.ARCH_FIELDS` and :data:`MAMBA_FIELDS`, the
    :class:`FalconH1Multipliers`, and the Mamba mixer's keywords (convolution width, scan chunk,
    gated norm). ValueError naming the keys it refuses."""
    hf = falcon_h1_normalized(hf)
    bad = falcon_h1_refusals(hf)
    if bad:
        raise ValueError("falcon_h1: " + "; ".join(bad))
    p = provider_for(hf)
    fields: dict[str, Any] = {}
    for name in (*ARCH_FIELDS, *MAMBA_FIELDS):
        value = getattr(p, name, None)
        if value is not None and name != "rotary_base":
            fields[name] = value
    mixer = dict(d_conv=int(p.d_conv), chunk_size=int(p.chunk_size), rmsnorm=bool(p.rmsnorm))
    return fields, _multipliers(p), mixer


def falcon_h1_gpt_kwargs(hf: dict, arch) -> dict:
    """``GPTModel``'s keywords of a Falcon-H1 config: tied embeddings and the maximum length
    from the bridge's provider; the rotary base is the config's own (the bridge's provider
    rounds it to an integer)."""
    p = provider_for(falcon_h1_normalized(hf))
    return dict(
        rotary_base=float(arch.rope_theta),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=bool(p.share_embeddings_and_output_weights),
        max_sequence_length=int(p.seq_length),
        position_embedding_type="rope",
    )


#: the Mamba mixer's tensors (megatron names within a layer)
_MIXER = "self_attention.mamba_mixer."


def falcon_h1_full_shapes(hf: dict, hidden: int) -> dict:
    """Pure: the full (un-split) megatron shapes of a Falcon-H1 config's tensor-parallel Mamba
    mixer tensors (canonical layer suffixes; the weight export's gather checks them)."""
    return mamba_mixer_shapes(
        _MIXER,
        heads=int(hf["mamba_n_heads"]),
        head_dim=int(hf["mamba_d_head"]),
        groups=int(hf.get("mamba_n_groups", 1)),
        state=int(hf.get("mamba_d_state", 256)),
        conv_kernel=int(hf.get("mamba_d_conv", 4)),
        hidden=hidden,
    )
