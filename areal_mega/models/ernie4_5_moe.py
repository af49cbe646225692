"""Ernie 4.5 MoE (``model_type: ernie4_5_moe``, ``Ernie4_5_MoeForCausalLM``) on megatron-core.

transformers' ``Ernie4_5_MoeTopKRouter`` routes in fp32: a softmax over every expert's gate
logit, the experts *chosen* by the top-k of ``softmax + e_score_correction_bias`` (the bias
stored in ``mlp.moe_statics``, shape ``[1, experts]``), their *weights* the unbiased softmax
scores renormalised by ``max(sum, moe_norm_min)``. megatron-core 0.19's
``topk_routing_with_score_function`` adds an expert bias to sigmoid (and sqrt-softplus) scores
only, its softmax paths ignore it, and its pre-softmax top-k is not renormalised (its
post-softmax top-k is a softmax over the chosen logits, which equals the renormalised scores
but cannot take a bias); its config refuses an expert bias with a softmax score.
:class:`ErnieTopKRouter` is megatron's ``TopKRouter`` with that routing: the config stays a
plain softmax router (``moe_router_pre_softmax``, no megatron expert bias), and the router
holds the bias itself as the ``expert_bias`` buffer megatron's sigmoid routers have (same
name, fp32, replicated), so checkpoints, the converters and the weight export treat it as
theirs. The bias is not trained (megatron's bias update is for its own expert-bias routers).

The rest is megatron's: grouped-query attention with interleaved rotary (even / odd channel
pairs, the bridge's ``rotary_interleaved``), RMSNorm, SiLU-gated MLPs, shared experts of
``moe_intermediate_size · moe_num_shared_experts`` beside the routed ones, and dense layers
where transformers builds them: layer ``i`` is MoE when ``(i + 1) % moe_layer_interval == 0``
and ``moe_layer_start_index <= i <= moe_layer_end_index`` (:func:`ernie_moe_layer_pattern`).
The bridge's provider gives the sizes; :data:`~areal_mega.models.bridge_provider.CORRECTIONS`
fixes what it gets wrong (router, layer pattern, rotary base).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from areal_mega.models.family_router import FamilyTopKRouter

__all__ = [
    "ERNIE_MODEL_TYPE",
    "ErnieTopKRouter",
    "ernie_routing",
    "ernie_moe_layer_pattern",
    "ernie4_5_moe_fields",
    "ernie_norm_min",
    "ernie_block_spec",
]

ERNIE_MODEL_TYPE = "ernie4_5_moe"


def _single(hf: dict, key: str, default):
    """An int field that multimodal Ernie configs give per modality as a list: one entry (the
    text pool) is accepted, more are refused naming the key."""
    v = hf.get(key, default)
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise ValueError(
                f"{key}={v!r}: one value per modality (a multimodal Ernie config); the "
                "text-only model has one"
            )
        v = v[0]
    return v


def ernie_moe_layer_pattern(hf: dict, n_layers: int) -> tuple:
    """1 = MoE, 0 = dense per layer, as transformers' ``Ernie4_5_MoeDecoderLayer`` decides:
    ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= i <=
    moe_layer_end_index`` (``-1``: the last layer)."""
    start = int(_single(hf, "moe_layer_start_index", 1))
    end = int(_single(hf, "moe_layer_end_index", -1))
    interval = int(hf.get("moe_layer_interval") or 1)
    end = n_layers - 1 if end == -1 else end
    return tuple(int((i + 1) % interval == 0 and start <= i <= end) for i in range(n_layers))


def ernie4_5_moe_fields(hf: dict, n_layers: int) -> dict:
    """The :class:`~areal_mega.models.builder.HFArch` fields of an ``ernie4_5_moe`` config
    (beyond the common attention fields). Raises ``ValueError`` naming the key of a feature
    this implementation lacks."""
    if hf.get("use_bias"):
        raise ValueError(
            "use_bias=True is not supported for ernie4_5_moe: transformers then biases the "
            "attention projections and the dense and shared MLPs but not the routed experts, "
            "which megatron-core's add_bias_linear does not express"
        )
    n_shared = int(_single(hf, "moe_num_shared_experts", 2) or 0)
    moe_ffn = int(_single(hf, "moe_intermediate_size", 1536))
    return dict(
        qk_norm=False,
        qkv_bias=False,
        num_experts=int(_single(hf, "moe_num_experts", 64)),
        moe_topk=int(hf.get("moe_k", 6)),
        moe_ffn_hidden_size=moe_ffn,
        moe_norm_topk_prob=True,
        moe_layer_pattern=ernie_moe_layer_pattern(hf, n_layers),
        # the expert bias balances the experts in pretraining; RL keeps the checkpoint's and
        # adds no balancing loss (transformers adds one only with output_router_logits)
        router_aux_loss_coef=0.0,
        moe_score_function="softmax",
        moe_expert_bias=True,
        moe_shared_ffn_hidden_size=moe_ffn * n_shared if n_shared else None,
    )


def ernie_norm_min(hf: dict) -> float:
    """The floor of the chosen weights' sum when they are renormalised (``moe_norm_min``,
    transformers' default 1e-12)."""
    v = hf.get("moe_norm_min")
    return 1e-12 if v is None else float(v)


def ernie_routing(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor, norm_min: float):
    """Ernie 4.5's routing of ``logits`` [tokens, experts]: ``(probs, routing_map)``, both
    [tokens, experts] (the renormalised weights of the chosen experts, zero elsewhere; which
    experts are chosen), as megatron's routers return them. In fp32 throughout, the weights
    cast back to ``logits``' dtype."""
    scores = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(scores + expert_bias.float(), topk, dim=-1).indices
    chosen = torch.gather(scores, dim=-1, index=top)
    chosen = chosen / torch.clamp(chosen.sum(dim=-1, keepdim=True), min=norm_min)
    probs = torch.zeros_like(scores).scatter(1, top, chosen).type_as(logits)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    return probs, routing_map


class ErnieTopKRouter(FamilyTopKRouter):
    """megatron's ``TopKRouter`` with Ernie 4.5's routing (:func:`ernie_routing`): the gate
    (fp32 with ``moe_router_dtype="fp32"``) and the z-loss stay megatron's; the expert choice
    and weights are transformers' (unfused on every device: ``moe_router_fusion`` has no
    kernel for this routing). Without the load-balancing losses (the family's coefficient is
    0: :func:`ernie4_5_moe_fields`), token dropping and router replay (refused for this family:
    :func:`~areal_mega.engine.routing_replay.check_replay_target`), which it refuses."""

    family = ERNIE_MODEL_TYPE

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *, norm_min):
        if config.moe_router_score_function != "softmax" or config.moe_router_enable_expert_bias:
            raise ValueError(
                "ErnieTopKRouter needs a softmax router config without megatron's expert "
                "bias (it holds its own)"
            )
        super().__init__(config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.norm_min = float(norm_min)
        device = self.weight.device
        # megatron's name for it (a checkpoint key and a mapped HF tensor); the expert bias
        # never takes a gradient. TopKRouter set the attribute to None (no megatron bias)
        del self.expert_bias
        self.register_buffer(
            "expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device)
        )

    def route(self, logits: torch.Tensor):
        """:func:`ernie_routing` of ``logits`` [tokens, experts]."""
        return ernie_routing(logits, self.topk, self.expert_bias, self.norm_min)


def _with_router(mlp, router):
    """A layer's MLP builder with ``router`` in place of megatron's when it is an MoE layer
    (megatron's MoE spec, local or TransformerEngine: ``partial(MoELayer,
    submodules=MoESubmodules(...))``); a dense MLP's builder as it is."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    subs = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
    if isinstance(subs, MoESubmodules):
        keywords = dict(mlp.keywords, submodules=dataclasses.replace(subs, router=router))
        return functools.partial(mlp.func, *mlp.args, **keywords)
    module = getattr(mlp, "module", mlp)
    if isinstance(module, type) and issubclass(module, MoELayer):
        raise ValueError(f"ernie4_5_moe: an MoE layer spec of an unknown form: {mlp!r}")
    return mlp


def ernie_block_spec(config, *, use_te: bool, norm_min: float, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk): megatron's MoE decoder block spec (dense
    and MoE layers by ``config.moe_layer_freq``) with :class:`ErnieTopKRouter` in the MoE
    layers and, on the local spec, our packed attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from areal_mega.models.varlen_attention import VarlenDotProductAttention

    spec = specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    router = functools.partial(ErnieTopKRouter, norm_min=norm_min)
    for layer in spec.layer_specs:
        layer.submodules.mlp = _with_router(layer.submodules.mlp, router)
        if not use_te:
            layer.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    return spec
