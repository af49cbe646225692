"""Build a vision-language model's chunk for this rank from the bridge's provider.

:func:`build_vl_model_chunks` takes Megatron-Bridge's provider of the HF config (for
Qwen2.5-VL its ``Qwen25VLModelProvider``: vision tower and projector config, multimodal RoPE,
the language model's architecture, with :data:`~areal_mega.models.bridge_provider.CORRECTIONS`
applied), sets our runtime fields on it (:func:`~areal_mega.models.builder.
runtime_config_fields`: mesh, dtype, CPU fusions) and has it build its model
(``Qwen25VLModel``). The provider builds the language model through ``provide_language_model``;
ours builds the same megatron-core ``GPTModel`` on our layer spec: the provider's own
``provide`` puts megatron's ``DotProductAttention`` into a local spec (it cannot run packed THD
micro-batches) where ours has :class:`~areal_mega.models.varlen_attention.
VarlenDotProductAttention`.

Layouts: data, tensor (with or without sequence parallelism) and pipeline parallel, for
Qwen2.5-VL also with virtual pipeline stages (one chunk per virtual stage; the vision tower is
replicated on the tensor-parallel ranks and lives on the first chunk of the first pipeline
stage, as the bridge builds it; the image features go into the embeddings before the bridge
scatters them over the sequence-parallel ranks; every chunk computes the multimodal positions
from the tokens; a checkpoint from :mod:`areal_mega.checkpoint.vl_convert` loads into any of
them). Context parallelism is refused (:func:`vl_provider` says why), and so are Qwen3-VL's
virtual stages (its build makes one chunk per stage).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from areal_mega.models.backend import have_te
from areal_mega.models.bridge_provider import provider_arch_fields, provider_for
from areal_mega.models.builder import (
    interleaved_p2p_settings,
    padded_vocab_size,
    runtime_config_fields,
)
from areal_mega.models.vlm.config import check_vl_config

__all__ = ["build_vl_model_chunks", "vl_provider"]


def _language_layer_spec(use_te: bool, qk_layernorm: bool = False):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from areal_mega.models.builder import _with_varlen_attention

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=qk_layernorm
        )
    return _with_varlen_attention(
        specs.get_gpt_layer_local_spec(
            num_experts=None,
            moe_grouped_gemm=False,
            qk_layernorm=qk_layernorm,
            normalization="RMSNorm",
        )
    )


def vl_provider(
    hf: dict,
    mesh,
    *,
    dtype: str = "fp32",
    make_vocab_size_divisible_by: int = 128,
    use_te: bool = False,
    attention_backend: Optional[str] = None,
    freeze_vision: bool = False,
    recompute_granularity: Optional[str] = None,
):
    """The bridge's provider of ``hf`` (a copy) with our runtime fields, corrected
    architecture fields and our language model build, finalised."""
    check_vl_config(hf)
    d = mesh.dims
    if d.cp > 1:
        raise NotImplementedError(
            "vision-language models run without context parallelism: the bridge's "
            "Qwen2.5-VL forward scatters the image features into the embeddings and computes "
            "the multimodal positions from the whole packed sequence it is given, and hands "
            "both to the language model unsplit, while the engine gives each context-parallel "
            "rank its zigzag shard of the tokens (the bridge's Qwen3-VL forward splits packed "
            "sequences over CP its own way, which the engine's split is not wired to) "
            f"rank its zigzag shard of the tokens (got {d.short()})"
        )
    if mesh.vpp and hf["model_type"] != "qwen2_5_vl":
        raise NotImplementedError(
            f"virtual pipeline stages are built for Qwen2.5-VL only (got {hf['model_type']}): "
            "the Qwen3-VL build makes one chunk per stage"
        )
    fields, gpt_kw, _ = provider_arch_fields(hf)
    p = copy.deepcopy(provider_for(hf))
    runtime = runtime_config_fields(
        tp=d.tp,
        pp=d.pp,
        cp=d.cp,
        ep=d.ep,
        etp=d.etp,
        vpp=mesh.vpp,
        sequence_parallel=mesh.sequence_parallel,
        dtype=dtype,
        use_te=use_te,
        attention_backend=attention_backend,
    )
    runtime.update(interleaved_p2p_settings(d.pp, mesh.vpp))  # as transformer_config_from_hf
    if recompute_granularity:  # as transformer_config_from_hf sets it
        runtime["recompute_granularity"] = recompute_granularity
        if recompute_granularity == "full":
            runtime.update(recompute_method="uniform", recompute_num_layers=1)
    for k, v in {**fields, **runtime}.items():
        setattr(p, k, v)
    if p.num_layers % (d.pp * (mesh.vpp or 1)):
        raise ValueError(
            f"num_hidden_layers={p.num_layers} not divisible by PP·VPP={d.pp * (mesh.vpp or 1)}"
        )
    p._pg_collection = mesh.pg_collection
    # the bridge's switch: the vision tower (patch embedding and blocks); its projector
    # (merger) and the language model train
    p.freeze_vision_model = bool(freeze_vision)
    vocab = padded_vocab_size(p.vocab_size, make_vocab_size_divisible_by, d.tp)

    def provide_language_model(pre_process=None, post_process=None, vp_stage=None):
        from megatron.core.models.gpt import GPTModel

        return GPTModel(
            config=p,
            transformer_layer_spec=_language_layer_spec(use_te),
            vocab_size=vocab,
            pre_process=pre_process,
            post_process=post_process,
            # the image features go into the embeddings before the sequence is split
            scatter_embedding_sequence_parallel=False,
            pg_collection=p._pg_collection,
            vp_stage=vp_stage,
            **gpt_kw,
        )

    p.provide_language_model = provide_language_model
    if hf["model_type"] == "qwen3_vl":
        # the bridge's Qwen3VLModel pads the vocabulary its own way: it gets ours, padded
        p.vocab_size, p.should_pad_vocab = vocab, False
    p.finalize()
    return p


def build_vl_model_chunks(
    hf: dict,
    mesh,
    *,
    dtype: str = "fp32",
    make_vocab_size_divisible_by: int = 128,
    use_te: Optional[bool] = None,
    seed: int = 1234,
    attention_backend: Optional[str] = None,
    freeze_vision: bool = False,
    recompute_granularity: Optional[str] = None,
):
    """This rank's model chunks (one: no virtual pipeline) and the provider (the
    ``TransformerConfig``), as :func:`~areal_mega.models.builder.build_model_chunks` returns
    them. ``freeze_vision``: the vision tower's parameters do not train
    (``model.freeze_vision``)."""
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if use_te is None:
        use_te = have_te()
    p = vl_provider(
        hf,
        mesh,
        dtype=dtype,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        use_te=use_te,
        attention_backend=attention_backend,
        freeze_vision=freeze_vision,
        recompute_granularity=recompute_granularity,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if hf["model_type"] == "qwen3_vl":
        from areal_mega.compat.megatron_cpu import apply_bridge_patches
        from areal_mega.models.vlm.qwen3_vl import build_qwen3_vl_model

        apply_bridge_patches("megatron.bridge.models.qwen_vl.modelling_qwen3_vl")
        chunks = [
            build_qwen3_vl_model(
                p,
                _language_layer_spec(use_te, qk_layernorm=True),
                pre_process=mesh.is_first_stage,
                post_process=mesh.is_last_stage,
            )
        ]
    else:
        # one chunk per virtual stage: the vision tower on the first chunk of the first stage
        n_chunks = mesh.vpp or 1
        chunks = [
            p.provide(
                pre_process=mesh.is_first_stage and vp == 0,
                post_process=mesh.is_last_stage and vp == n_chunks - 1,
                vp_stage=vp if mesh.vpp else None,
            )
            for vp in range(n_chunks)
        ]
    for model in chunks:
        # megatron's schedules read it (the bridge's own model construction sets it too)
        model.model_type = ModelType.encoder_or_decoder
        if mesh.device.type == "cuda":
            model.cuda(torch.cuda.current_device())
    return chunks, p
