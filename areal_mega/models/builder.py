"""Build a megatron-core ``GPTModel`` from a Hugging Face ``config.json``.

Supported ``model_type``: :data:`SUPPORTED_MODEL_TYPES` (each family's module says what it
changes against the Llama math; ``docs/model_families.md`` lists them with their checks).
Actor and reference use this same builder; the model
code is single-device megatron-core and all parallelism comes from the
:class:`~areal_mega.parallel.mesh.ParallelMesh` passed in.

Why ``GPTModel`` and not ``HybridModel``: megatron-core 0.19 logs "GPTModel IS DEPRECATED"
(critical fixes only) when a ``GPTModel`` is built, and points to ``HybridModel``. We keep
``GPTModel`` on purpose. ``HybridModel`` builds attention and MLP as *separate* layers of a
pattern string (``"*-*-"``: layer 2i is attention, 2i+1 the MLP or MoE), so every parameter
name below, the HF mapping, the layer offsets of pipeline stages and every saved checkpoint
would change; its spec module (``hybrid_layer_specs``) has TransformerEngine specs only, no
local spec, so it cannot run without TE (the CPU path); and Megatron-Bridge 0.6.2, the converter
this project moves to, builds ``GPTModel`` for every dense and MoE family it maps (Llama, Qwen,
Gemma, Mistral, DeepSeek, GLM: its ``GPTModelProvider``), ``HybridModel`` only for Mamba-hybrid
families (Nemotron-H). Revisit when the bridge's GPT providers move.

Layer spec: TransformerEngine (``get_gpt_layer_with_transformer_engine_spec``) or megatron-core's
local spec, as decided by :mod:`areal_mega.models.backend` from ``model.attention_backend``, CUDA
and the installed TransformerEngine (which also decides the GPU fusions).

Parameter names and layouts of the local spec (per model chunk, TP-local shards; ``L`` is the
layer index *local to the chunk*; the global index is ``L + layer offset`` of the stage):

==============================================  ==============================================
``embedding.word_embeddings.weight``            [V_pad/TP, H] (first stage)
``decoder.layers.L.input_layernorm.weight``     [H]
``decoder.layers.L.self_attention.linear_qkv.weight``  [(nq+2·nkv)·d/TP, H], rows grouped per
                                                KV group g: [q_g0..q_g(r-1), k_g, v_g] (r = nq/nkv)
``decoder.layers.L.self_attention.linear_qkv.bias``    same grouping (Qwen2 only)
``decoder.layers.L.self_attention.q_layernorm.weight`` [d] (Qwen3, Qwen3-MoE)
``decoder.layers.L.self_attention.k_layernorm.weight`` [d]
``decoder.layers.L.self_attention.linear_proj.weight`` [H, nq·d/TP]
``decoder.layers.L.pre_mlp_layernorm.weight``   [H]
``decoder.layers.L.mlp.linear_fc1.weight``      [2·F/TP, H] = [gate; up] (TP-local halves)
``decoder.layers.L.mlp.linear_fc2.weight``      [H, F/TP]
``decoder.layers.L.mlp.router.weight``          [E, H] (MoE)
``decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight``  [2·Fe/ETP, H] (MoE; ``e`` is
                                                the EP-local expert index, global = e +
                                                ep_rank·E/EP)
``decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight``  [H, Fe/ETP]
``decoder.final_layernorm.weight``              [H] (last stage)
``output_layer.weight``                         [V_pad/TP, H] (last stage, untied only)
==============================================  ==============================================

With the TE spec the norms fuse into the following linear: ``input_layernorm.weight`` becomes
``self_attention.linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm.weight`` becomes
``mlp.linear_fc1.layer_norm_weight`` (dense layers); MoE experts with grouped GEMM are
``mlp.experts.linear_fc1.weight<e>``. ``sharded_state_dict()`` keys are the same in both specs
(megatron maps them), so distributed checkpoints are portable between CPU and GPU.

The vocabulary is padded to :func:`padded_vocab_size`; logits of padded ids must be masked
before any softmax (the engine does it).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from areal_mega.models.backend import (
    have_te,
    runtime_config_fields,
)
from areal_mega.models.bridge_provider import (
    OWN_TRANSLATOR,
    gpu_only_reason,
    not_built_reason,
    provider_arch_fields,
    uses_provider,
)
from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.expert_bias import unmark_expert_biases
from areal_mega.models.falcon_h1 import (
    FALCON_H1_MODEL_TYPE,
    falcon_h1_arch_fields,
    falcon_h1_config_fields,
    falcon_h1_gpt_kwargs,
    falcon_h1_normalized,
)
from areal_mega.models.falcon_h1 import MULTIPLIERS_ATTR as FALCON_H1_MULTIPLIERS
from areal_mega.models.mla import deepseek_v2_fields, deepseek_v3_fields, glm4_moe_lite_fields
from areal_mega.models.moe_families import glm4_moe_fields, hy_v3_fields, minimax_m2_fields
from areal_mega.models.nemotron_h import (
    nemotron_h_arch_fields,
    nemotron_h_config_fields,
    nemotron_h_model,
    nemotron_h_stage_refusal,
)
from areal_mega.models.sliding_window import hf_sliding_window, mcore_window_size

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFArch",
    "load_hf_config",
    "parse_hf_config",
    "padded_vocab_size",
    "transformer_config_from_hf",
    "runtime_config_fields",
    "layer_spec_for",
    "build_model_chunks",
    "have_te",
]

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "gemma3_text",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "gemma",
    "glm4_moe_lite",
    "hy_v3",
    "nemotron",
    "gemma2",
    "olmoe",
    "minimax_m2",
    "gpt_oss",
    "ernie4_5_moe",
    "exaone_moe",
    "exaone4",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "nemotron_h",
    "gemma4_text",
    "falcon_h1",
    "glm_moe_dsa",
)
#: families whose QK RMSNorm spans the whole query / key projection (areal_mega/models/olmoe.py)
WHOLE_QK_NORM_MODEL_TYPES = ("olmoe", "minimax_m2")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class HFArch:
    """The architecture facts read from an HF config (pure data, validated)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float = 0.02
    sliding_window: Optional[int] = None  # attention window W (None: full causal)
    # MoE
    num_experts: Optional[int] = None
    moe_topk: int = 0
    moe_ffn_hidden_size: Optional[int] = None
    moe_norm_topk_prob: bool = True
    moe_layer_pattern: Optional[tuple] = None  # 1 = MoE layer, 0 = dense, per layer
    router_aux_loss_coef: float = 0.0
    rotary_percent: float = 1.0  # share of each head's channels that get rotary
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False  # sigmoid routers: bias added for the expert choice only
    moe_num_groups: Optional[int] = None  # group-limited top-k (None: not limited)
    moe_group_topk: Optional[int] = None
    moe_routed_scaling_factor: Optional[float] = None
    moe_shared_ffn_hidden_size: Optional[int] = None  # all shared experts together
    mtp_layers: int = 0  # multi-token-prediction layers of the checkpoint (unused)
    # multi-latent attention (DeepSeek-V3; areal_mega.models.mla); None: not MLA
    mla_kv_lora_rank: Optional[int] = None
    mla_q_lora_rank: Optional[int] = None
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_v_head_dim: int = 0
    # Gemma 3 (:mod:`areal_mega.models.gemma3`); the defaults are the Llama math
    activation: str = "silu"
    layer_types: Optional[tuple] = None  # per layer: sliding_attention / full_attention
    rope_local_theta: Optional[float] = None
    rope_scaling_factor: float = 1.0
    softmax_scale: Optional[float] = None  # None: 1/sqrt(head_dim)
    # Nemotron (:mod:`areal_mega.models.nemotron`); the defaults are the Llama math
    normalization: str = "RMSNorm"
    gated_mlp: bool = True
    # Gemma 2 (:mod:`areal_mega.models.gemma2`): tanh soft-caps (None: none)
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # Qwen3-Next (:mod:`areal_mega.models.qwen3_next`): per layer 1 = gated delta-net (linear
    # attention), 0 = full attention (None: no linear attention); the delta-net's key heads,
    # value heads, key and value head dims; the full attention's output gate
    linear_attention_layers: Optional[tuple] = None
    gdn_heads: Optional[tuple] = None
    attention_output_gate: bool = False
    # Nemotron-H (:mod:`areal_mega.models.nemotron_h`): one letter per layer (M Mamba,
    # * attention, - MLP); None: every layer is an attention + MLP decoder layer
    hybrid_layer_pattern: Optional[str] = None
    # Gemma 4 (:mod:`areal_mega.models.gemma4`): the full-attention layers' head size and KV
    # heads, K = V on them, the last layers sharing keys / values (their MLP double-wide or
    # not), the per-layer inputs' width and vocabulary (0: none)
    global_head_dim: Optional[int] = None
    global_kv_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Falcon-H1 (:mod:`areal_mega.models.falcon_h1`): a Mamba-2 mixer beside the attention in
    # every layer
    mamba_beside_attention: bool = False
    # DeepSeek sparse attention (:mod:`areal_mega.models.dsa`): the indexer's heads, head size
    # and top-k (None: dense attention); per layer 1 = "shared" (no indexer: the last full
    # layer's top-k), 0 = its own indexer
    dsa_indexer: Optional[tuple] = None
    dsa_shared_layers: Optional[tuple] = None
    # the normalised HF config (JSON) it was read from: the bridge's provider translates it
    hf_json: Optional[str] = field(default=None, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank is not None

    @property
    def has_mamba(self) -> bool:
        """Whether some layer runs a Mamba mixer (its state runs through the whole sequence)."""
        return self.hybrid_layer_pattern is not None or self.mamba_beside_attention

    def source_config(self) -> dict:
        """The HF config dict this was parsed from (:func:`parse_hf_config`)."""
        if self.hf_json is None:
            raise ValueError(f"{self.model_type}: HFArch not made by parse_hf_config (no config)")
        return json.loads(self.hf_json)


def load_hf_config(source: Union[str, os.PathLike, dict]) -> dict:
    """Read ``config.json`` from a model directory or file, or pass a dict through."""
    if isinstance(source, dict):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def normalize_hf_config(cfg: dict) -> dict:
    """Accept both spellings that exist in the wild: transformers 5 writes ``num_local_experts``
    and ``rope_parameters: {rope_theta}``; hub checkpoints have ``num_experts`` and
    ``rope_theta``. Returns a copy with both spellings filled in."""
    cfg = dict(cfg)
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        cfg["num_experts"] = cfg["num_local_experts"]
    rp = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rp:
        cfg["rope_theta"] = rp["rope_theta"]
    return cfg


#: model_type -> ``module:function`` of :mod:`areal_mega.models` giving its HFArch fields
_OWN_ARCH_FIELDS = {
    "gemma3_text": "gemma3:gemma3_arch_fields",
    "gemma4_text": "gemma4:gemma4_arch_fields",
    "gemma": "gemma3:gemma_arch_fields",
    "gemma2": "gemma2:gemma2_arch_fields",
    "olmoe": "olmoe:olmoe_arch_fields",
    "exaone_moe": "exaone:exaone_moe_arch_fields",
    "exaone4": "exaone:exaone4_arch_fields",
    "nemotron": "nemotron:nemotron_arch_fields",
    "qwen3_next": "qwen3_next:qwen3_next_arch_fields",
    "qwen3_5_text": "qwen3_next:qwen3_next_arch_fields",
    "qwen3_5_moe_text": "qwen3_next:qwen3_next_arch_fields",
    "gpt_oss": "gpt_oss:gpt_oss_arch_fields",
}


def parse_hf_config(hf: dict) -> HFArch:
    """Validate an HF config dict and extract an :class:`HFArch`. Raises ``ValueError`` for
    unsupported architectures or features (e.g. rope scaling other than none)."""
    hf = normalize_hf_config(hf)
    mt = hf.get("model_type")
    if gpu_only_reason(mt):
        raise ValueError(
            f"model_type {mt!r} needs GPU-only kernels, which the CPU lacks: {gpu_only_reason(mt)}"
        )
    if mt not in SUPPORTED_MODEL_TYPES:
        why = f" ({not_built_reason(mt)})" if not_built_reason(mt) else ""
        raise ValueError(
            f"model_type {mt!r} is not supported{why}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if mt == "nemotron_h":
        return HFArch(**nemotron_h_arch_fields(hf), hf_json=_config_json(hf))
    if mt == FALCON_H1_MODEL_TYPE:  # its config completed as the bridge's provider reads it
        hf = falcon_h1_normalized(hf)
        return HFArch(**falcon_h1_arch_fields(hf), hf_json=_config_json(hf))
    if mt in _OWN_ARCH_FIELDS:  # modules that import megatron-core: imported when needed
        module, fn = _OWN_ARCH_FIELDS[mt].split(":")
        fields = getattr(importlib.import_module(f"areal_mega.models.{module}"), fn)(hf)
        return HFArch(**fields, hf_json=_config_json(hf))
    rs = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
    rs_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
    if rs_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rs_type!r} is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    n_layers = int(hf["num_hidden_layers"])
    kw: dict[str, Any] = dict(
        decoder_fields(hf, model_type=mt, max_position_embeddings=4096, rms_norm_eps=1e-6),
        qkv_bias=(mt == "qwen2") or bool(hf.get("attention_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        sliding_window=hf_sliding_window(hf),
    )
    if mt in ("llama", "mistral") and hf.get("mlp_bias"):
        raise ValueError(f"{mt} mlp_bias=True is not supported")
    if mt == "qwen3" and hf.get("attention_bias"):
        kw["qkv_bias"] = True
    if mt == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        pattern = tuple(0 if (i in dense or (i + 1) % step) else 1 for i in range(n_layers))
        kw.update(
            num_experts=int(hf["num_experts"]),
            moe_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            # transformers' Qwen3MoeConfig default (hub checkpoints set it to true)
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layer_pattern=pattern,
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    if mt == "glm4_moe":
        kw.update(glm4_moe_fields(hf, n_layers, kw["head_dim"]))
    if mt == "deepseek_v3":
        kw.update(deepseek_v3_fields(hf, n_layers))
    if mt == "deepseek_v2":
        kw.update(deepseek_v2_fields(hf, n_layers))
    if mt == "glm4_moe_lite":
        kw.update(glm4_moe_lite_fields(hf, n_layers))
    if mt == "glm_moe_dsa":
        from areal_mega.models.dsa import glm_moe_dsa_fields

        kw.update(glm_moe_dsa_fields(hf, n_layers))
    if mt == "hy_v3":
        kw.update(hy_v3_fields(hf, n_layers))
    if mt == "minimax_m2":
        kw.update(minimax_m2_fields(hf, n_layers))
    if mt == "ernie4_5_moe":
        from areal_mega.models.ernie4_5_moe import ernie4_5_moe_fields

        kw.update(ernie4_5_moe_fields(hf, n_layers))
    return HFArch(**kw, hf_json=_config_json(hf))


def _config_json(hf: dict) -> str:
    return json.dumps(hf, sort_keys=True, default=str)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary size after padding: the smallest multiple of ``lcm(divisible_by, tp)``.

    Unlike Megatron-LM (multiple of ``divisible_by·tp``) the padded size does not depend on TP
    whenever TP divides ``divisible_by`` (e.g. 128 with TP ∈ {1, 2, 4, 8}), so checkpoints
    reshard across TP without resizing the embedding."""
    m = math.lcm(max(1, divisible_by), tp)
    return ((vocab_size + m - 1) // m) * m


def interleaved_p2p_settings(pp: int, vpp: Optional[int]) -> dict:
    """Pipeline p2p settings of the interleaved schedule (``{}`` when they stay megatron's).

    With PP = 2 the previous and the next stage are the same rank, so the steady-state
    ``send_forward_backward_recv_forward_backward`` of the default batched p2p
    (``batch_p2p_comm``) posts an activation and a gradient to the same peer in one batch;
    the peer matches them in posting order, which differs between the two directions, so the
    activation lands in the gradient buffer and vice versa (silently wrong gradients at equal
    lengths, a shape mismatch at variable lengths, as the exchanged shapes are swapped too).
    ``overlap_p2p_comm`` splits the forward and backward exchanges into separate calls, which
    is what megatron requires for the interleaved schedule at PP = 2."""
    if vpp and vpp > 1 and pp == 2:
        return {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    return {}


def transformer_config_from_hf(
    arch: HFArch,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    sequence_parallel: bool = False,
    dtype: str = "fp32",
    recompute_granularity: Optional[str] = None,
    variable_seq_lengths: bool = True,
    use_te: bool = False,
    moe_aux_loss_coeff: Optional[float] = None,
    deterministic: bool = False,
    attention_backend: Optional[str] = None,
    fusions: Optional[dict] = None,
    moe_enable_routing_replay: bool = False,
):
    """Translate :class:`HFArch` + parallel sizes into a megatron ``TransformerConfig``.

    ``etp``: the routed experts' tensor parallel size (None: ``tp``).

    ``attention_backend`` is megatron's ``AttnBackend`` name (see
    :func:`~areal_mega.models.backend.config_attention_backend`; None: what this process
    already committed to, else ``auto``).
    ``fusions`` overrides :func:`~areal_mega.models.backend.decide_fusions` (default: decided
    from CUDA, the installed TE and apex; all off on CPU).
    ``moe_enable_routing_replay``: every router gets megatron's ``RouterReplay`` (R3, see
    :mod:`areal_mega.engine.routing_replay`); MoE models only.

    ``pipeline_model_parallel_size`` is set in the config (megatron needs it there to give
    each stage its own layers); ``variable_seq_lengths`` requires the alltoall MoE dispatcher
    even for dense models (megatron-core 0.16 to 0.19), so that dispatcher is always selected."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if arch.num_kv_heads % tp:
        raise ValueError(f"num_key_value_heads={arch.num_kv_heads} is not divisible by TP={tp}")
    if arch.model_type == "gpt_oss":
        from areal_mega.models.gpt_oss import layout_refusal

        why = layout_refusal(tp, etp)
        if why:
            raise ValueError(why)
    if arch.hybrid_layer_pattern is not None:
        why = nemotron_h_stage_refusal(arch.source_config(), pp, vpp)
        if why:
            raise ValueError(f"{arch.model_type}: {why}")
    if arch.mamba_beside_attention and cp > 1:
        raise ValueError(
            f"{arch.model_type}: context parallelism is not built for its Mamba mixers "
            "(megatron's Mamba context parallelism with packed sequences is not checked)"
        )
    if arch.hybrid_layer_pattern is not None and cp > 1 and not have_te():
        raise ValueError(
            f"{arch.model_type}: context parallelism needs TransformerEngine, which is not in "
            "use here (no CUDA, or not installed): megatron's Mamba mixers split packed "
            "sequences across CP ranks with its thd_get_partitioned_indices, which has no CPU "
            "stand-in"
        )
    if arch.num_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"num_hidden_layers={arch.num_layers} not divisible by PP·VPP={pp * (vpp or 1)}"
        )
    kw = runtime_config_fields(
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        vpp=vpp,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        variable_seq_lengths=variable_seq_lengths,
        use_te=use_te,
        deterministic=deterministic,
        attention_backend=attention_backend,
        fusions=fusions,
        activation=arch.activation,
    )
    # architecture fields: the bridge's provider, or our translator where it is kept
    multipliers = None
    if arch.model_type == "nemotron_h":
        kw.update(nemotron_h_config_fields(arch.source_config())[0])
        is_mla = False
    elif arch.model_type == FALCON_H1_MODEL_TYPE:
        fields, multipliers, _ = falcon_h1_config_fields(arch.source_config())
        kw.update(fields)
        is_mla = False
    elif uses_provider(arch.model_type):
        fields, _, is_mla = provider_arch_fields(arch.source_config())
        kw.update(fields)
    else:
        kw.update(_own_arch_fields(arch))
        is_mla = False
    if arch.model_type in WHOLE_QK_NORM_MODEL_TYPES:
        from areal_mega.models.olmoe import CONFIG_OVERRIDES

        kw.update(CONFIG_OVERRIDES)
    if kw.get("window_size") is not None and cp > 1:
        kw["cp_comm_type"] = "a2a"  # megatron's context parallelism with a window needs a2a
    kw.update(interleaved_p2p_settings(pp, vpp))
    if recompute_granularity:
        kw["recompute_granularity"] = recompute_granularity
        if recompute_granularity == "full":
            kw.update(recompute_method="uniform", recompute_num_layers=1)
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ValueError(f"num_experts={arch.num_experts} not divisible by EP={ep}")
        aux = arch.router_aux_loss_coef if moe_aux_loss_coeff is None else moe_aux_loss_coeff
        kw.update(
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_aux_loss_coeff=aux,
            moe_grouped_gemm=use_te,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
            moe_enable_routing_replay=moe_enable_routing_replay,
            # RL keeps the checkpoint's expert bias (areal_mega.models.moe_families)
            moe_router_bias_update_rate=0.0,
            moe_shared_expert_overlap=False,
        )
    if arch.dsa_indexer is not None:
        # RL keeps the checkpoint's indexer: no indexer loss (areal_mega.models.dsa)
        kw["dsa_indexer_loss_coeff"] = 0.0
    if is_mla:
        # the local spec's core attention sizes its output by kv_channels (TE's takes the value
        # head dim from MLA): the value head dim (the provider sets the rotary one)
        kw["kv_channels"] = kw["v_head_dim"]
        return MLATransformerConfig(**kw)
    if arch.model_type in ("gemma3_text", "gemma2"):
        from areal_mega.models.gemma3 import gemma3_transformer_config

        return gemma3_transformer_config(arch, kw)
    if arch.model_type == "gemma4_text":
        from areal_mega.models.gemma4 import gemma4_transformer_config

        return gemma4_transformer_config(arch, kw)
    # YaRN's fields are attributes GPTModel and the attention read, not TransformerConfig fields
    yarn = {k: kw.pop(k) for k in list(kw) if k.startswith("yarn_")}
    config = TransformerConfig(**kw)
    for k, v in yarn.items():
        setattr(config, k, v)
    if multipliers is not None:
        setattr(config, FALCON_H1_MULTIPLIERS, multipliers)
    return config


def _own_arch_fields(arch: HFArch) -> dict:
    """Our translation of the architecture fields, for the families of
    :data:`~areal_mega.models.bridge_provider.OWN_TRANSLATOR` (the reason is given there)."""
    if arch.model_type not in OWN_TRANSLATOR:
        raise ValueError(
            f"model_type {arch.model_type!r}: neither the bridge's provider nor our translator"
        )
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        init_method_std=arch.initializer_range,
        window_size=mcore_window_size(arch.sliding_window),
    )


def gpt_model_kwargs(arch: HFArch) -> dict:
    """The ``GPTModel`` keywords that describe the architecture (rotary base and share, maximum
    length, tied embeddings): the bridge's provider's, or ours where our translator is kept."""
    if uses_provider(arch.model_type):
        return provider_arch_fields(arch.source_config())[1]
    if arch.model_type == FALCON_H1_MODEL_TYPE:
        return falcon_h1_gpt_kwargs(arch.source_config(), arch)
    return dict(
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_percent,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
    )


def layer_spec_for(arch: HFArch, config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The transformer layer spec (or block spec for MoE) for ``arch``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if arch.model_type in ("gemma3_text", "gemma2"):
        from areal_mega.models.gemma3 import gemma3_block_spec

        return gemma3_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.model_type == "gemma4_text":
        from areal_mega.models.gemma4 import gemma4_block_spec

        return gemma4_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.model_type == "gemma":
        from areal_mega.models.gemma3 import gemma_block_spec

        return gemma_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.model_type in WHOLE_QK_NORM_MODEL_TYPES:
        from areal_mega.models.olmoe import olmoe_block_spec

        return olmoe_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.model_type == "ernie4_5_moe":
        from areal_mega.models.ernie4_5_moe import ernie_block_spec, ernie_norm_min

        return ernie_block_spec(
            config, use_te=use_te, vp_stage=vp_stage, norm_min=ernie_norm_min(arch.source_config())
        )
    if arch.model_type == "exaone4":
        from areal_mega.models.exaone import exaone4_block_spec

        return exaone4_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.dsa_indexer is not None:
        from areal_mega.models.dsa import dsa_block_spec

        return dsa_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.linear_attention_layers is not None:
        from areal_mega.models.qwen3_next import qwen3_next_block_spec

        return qwen3_next_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.model_type == FALCON_H1_MODEL_TYPE:
        from areal_mega.models.falcon_h1_layers import falcon_h1_layer_spec

        if use_te:
            raise ValueError(
                "falcon_h1 runs on megatron's local layer spec only (model.attention_backend "
                "other than TransformerEngine)"
            )
        return falcon_h1_layer_spec(falcon_h1_config_fields(arch.source_config())[2])
    if arch.model_type == "nemotron":
        from areal_mega.models.nemotron import nemotron_block_spec

        return nemotron_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if arch.is_moe:
        spec = specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
        return spec if use_te else _with_varlen_attention(spec)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm
        )
    return _with_varlen_attention(
        specs.get_gpt_layer_local_spec(
            num_experts=None,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_norm,
            normalization="RMSNorm",
        )
    )


def _with_varlen_attention(spec):
    """Local layer (or block) spec with :class:`VarlenDotProductAttention` as core attention:
    packed micro-batches run as THD, each sequence attending only to itself."""
    from areal_mega.models.varlen_attention import VarlenDotProductAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    return spec


def build_model_chunks(
    arch: HFArch,
    mesh,
    *,
    dtype: str = "fp32",
    make_vocab_size_divisible_by: int = 128,
    recompute_granularity: Optional[str] = None,
    use_te: Optional[bool] = None,
    seed: int = 1234,
    moe_aux_loss_coeff: Optional[float] = None,
    attention_backend: Optional[str] = None,
    moe_enable_routing_replay: bool = False,
):
    """Build this rank's model chunks (one per virtual pipeline stage; one without VPP).

    Returns ``(chunks, config)``. Weights are initialised from ``seed`` through megatron's
    model-parallel RNG so that any layout initialises the same global weights only up to the
    RNG streams; load a checkpoint (or broadcast) to get identical weights across layouts.
    ``attention_backend``: megatron's ``AttnBackend`` name (see
    :func:`~areal_mega.models.backend.select_attention`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if use_te is None:
        use_te = have_te()
    d = mesh.dims
    config = transformer_config_from_hf(
        arch,
        tp=d.tp,
        pp=d.pp,
        cp=d.cp,
        ep=d.ep,
        etp=d.etp,
        vpp=mesh.vpp,
        sequence_parallel=mesh.sequence_parallel,
        dtype=dtype,
        recompute_granularity=recompute_granularity,
        use_te=use_te,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
        attention_backend=attention_backend,
        moe_enable_routing_replay=moe_enable_routing_replay,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    vocab = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, d.tp)
    n_chunks = mesh.vpp or 1
    gpt_kw = gpt_model_kwargs(arch)
    chunks = []
    for vp in range(n_chunks):
        vp_stage = vp if mesh.vpp else None
        pre = mesh.is_first_stage and vp == 0
        post = mesh.is_last_stage and vp == n_chunks - 1
        if arch.model_type == "nemotron_h":
            chunks.append(_hybrid_chunk(arch, config, mesh, vocab, pre, post, vp_stage))
            continue
        spec = layer_spec_for(arch, config, use_te=use_te, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            pre_process=pre,
            post_process=post,
            **gpt_kw,
            pg_collection=mesh.pg_collection,
            vp_stage=vp_stage,
        )
        if arch.model_type in ("gemma3_text", "gemma2"):
            from areal_mega.models.gemma3 import finish_gemma3_model

            finish_gemma3_model(model, arch, config, cp_group=mesh.pg_collection.cp)
        if arch.model_type == "gemma4_text":
            from areal_mega.models.gemma4 import finish_gemma4_model

            finish_gemma4_model(model, arch, config, cp_group=mesh.pg_collection.cp)
        if arch.final_logit_softcapping is not None:
            from areal_mega.models.gemma2 import softcap_logits

            softcap_logits(model, arch.final_logit_softcapping)
        if arch.model_type == "gemma":
            from areal_mega.models.gemma3 import scale_embeddings

            scale_embeddings(model, arch)
        if arch.model_type == FALCON_H1_MODEL_TYPE:
            from areal_mega.models.falcon_h1_layers import finish_falcon_h1_model

            finish_falcon_h1_model(model, getattr(config, FALCON_H1_MULTIPLIERS))
        cast_params_to(model, config.params_dtype)
        if mesh.device.type == "cuda":
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    for chunk in chunks:
        unmark_expert_biases(chunk)
    return chunks, config


def _hybrid_chunk(arch: HFArch, config, mesh, vocab: int, pre: bool, post: bool, vp_stage):
    """One model chunk of a hybrid family (Nemotron-H): megatron-core's ``HybridModel`` with the
    local stack spec (:mod:`areal_mega.models.nemotron_h`)."""
    model = nemotron_h_model(
        config,
        nemotron_h_config_fields(arch.source_config())[1],
        vocab,
        pre_process=pre,
        post_process=post,
        pg_collection=mesh.pg_collection,
        vp_stage=vp_stage,
    )
    cast_params_to(model, config.params_dtype)
    if mesh.device.type == "cuda":
        model.cuda(torch.cuda.current_device())
    return model


def cast_params_to(model, dtype) -> None:
    """Every floating-point parameter of ``model`` in ``dtype`` (the model's ``params_dtype``),
    as megatron's ``Float16Module`` casts a bf16/fp16 model: modules built without TE (torch's
    norms, ours) create fp32 weights whatever ``params_dtype`` says. Megatron's optimizer keeps
    an fp32 main copy of each bf16 parameter, and its checkpoint maps only those; an fp32
    norm weight among bf16 layers would also send every norm through torch's mixed-dtype
    fallback. Buffers keep their dtype (megatron keeps e.g. a router's expert bias in fp32)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
