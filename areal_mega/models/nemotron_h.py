"""Nemotron-H (``model_type`` ``nemotron_h``): megatron-core's ``HybridModel`` (Mamba-2, attention
and MLP layers in the order of ``hybrid_override_pattern``) built from Megatron-Bridge's
``NemotronHBridge`` provider, without TransformerEngine.

The provider's own stack spec is TransformerEngine's. :func:`nemotron_h_stack_spec` is
megatron-core's local hybrid spec (``post_training.modelopt.hybrid``) with its TE-only norm
swapped for torch's RMSNorm and our packed attention
(:class:`~areal_mega.models.varlen_attention.VarlenDotProductAttention`) as core attention; the
Mamba layers run the CPU kernels of :mod:`areal_mega.compat.mamba_cpu` and the stack's final
norm is torch's (both compat patches). Packed sequences stay apart in the Mamba layers through
``PackedSeqParams.seq_idx`` (:func:`areal_mega.engine.packed_params.packed_seq_kwargs`).

Built by :func:`areal_mega.models.builder.build_model_chunks` (``HFArch.hybrid_layer_pattern``
from :func:`nemotron_h_arch_fields`); conversion and export take each layer's rows by its type
(:data:`areal_mega.checkpoint.hf_mapping.HYBRID_LAYER_ROWS`). Refused here, naming the key: MoE
layers (``E`` in the pattern), multi-token prediction, biases, a Mamba activation other than
SiLU, no convolution bias, a convolution width other than megatron's 4, fp32 residuals, a
finite ``time_step_limit``, a ``layer_norm_epsilon`` other than 1e-5 (megatron's gated Mamba
norm has it fixed), tied embeddings (transformers' Nemotron-H ties no weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from areal_mega.models.bridge_provider import ARCH_FIELDS, provider_for
from areal_mega.models.decoder_fields import decoder_fields

__all__ = [
    "nemotron_h_refusals",
    "nemotron_h_pattern",
    "nemotron_h_arch_fields",
    "nemotron_h_full_shapes",
    "nemotron_h_stage_refusal",
    "nemotron_h_stack_spec",
    "nemotron_h_config_fields",
    "nemotron_h_model",
]

#: HF config key -> (value megatron-core's mixer / our spec assumes, why a different one is refused)
_REQUIRED = {
    "mamba_hidden_act": ("silu", "megatron's Mamba mixer applies SiLU after the convolution"),
    "use_conv_bias": (True, "megatron's Mamba mixer always has a convolution bias"),
    "conv_kernel": (4, "megatron's Mamba mixer is built with its default d_conv=4"),
    "use_bias": (False, "linear biases are not mapped by the conversion"),
    "attention_bias": (False, "attention biases are not mapped by the conversion"),
    "mlp_bias": (False, "MLP biases are not mapped by the conversion"),
    "residual_in_fp32": (False, "fp32 residuals are not built"),
    "num_nextn_predict_layers": (0, "multi-token prediction layers are not built"),
    "tie_word_embeddings": (
        False,
        "transformers' Nemotron-H ties no weights: its lm_head stays apart",
    ),
    "layer_norm_epsilon": (
        1e-5,
        "megatron's Mamba mixer's gated norm has its epsilon fixed at 1e-5",
    ),
}


def nemotron_h_refusals(hf: dict) -> list:
    """Why the engine cannot build this Nemotron-H config (empty: it can), each naming the key."""
    out = []
    for key, (want, why) in _REQUIRED.items():
        got = hf.get(key, want)
        if key == "num_nextn_predict_layers":
            got = got or 0  # None in configs without MTP
        if got != want:
            out.append(f"{key}={got!r} ({why})")
    pattern = nemotron_h_pattern(hf)
    if "E" in pattern:
        out.append(f"hybrid_override_pattern={pattern!r}: MoE layers (E) are not built yet")
    limit = [_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        out.append(f"time_step_limit={list(limit)!r} (megatron's mixer does not limit dt)")
    return out


#: transformers' ``layers_block_type`` entries -> the hybrid pattern's layer letters
_LETTERS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def nemotron_h_pattern(hf: dict) -> str:
    """The config's layer pattern (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE; ``|``
    pipeline-stage separators kept): ``hybrid_override_pattern`` (hub checkpoints), else
    transformers 5's ``layers_block_type`` list, which is all its ``save_pretrained`` writes."""
    pattern = hf.get("hybrid_override_pattern")
    if pattern:
        return str(pattern)
    types = hf.get("layers_block_type") or hf.get("layer_types") or []
    unknown = sorted({t for t in types if t not in _LETTERS})
    if unknown:
        raise ValueError(f"nemotron_h: layers_block_type has unknown layer types {unknown}")
    return "".join(_LETTERS[t] for t in types)


def nemotron_h_arch_fields(hf: dict) -> dict:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a Nemotron-H config (its
    transformers defaults for omitted keys): the decoder fields, the MLP's squared ReLU without
    a gate and the layer pattern (stage separators removed). ValueError naming the keys it
    refuses (:func:`nemotron_h_refusals`)."""
    bad = nemotron_h_refusals(hf)
    if bad:
        raise ValueError("nemotron_h: " + "; ".join(bad))
    if hf.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(
            f"nemotron_h: mlp_hidden_act={hf.get('mlp_hidden_act')!r} (megatron's MLP is "
            "built with the squared ReLU)"
        )
    pattern = nemotron_h_pattern(hf).replace("|", "")
    fields = decoder_fields(
        dict(hf, num_hidden_layers=len(pattern)),
        model_type="nemotron_h",
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        eps_key="layer_norm_epsilon",
        head_dim=int(hf.get("head_dim") or 128),
    )
    return dict(
        fields,
        qkv_bias=False,
        qk_norm=False,
        activation="relu2",
        gated_mlp=False,
        hybrid_layer_pattern=pattern,
    )


def nemotron_h_stage_refusal(hf: dict, pp: int, vpp: Optional[int]) -> Optional[str]:
    """Why the layer pattern cannot be cut into ``pp`` x ``vpp`` pipeline stages (None: it can).
    megatron-core's HybridModel gives each stage one ``|``-separated segment of the pattern,
    or, without separators, an even slice per PP stage (no virtual stages then)."""
    segments = nemotron_h_pattern(hf).count("|") + 1
    stages = pp * (vpp or 1)
    if segments > 1 and segments != stages:
        return (
            f"hybrid_override_pattern has {segments} pipeline segments ('|'), "
            f"the layout PP x VPP = {stages} stages"
        )
    if segments == 1 and (vpp or 1) > 1:
        return (
            "virtual pipeline stages need '|' stage separators in hybrid_override_pattern "
            "(megatron slices a pattern without them per PP stage only)"
        )
    return None


def mamba_mixer_shapes(
    prefix: str,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state: int,
    conv_kernel: int,
    hidden: int,
) -> dict:
    """Pure: the full (un-split) shapes of megatron's Mamba-2 mixer tensors, each name
    ``prefix`` + the mixer's own (the in-projection holds z, x, B, C and dt; the convolution
    runs over x, B and C)."""
    inner = heads * head_dim
    conv = inner + 2 * groups * state
    return {
        prefix + "in_proj.weight": (2 * inner + 2 * groups * state + heads, hidden),
        prefix + "conv1d_weight": (conv, 1, conv_kernel),
        prefix + "conv1d_bias": (conv,),
        prefix + "out_proj.weight": (hidden, inner),
        prefix + "A_log": (heads,),
        prefix + "D": (heads,),
        prefix + "dt_bias": (heads,),
        prefix + "norm.weight": (inner,),
    }


def nemotron_h_full_shapes(hf: dict, hidden: int) -> dict:
    """Pure: the full (un-split) megatron shapes of a Nemotron-H config's tensor-parallel Mamba
    mixer tensors (canonical layer suffixes; the weight export's gather checks them)."""
    return mamba_mixer_shapes(
        "mixer.",
        heads=int(hf["mamba_num_heads"]),
        head_dim=int(hf["mamba_head_dim"]),
        groups=int(hf.get("n_groups", 8)),
        state=int(hf.get("ssm_state_size", 128)),
        conv_kernel=int(hf.get("conv_kernel", 4)),
        hidden=hidden,
    )


def _float(v) -> float:
    """A config float as transformers 5 writes it to JSON (``{"__float__": "Infinity"}`` for
    infinities) or plainly."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _swap(spec, table: dict):
    """``spec`` (a ``ModuleSpec`` tree, changed in place) with every module class found in
    ``table`` replaced by its value."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        spec.module = table.get(spec.module, spec.module)
        _swap(spec.submodules, table)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, type) and value in table:
                setattr(spec, f.name, table[value])
            else:
                _swap(value, table)
    return spec


def nemotron_h_stack_spec(chunk_size: int):
    """The local (no TransformerEngine) hybrid stack spec: megatron-core's modelopt local spec,
    its TE norm replaced by torch's RMSNorm and its core attention by our packed attention;
    the Mamba mixer scans in chunks of ``chunk_size`` (the checkpoint's)."""
    from megatron.core.post_training.modelopt.hybrid.model_specs import (
        _get_hybrid_stack_local_spec,
    )
    from megatron.core.post_training.modelopt.layers import Norm
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from areal_mega.models.varlen_attention import VarlenDotProductAttention

    spec = _get_hybrid_stack_local_spec(local_core_attention=True)
    _swap(spec, {Norm: WrappedTorchNorm, DotProductAttention: VarlenDotProductAttention})
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.params = {**(mixer.params or {}), "chunk_size": int(chunk_size)}
    return spec


#: the provider's fields that describe the hybrid architecture beyond :data:`ARCH_FIELDS`
HYBRID_FIELDS = (
    "is_hybrid_model",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
)


def nemotron_h_config_fields(hf: dict) -> tuple:
    """``(config_fields, model_kwargs)`` of a Nemotron-H HF config from the bridge's provider:
    the architecture fields of :data:`~areal_mega.models.bridge_provider.ARCH_FIELDS` and
    :data:`HYBRID_FIELDS`, and ``HybridModel``'s keywords (layer pattern, position embedding,
    tied embeddings, maximum length, chunk size). ValueError naming the keys it refuses."""
    bad = nemotron_h_refusals(hf)
    if bad:
        raise ValueError("nemotron_h: " + "; ".join(bad))
    if "time_step_limit" in hf:  # transformers' config class refuses its own JSON infinity
        hf = dict(hf, time_step_limit=[_float(v) for v in hf["time_step_limit"]])
    p = provider_for(hf)
    fields: dict[str, Any] = {}
    for name in (*ARCH_FIELDS, *HYBRID_FIELDS):
        value = getattr(p, name, None)
        if value is not None and name != "rotary_base":
            fields[name] = value
    pattern = p.hybrid_layer_pattern or p.hybrid_override_pattern
    model_kw = dict(
        hybrid_layer_pattern=pattern,
        position_embedding_type=p.position_embedding_type,
        share_embeddings_and_output_weights=p.share_embeddings_and_output_weights,
        max_sequence_length=p.seq_length,
        chunk_size=p.mamba_chunk_size,
    )
    fields["num_layers"] = len(pattern.replace("|", ""))
    return fields, model_kw


def nemotron_h_model(
    config,
    model_kw: dict,
    vocab_size: int,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection=None,
    vp_stage: Optional[int] = None,
):
    """megatron-core's ``HybridModel`` of ``config`` (a ``TransformerConfig`` with
    :func:`nemotron_h_config_fields`' fields and the engine's runtime fields) with the local
    stack spec; ``model_kw`` is the second part of :func:`nemotron_h_config_fields`."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    kw = dict(model_kw)
    spec = nemotron_h_stack_spec(kw.pop("chunk_size"))
    return HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=vocab_size,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        **kw,
    )
