"""Megatron-Bridge's model providers as our HF config -> megatron ``TransformerConfig`` translator.

Megatron-Bridge describes every family it maps with a *provider*: ``AutoBridge.from_hf_config
(config).to_megatron_provider(load_weights=False)`` reads an HF config (no weights) and returns
a ``GPTModelProvider`` (a ``TransformerConfig`` subclass) carrying the family's architecture:
sizes, norms, activation, biases, QK norm, window, router, shared experts, multi-latent
attention, rotary base and share. The engine takes those *architecture fields* from it
(:data:`ARCH_FIELDS`, :data:`GPT_FIELDS`) and adds its own *runtime fields* (parallel sizes of
our mesh, dtype, CPU/GPU fusions, dispatcher, initialisation on CPU, MoE training policy),
which :func:`~areal_mega.models.builder.transformer_config_from_hf` decides as before. The
layer spec stays ours (:func:`~areal_mega.models.builder.layer_spec_for`): the providers'
default spec is TransformerEngine's, which the CPU lacks (megatron-core's local spec with our
packed attention, :mod:`areal_mega.models.varlen_attention`, runs on both).

Families (``model_type``):

* :data:`PROVIDER_FAMILIES`: architecture from the bridge's provider;
* :data:`HYBRID_FAMILIES`: Mamba hybrids (megatron-core's ``HybridModel``; Falcon-H1's
  parallel Mamba / attention layers), architecture from the bridge's provider read by the
  family's own module;
* :data:`OWN_TRANSLATOR`: our translator kept, the reason given per family;
* :data:`CORRECTIONS`: a provider field the bridge gets wrong for some configs, corrected
  here; ``tests/test_bridge_provider.py`` fails once upstream fixes it (then drop the entry);
* :data:`INPUT_CORRECTIONS`: a key a provider reads that the family's transformers config does
  not have, filled in (from what transformers reads) before the provider is built; the same
  test file fails once upstream no longer needs it.

Importing Megatron-Bridge whole takes about 7-20 s of CPU (it imports every family, and
``megatron.training``): a provider is read with its family's bridge imported alone
(:mod:`areal_mega.compat.bridge_import`). The fields read from a
provider are plain data, so :func:`provider_arch_fields` keeps them in a disk cache keyed by
their inputs' content (the HF config, the versions of Megatron-Bridge, megatron-core and
transformers, and this file), in ``$AREAL_MEGA_CACHE_DIR`` or ``~/.cache/areal_mega``: a
process that builds a model another process already built imports no bridge.
``AREAL_MEGA_CACHE_DIR=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from areal_mega.common.files import atomic_write
from areal_mega.compat import bridge_import
from areal_mega.models.moe_families import minimax_m2_fields, moe_pattern_of_layer_types

__all__ = [
    "ARCH_FIELDS",
    "GPT_FIELDS",
    "PROVIDER_FAMILIES",
    "VL_END_TO_END",
    "VL_NOT_RL",
    "VL_PROVIDER_FAMILIES",
    "VL_NOT_BUILT",
    "VL_RL_FAMILIES",
    "HYBRID_FAMILIES",
    "OWN_TRANSLATOR",
    "CORRECTIONS",
    "INPUT_CORRECTIONS",
    "GPU_ONLY",
    "gpu_only_reason",
    "NOT_BUILT",
    "not_built_reason",
    "uses_provider",
    "hf_config_object",
    "provider_for",
    "provider_arch_fields",
    "provider_cache_dir",
]

log = logging.getLogger(__name__)

#: ``TransformerConfig`` fields that describe the architecture: read from the provider
ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "init_method_std",
    "window_size",
    "window_attn_skip_freq",  # per layer: 1 = the window applies (EXAONE's sliding layers)
    "no_rope_freq",  # per layer: 1 = no rotary (NoPE; EXAONE's full-attention layers)
    "softmax_scale",
    "rotary_interleaved",
    # MoE
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    # multi-latent attention (MLATransformerConfig)
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_base",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    # GPT-OSS: attention sinks, per-layer windows, the clamped GLU with an offset
    "softmax_type",
    "window_attn_skip_freq",
    "glu_linear_offset",
    "activation_func_clamp_value",
    # multimodal RoPE (Qwen2.5-VL): rotary channels per axis (temporal, height, width)
    "mrope_section",
    # Qwen3-Next: gated delta-net layers, the attention output gate, the shared expert's gate
    "experimental_attention_variant",
    "linear_attention_freq",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "attention_output_gate",
    "moe_shared_expert_gate",
    # DeepSeek sparse attention (GLM-5): the indexer
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_topk",
    "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset",
    "dsa_indexer_rope_interleaved",
    "dsa_indexer_rotate_activation",
    "dsa_indexer_scoring_relu",
    "dsa_indexer_k_norm_epsilon",
)
#: ``GPTModel`` constructor arguments the provider carries (provider field -> GPTModel keyword)
GPT_FIELDS = {
    "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "share_embeddings_and_output_weights": "share_embeddings_and_output_weights",
    "seq_length": "max_sequence_length",
    "position_embedding_type": "position_embedding_type",
    # llama3 RoPE scaling (EXAONE; megatron's fixed constants, areal_mega/models/exaone.py)
    "rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
}

#: families whose architecture comes from the bridge's provider
PROVIDER_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "gemma",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "hy_v3",
    "nemotron",
    "olmoe",
    "minimax_m2",
    "gpt_oss",
    "ernie4_5_moe",
    "exaone_moe",
    "exaone4",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
)

#: vision-language families: the whole model (vision tower, projector, multimodal RoPE and the
#: language model's architecture) is the bridge's provider's (:mod:`areal_mega.models.vlm`;
#: Qwen3-VL's model classes built on megatron-core's local layers, the bridge's provider
#: building them from TransformerEngine's only: :mod:`areal_mega.models.vlm.qwen3_vl`)
VL_PROVIDER_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
#: the vision-language families RL runs end to end on the CPU (images through the rollout
#: server, the workflow, the data plane and the trainer), and what the family table says of them
VL_RL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
VL_END_TO_END = (
    "vision-language: the engine builds it from the bridge's provider and trains it (DP, TP "
    "with SP, PP), the CPU server runs transformers' model with SGLang's image_data, and RL "
    "with images runs end to end with server logprobs equal to the trainer's (tested at one "
    "rank; DP2, trainer TP2 and PP2 and the distributed weight update on Qwen2.5-VL; the "
    "weight export at TP2 and PP2 bit for bit on both)"
)
#: why a vision-language family the trainer builds is not an RL family yet
VL_NOT_RL = (
    "vision-language: the trainer engine builds it from the bridge's provider, converts it bit "
    "for bit and trains it (DP, TP with SP, PP; forward equal to transformers with images), but "
    "its CPU serving with images and an RL run are not checked for this family"
)

#: hybrid (Mamba) families: their architecture comes from the bridge's provider too, read with
#: the Mamba fields by their own module: Nemotron-H, megatron-core's HybridModel
#: (areal_mega/models/nemotron_h.py); Falcon-H1, GPTModel layers with a Mamba mixer beside the
#: attention (areal_mega/models/falcon_h1.py says why not the bridge's own FalconH1Model)
HYBRID_FAMILIES = ("nemotron_h", "falcon_h1")

#: families that keep our translator, and why
OWN_TRANSLATOR = {
    "gemma3_text": (
        "the bridge's Gemma 3 provider puts the per-layer window and RoPE base into its "
        "TransformerEngine layer spec (gemma3_layer_spec) and one window_size for every layer "
        "in the config; on the local spec a config-only translation would apply the window "
        "to the full-attention layers too. Our Gemma3Config carries the per-layer choice "
        "(areal_mega/models/gemma3.py)"
    ),
    "gemma2": (
        "as gemma3_text (one window_size for every layer in the provider's config), and the "
        "provider's attention soft-cap lives in its own FlexAttention module, not in a config "
        "field megatron-core's attention reads; our Gemma3Config carries the per-layer window "
        "and the cap (areal_mega/models/gemma2.py)"
    ),
    "gemma4_text": (
        "Megatron-Bridge's Gemma4DenseProvider builds the dense model from its own modules, "
        "which differ from transformers where our Gemma4Config does not: its full-attention "
        "layers take num_global_key_value_heads without attention_k_eq_v (transformers: only "
        "with it), its value norm's epsilon is fixed at 1e-6, its per-layer-input gate and "
        "projection are not marked sequence-parallel (partial gradients under TP with SP), "
        "its checkpoint keeps dead k/v rows on the key/value-shared layers, and it threads "
        "the per-layer inputs by replacing the model's and the decoder's forward per instance; "
        "its provider refuses PP; ours builds each layer with its own QKV shape "
        "(areal_mega/models/gemma4.py), sends the keys / values and per-layer inputs later "
        "stages read with the hidden state under PP and relays their gradients under full "
        "activation recompute. The MoE variant's "
        "provider (Gemma4ModelProvider) builds on TransformerEngine's layer spec (its registry "
        "names TE's fused norms); ours adds the MoE block to the same layers (Gemma4MoELayer)"
    ),
}


def _tied(hf: dict, fields: dict, gpt: dict) -> None:
    """Tied embeddings as the config says (transformers' default when it says nothing)."""
    gpt["share_embeddings_and_output_weights"] = bool(hf_config_object(hf).tie_word_embeddings)


def _deepseek_v3(hf: dict, fields: dict, gpt: dict) -> None:
    """DeepSeek-V3 without ``rope_scaling``: the bridge leaves megatron's MLA default
    ``rope_type="yarn"`` (with factor 1.0); transformers applies plain RoPE, which is megatron's
    ``rope_type="rope"`` (the path our CPU packed-RoPE patch and the family tests cover)."""
    _tied(hf, fields, gpt)
    rs = hf.get("rope_scaling") or {}
    rp = hf.get("rope_parameters") or {}
    kind = rs.get("type", rs.get("rope_type")) or rp.get("rope_type", "default")
    if kind in (None, "default") and fields.get("rope_type") == "yarn":
        fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)


def _glm4_moe_lite(hf: dict, fields: dict, gpt: dict) -> None:
    """GLM-4-MoE-Lite: as DeepSeek-V3, and the dense layers of ``mlp_layer_types``."""
    _deepseek_v3(hf, fields, gpt)
    _dense_layers_of_layer_types(hf, fields, gpt)


def _glm_moe_dsa(hf: dict, fields: dict, gpt: dict) -> None:
    """GLM-MoE-DSA: as GLM-4-MoE-Lite, and megatron's top-k sharing schedule of
    ``indexer_types`` (:func:`areal_mega.models.dsa.indexer_share_schedule`)."""
    from areal_mega.models.dsa import indexer_share_schedule, indexer_types_of

    _glm4_moe_lite(hf, fields, gpt)
    freq, offset = indexer_share_schedule(indexer_types_of(hf))
    fields["dsa_indexer_topk_freq"], fields["dsa_indexer_skip_topk_offset"] = freq, offset


def _dense_layers_of_layer_types(hf: dict, fields: dict, gpt: dict) -> None:
    """The dense layers of ``mlp_layer_types`` (transformers' default: the first one)."""
    fields["moe_layer_freq"] = list(moe_pattern_of_layer_types(hf, int(hf["num_hidden_layers"])))


def _qwen3_moe_dense_layers(hf: dict, fields: dict, gpt: dict) -> None:
    """Qwen3-MoE with dense layers: transformers makes layer i dense when it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``; the bridge makes every layer MoE."""
    n = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(n)]
    fields["moe_layer_freq"] = pattern


def _olmoe(hf: dict, fields: dict, gpt: dict) -> None:
    """OLMoE: tied embeddings as the config says; with ``norm_topk_prob`` transformers
    renormalises the chosen softmax weights, which is megatron's top-k then softmax
    (``moe_router_pre_softmax=False``)."""
    _tied(hf, fields, gpt)
    if hf.get("norm_topk_prob"):
        fields["moe_router_pre_softmax"] = False


def _minimax_m2_rotary(hf: dict, fields: dict, gpt: dict) -> None:
    """MiniMax-M2's rotary share: ``rotary_dim`` (hub configs) or, in a config transformers
    saved, ``rope_parameters.partial_rotary_factor``."""
    gpt["rotary_percent"] = minimax_m2_fields(hf, int(hf["num_hidden_layers"]))["rotary_percent"]


def _qwen3_next(hf: dict, fields: dict, gpt: dict) -> None:
    """Qwen3-Next: the dense layers as transformers reads them (as Qwen3-MoE), the rotary
    share of ``rope_parameters``."""
    from areal_mega.models.qwen3_next import rotary_share

    _qwen3_moe_dense_layers(hf, fields, gpt)
    gpt["rotary_percent"] = rotary_share(hf)


def _gpt_oss(hf: dict, fields: dict, gpt: dict) -> None:
    """GPT-OSS: YaRN, the sliding layers and tied embeddings as the config says."""
    from areal_mega.models.gpt_oss import correct_provider_fields

    _tied(hf, fields, gpt)
    correct_provider_fields(hf, fields, gpt)


def _ernie4_5_moe(hf: dict, fields: dict, gpt: dict) -> None:
    """Ernie 4.5 MoE: a softmax router whose expert bias and renormalisation are
    :class:`~areal_mega.models.ernie4_5_moe.ErnieTopKRouter`'s (megatron's config refuses an
    expert bias on softmax scores), the dense layers of transformers' start / end / interval
    rule, the rotary base of the config, no shared experts when it has none."""
    from areal_mega.models.ernie4_5_moe import ernie_moe_layer_pattern

    gpt["rotary_base"] = float(hf_config_object(hf).rope_parameters["rope_theta"])
    fields["moe_layer_freq"] = list(ernie_moe_layer_pattern(hf, int(hf["num_hidden_layers"])))
    fields.update(
        moe_router_score_function="softmax",
        moe_router_pre_softmax=True,
        moe_router_enable_expert_bias=False,
    )
    if not fields.get("moe_shared_expert_intermediate_size"):
        fields.pop("moe_shared_expert_intermediate_size", None)


def _exaone4_layers(hf: dict, fields: dict, gpt: dict) -> None:
    """EXAONE 4's window and rotary per layer, as transformers reads them: the sliding layers'
    window, no rotary on the full-attention layers of a config with a window."""
    from areal_mega.models.exaone import exaone_layer_types, nope_layers, window_layers
    from areal_mega.models.sliding_window import mcore_window_size

    window = exaone_layer_types(hf)[1]
    nope = list(nope_layers(hf))
    fields["window_size"] = mcore_window_size(window)
    fields["window_attn_skip_freq"] = list(window_layers(hf)) if window is not None else None
    fields["no_rope_freq"] = nope if any(nope) else None


def _qwen25_vl_mrope(hf: dict, fields: dict, gpt: dict) -> None:
    """Qwen2.5-VL: the multimodal RoPE sections of the config (its text config's
    ``rope_parameters``, where transformers reads them)."""
    text = hf_config_object(hf).text_config
    fields["mrope_section"] = [int(x) for x in text.rope_parameters["mrope_section"]]


_UNTIED = (
    "the provider sets share_embeddings_and_output_weights=False whatever tie_word_embeddings says"
)

#: model_type -> (why, correction of the provider's fields and GPTModel keywords in place, given
#: the HF config)
CORRECTIONS: Dict[str, Tuple[str, Callable[[dict, dict, dict], None]]] = {
    "deepseek_v3": (
        "a config without rope_scaling keeps MLATransformerConfig's default rope_type 'yarn' "
        "(factor 1.0) where transformers applies plain RoPE; " + _UNTIED,
        _deepseek_v3,
    ),
    "deepseek_v2": (
        "as deepseek_v3 (default rope_type 'yarn' without rope_scaling; embeddings untied)",
        _deepseek_v3,
    ),
    "ernie4_5_moe": (
        "the provider describes a sigmoid router with megatron's expert bias (transformers: "
        "softmax scores, the bias added for the choice only, the chosen scores renormalised), "
        "a fixed rotary_base of 500000 whatever the config's rope_theta, MoE layers from "
        "moe_layer_start_index only (transformers also reads moe_layer_interval and "
        "moe_layer_end_index), a shared-expert size of 0 when there are none",
        _ernie4_5_moe,
    ),
    "exaone4": (
        "the provider sets no window_size, window_attn_skip_freq nor no_rope_freq (its TE "
        "layer spec is for the all-global-attention 1.2B model): a config with sliding "
        "layers would get full attention with rotary everywhere",
        _exaone4_layers,
    ),
    "glm4_moe": (_UNTIED, _tied),
    "glm4_moe_lite": (
        "as deepseek_v3, and the dense layers come from first_k_dense_replace (default 1), "
        "which this config does not have: transformers reads mlp_layer_types",
        _glm4_moe_lite,
    ),
    "glm_moe_dsa": (
        "as glm4_moe_lite: the dense layers come from first_k_dense_replace (default 3), "
        "transformers reads mlp_layer_types; the indexer's top-k sharing comes from "
        "index_topk_freq and index_skip_topk_offset with default offset 0, transformers reads "
        "indexer_types (made from the same keys with default offset 2): index_topk_freq 2 "
        "alone shares the wrong layers",
        _glm_moe_dsa,
    ),
    "hy_v3": (
        "the provider makes the first first_k_dense_replace layers dense (a key HYV3Config "
        "does not have: INPUT_CORRECTIONS fills it in); transformers reads mlp_layer_types, "
        "which may put dense layers anywhere",
        _dense_layers_of_layer_types,
    ),
    "minimax_m2": (
        "the provider takes the rotary share from rotary_dim only (hub configs); a config "
        "transformers saved has rope_parameters.partial_rotary_factor instead, which the "
        "provider ignores (rotary_percent 1.0: rotary on every channel)",
        _minimax_m2_rotary,
    ),
    "olmoe": (
        "the provider sets moe_router_pre_softmax=True whatever norm_topk_prob says "
        "(transformers renormalises the chosen weights when it is true); " + _UNTIED,
        _olmoe,
    ),
    "gpt_oss": (
        "the provider writes the released models' YaRN constants (factor 32 over 4096 "
        "positions, betas 32 / 1) and alternates sliding / full layers from layer 0, whatever "
        "rope_parameters and layer_types say; " + _UNTIED,
        _gpt_oss,
    ),
    "qwen2_5_vl": (
        "the provider keeps its default mrope_section [16, 24, 24] (the released models' "
        "head dim 128) whatever the config's rope_parameters say: another head dim fails in "
        "the rotary embedding's split (or rotates the wrong channels per axis)",
        _qwen25_vl_mrope,
    ),
    "qwen3_moe": (
        "the provider sets decoder_sparse_step=1 and ignores mlp_only_layers: every layer "
        "becomes MoE where transformers builds dense MLP layers",
        _qwen3_moe_dense_layers,
    ),
    "qwen3_next": (
        "as qwen3_moe (the provider makes every layer MoE; transformers reads "
        "decoder_sparse_step and mlp_only_layers); the provider takes the rotary share from "
        "the top-level partial_rotary_factor, transformers from "
        "rope_parameters.partial_rotary_factor when the config has it",
        _qwen3_next,
    ),
}


def _leading_dense_layers(hf: dict) -> dict:
    """HY-V3: ``first_k_dense_replace`` (read by the bridge's provider, which raises without
    it) as the number of leading dense layers of ``mlp_layer_types``, unless the config has
    it; the layer pattern itself is :data:`CORRECTIONS`' (from ``mlp_layer_types``)."""
    if "first_k_dense_replace" in hf:
        return hf
    pattern = moe_pattern_of_layer_types(hf, int(hf["num_hidden_layers"]))
    k = pattern.index(1) if 1 in pattern else len(pattern)
    return dict(hf, first_k_dense_replace=k)


def _indexer_rope_half_split(hf: dict) -> dict:
    """GLM-MoE-DSA: ``indexer_rope_interleave`` (read by the bridge's provider, which raises
    without it) as transformers applies it, the half-split layout, unless the config has it."""
    return hf if "indexer_rope_interleave" in hf else dict(hf, indexer_rope_interleave=False)


#: model_type -> (why, the config dict the provider is built from, given the HF config); the
#: disk cache stays keyed by the config as given
INPUT_CORRECTIONS: Dict[str, Tuple[str, Callable[[dict], dict]]] = {
    "glm_moe_dsa": (
        "the provider reads indexer_rope_interleave, which GlmMoeDsaConfig does not have "
        "(transformers' indexer always rotates in the half-split layout): AttributeError for "
        "a config saved by transformers",
        _indexer_rope_half_split,
    ),
    "hy_v3": (
        "the provider reads first_k_dense_replace, which HYV3Config does not have "
        "(transformers reads mlp_layer_types): AttributeError for a config saved by "
        "transformers",
        _leading_dense_layers,
    ),
}


#: model types whose layers need megatron-core kernels that exist for CUDA only: the CPU
#: refuses them naming why (none at present: megatron-core 0.19's DeepSeek sparse attention,
#: the last one listed, runs in torch on every device, areal_mega/models/dsa.py)
GPU_ONLY: Dict[str, str] = {}


_VLM = (
    "a vision-language model: the engine builds text decoders only (vision-language RL is "
    "open work)"
)
#: causal LMs (or their vision-language wrappers) that transformers runs and the bridge maps
#: but the engine does not build, with the reason read from transformers' modelling code
#: against megatron-core's layers; the CPU refuses them naming it
NOT_BUILT = {
    "deepseek_v4": (
        "megatron-core 0.19.2 (pinned) does not build its attention: Megatron-Bridge's "
        "provider asks for experimental_attention_variant='dsv4_hybrid' (DeepSeek-V4's "
        "compressed and sparse attention with hyper-connections), which this megatron-core's "
        "TransformerConfig does not accept (gated_delta_net and dsa only) on any device"
    ),
    "qwen3_5_moe": (
        _VLM + "; its text model (model_type qwen3_5_moe_text, Qwen3_5MoeForCausalLM: what "
        "AutoModelForCausalLM saves from it) is built"
    ),
    "gemma3": _VLM,
    "qwen3_5": (
        _VLM + "; its text model (model_type qwen3_5_text, Qwen3_5ForCausalLM: what "
        "AutoModelForCausalLM saves from it) is built"
    ),
    "gemma4": _VLM,
    "qwen3_vl_moe": (
        "vision-language MoE: the engine builds the dense Qwen3-VL (qwen3_vl: the bridge's "
        "Qwen3VLModel on megatron-core's local layers, areal_mega/models/vlm/qwen3_vl.py), not "
        "its MoE language model: the bridge's provider gives it TransformerEngine's grouped-GEMM "
        "expert spec, and transformers stores each layer's experts packed in one tensor "
        "(mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden], down_proj), which our "
        "vision-language conversion has no rows for"
    ),
}

#: vision-language families of :data:`NOT_BUILT` (the family table names them by transformers'
#: image-text-to-text class: they have no causal-LM class)
VL_NOT_BUILT = ("qwen3_vl_moe",)


def not_built_reason(model_type: str):
    """Why the engine does not build ``model_type`` although transformers runs it and the bridge
    maps it (None when that is not known: not a family the bridge maps, or one we build)."""
    return NOT_BUILT.get(model_type)


def gpu_only_reason(model_type: str):
    """Why ``model_type`` needs GPU-only kernels (None when it does not)."""
    return GPU_ONLY.get(model_type)


def uses_provider(model_type: str) -> bool:
    """Whether ``model_type``'s architecture fields come from the bridge's provider."""
    return model_type in PROVIDER_FAMILIES


def hf_config_object(hf: dict):
    """transformers' ``PretrainedConfig`` of a config dict, its ``architectures`` the family's
    causal-LM class (a vision-language family's image-text-to-text class) when absent or not a
    causal LM (a critic's or reward model's
    ``*ForSequenceClassification``: the decoder is the same, and the bridge dispatches on
    causal-LM classes only)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    hf = dict(hf)
    mt = hf.pop("model_type")
    archs = hf.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
        hf["architectures"] = [
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[mt]
            if mt in VL_PROVIDER_FAMILIES
            else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]
        ]
    return AutoConfig.for_model(mt, **hf)


def _import_auto_bridge(model_type: Optional[str] = None):
    """``AutoBridge``, with ``model_type``'s bridge registered: that family's module of
    :data:`~areal_mega.compat.bridge_import.FAMILY_MODULES` alone, or every family
    (``model_type`` None or not in the table). Imported without touching this process's
    logging: the bridge imports ``megatron.training``, whose import calls
    ``logging.basicConfig`` with a handler on stdout at INFO, which would print the bridge's
    notices into a command's output (e.g. ``doctor --json``). The root logger's handlers and
    level are put back as they were."""
    from areal_mega.compat.megatron_cpu import install_te_placeholder

    install_te_placeholder()  # importing the bridge needs it where TransformerEngine is absent
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if model_type in bridge_import.FAMILY_MODULES:
                bridge_import.import_bridge_modules(bridge_import.FAMILY_MODULES[model_type])
            else:
                bridge_import.import_whole_bridge()
            from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return AutoBridge


@functools.lru_cache(maxsize=32)
def _provider(hf_json: str):
    hf = json.loads(hf_json)
    AutoBridge = _import_auto_bridge(hf.get("model_type"))
    fix = INPUT_CORRECTIONS.get(hf.get("model_type"))
    if fix is not None:
        hf = fix[1](hf)
    cfg = hf_config_object(hf)
    with contextlib.redirect_stdout(sys.stderr):
        return AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)


def provider_for(hf: dict):
    """The bridge's (unfinalised) provider of an HF config dict (:data:`INPUT_CORRECTIONS`
    applied); cached per config. Treat it as read-only."""
    return _provider(json.dumps(hf, sort_keys=True, default=str))


def provider_arch_fields(hf: dict) -> Tuple[dict, dict, bool]:
    """``(config_fields, gpt_kwargs, is_mla)`` of an HF config dict from the bridge's provider:
    the :data:`ARCH_FIELDS` it has (None values dropped: megatron derives them, e.g.
    ``kv_channels``), the ``GPTModel`` keywords of :data:`GPT_FIELDS`, and whether it is a
    multi-latent-attention config. :data:`CORRECTIONS` applied. Read from the disk cache
    (:func:`provider_cache_dir`) when an earlier process computed them for the same inputs."""
    hf_json = json.dumps(hf, sort_keys=True, default=str)
    cached = _read_cached(hf_json)
    if cached is None:
        cached = _fields_of_provider(provider_for(hf))
        _write_cached(hf_json, cached)
    fields, gpt, is_mla = cached
    fix = CORRECTIONS.get(hf.get("model_type"))
    if fix is not None:
        fix[1](hf, fields, gpt)
    return fields, gpt, is_mla


def _fields_of_provider(p) -> Tuple[dict, dict, bool]:
    is_mla = bool(getattr(p, "multi_latent_attention", False))
    fields: Dict[str, Any] = {}
    for name in ARCH_FIELDS:
        if not hasattr(p, name):
            continue
        value = getattr(p, name)
        if value is None:
            continue
        if name == "rotary_base" and not is_mla:
            continue  # a GPTModel argument for non-MLA models
        fields[name] = value
    if fields.get("window_size") is not None:
        fields["window_size"] = tuple(fields["window_size"])
    if isinstance(fields.get("moe_layer_freq"), int) and fields.get("num_moe_experts"):
        freq = fields["moe_layer_freq"]
        fields["moe_layer_freq"] = [1 if i % freq == 0 else 0 for i in range(p.num_layers)]
    gpt = {kw: getattr(p, f) for f, kw in GPT_FIELDS.items()}
    return fields, gpt, is_mla


# ----------------------------------------------------------------------------------------------
# the disk cache of provider fields
# ----------------------------------------------------------------------------------------------


def provider_cache_dir() -> Optional[Path]:
    """Where :func:`provider_arch_fields` keeps what it read from providers:
    ``$AREAL_MEGA_CACHE_DIR/bridge_providers`` (``off``: no cache), else
    ``$XDG_CACHE_HOME/areal_mega/bridge_providers`` (default ``~/.cache``)."""
    root = os.environ.get("AREAL_MEGA_CACHE_DIR")
    if root == "off":
        return None
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "areal_mega")
    return Path(root) / "bridge_providers"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def _code_key() -> str:
    """The inputs besides the config: the packages that compute the fields and this file."""
    parts = [f"{d}=={_version(d)}" for d in ("megatron-bridge", "megatron-core", "transformers")]
    parts.append(hashlib.sha256(Path(__file__).read_bytes()).hexdigest())
    return "\n".join(parts)


def _cache_file(hf_json: str) -> Optional[Path]:
    d = provider_cache_dir()
    if d is None:
        return None
    key = hashlib.sha256((_code_key() + "\n" + hf_json).encode()).hexdigest()
    return d / f"{key}.json"


def _encode(v):
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {"dict": {k: _encode(x) for k, x in v.items()}}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if callable(v):
        ref = f"{v.__module__}:{v.__qualname__}"
        if _decode({"callable": ref}) is not v:
            raise TypeError(f"{v!r} is not importable as {ref}")
        return {"callable": ref}
    raise TypeError(f"{type(v).__name__} value {v!r} has no cache encoding")


def _decode(v):
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if "tuple" in v:
            return tuple(_decode(x) for x in v["tuple"])
        if "dict" in v:
            return {k: _decode(x) for k, x in v["dict"].items()}
        module, _, qualname = v["callable"].partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    return v


def _read_cached(hf_json: str):
    path = _cache_file(hf_json)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if entry.get("config") != hf_json:
            raise ValueError("written for another config")
        return _decode(entry["fields"]), _decode(entry["gpt"]), bool(entry["is_mla"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        log.warning("ignoring the bridge provider cache entry %s (%s); recomputing", path, e)
        return None


def _write_cached(hf_json: str, value: Tuple[dict, dict, bool]) -> None:
    path = _cache_file(hf_json)
    if path is None:
        return
    fields, gpt, is_mla = value
    try:
        text = json.dumps(
            {
                "config": hf_json,
                "inputs": _code_key(),
                "fields": _encode(fields),
                "gpt": _encode(gpt),
                "is_mla": is_mla,
            },
            indent=1,
        )
    except TypeError as e:
        log.warning("the bridge provider's fields are not cached: %s", e)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, durable=False)  # a lost entry is only computed again
    except OSError as e:
        log.warning("could not write the bridge provider cache %s: %s", path, e)
