"""Gemma 4 text (dense; ``model_type: gemma4_text``, ``Gemma4ForCausalLM``) on megatron's local
spec, matched to transformers' ``Gemma4TextModel``.

What Gemma 4 changes against Gemma 3 (:mod:`areal_mega.models.gemma3`):

* RMSNorms scale by ``weight`` (not ``1 + weight``) and divide by ``(ms + eps) ** 0.5`` through
  ``pow(-0.5)`` in fp32 (:class:`Gemma4RMSNorm`); the values get a scale-less norm of the same
  epsilon; the softmax scale is 1;
* per layer type (``layer_types``) the attention has its own shapes: sliding layers
  ``head_dim`` and ``num_key_value_heads``, full layers ``global_head_dim`` and, with
  ``attention_k_eq_v``, ``num_global_key_value_heads`` heads whose values are their (raw) keys
  (no ``v_proj``). :class:`Gemma4SelfAttention` builds each layer from a copy of the config
  with its layer type's sizes; its fused ``linear_qkv`` holds, per KV group, the group's query
  heads, then its key and value (``[q; k]`` on K = V layers, the queries alone on shared layers);
* the last ``num_kv_shared_layers`` layers have no key / value projections: they attend to the
  keys and values the last earlier layer of their type computed in the same forward
  (:class:`Gemma4ForwardState`); their MLP is twice as wide with ``use_double_wide_mlp``;
* full layers rotate ``partial_rotary_factor`` of their channels ("proportional" RoPE: the
  other frequencies are zero): :class:`Gemma4RotaryTables` gives both tables side by side on
  the last dimension, each layer takes its own;
* per-layer inputs (``hidden_size_per_layer_input``): a second embedding of the tokens
  (``per_layer_embedding``) and a projection of the scaled word embeddings
  (``per_layer_model_proj``, normalised by ``per_layer_proj_norm``), computed once on the
  embedding's output (:func:`finish_gemma4_model`), enter each layer after its MLP through a
  GELU-gated bottleneck (``per_layer_input_gate`` / ``per_layer_projection`` /
  ``post_per_layer_input_norm``); every layer's output is multiplied by its ``layer_scalar``
  buffer (a checkpoint tensor);
* the post-attention and post-feedforward norms (``post_self_attn_layernorm``,
  ``post_mlp_layernorm``, the bridge's names) normalise each sublayer's output before its
  residual add (:class:`Gemma4TransformerLayer`);
* with ``enable_moe_block`` (26B-A4B) every layer's MLP block is the dense MLP and routed
  experts side by side (:class:`Gemma4MoELayer`: megatron's ``MoELayer``, the dense MLP as its
  shared expert), each branch with its own norms before and after; the router
  (:class:`Gemma4TopKRouter`) reads the block's un-normalised input through a scale-less norm
  and a learnt scale, and scales each chosen expert's renormalised weight by its
  ``per_expert_scale``.

Megatron-Bridge's ``Gemma4DenseProvider`` builds the same math from its own modules, but it is
not used (see ``OWN_TRANSLATOR`` in :mod:`areal_mega.models.bridge_provider`). Here the
per-layer-input gate and projection are marked sequence-parallel (their gradients are partial
sums under TP with SP), the value norm takes the config's epsilon and full layers take the
global KV heads only with ``attention_k_eq_v``, as transformers does.

The layers share the keys / values and per-layer inputs through the chunk's
:class:`~areal_mega.models.gemma4_forward_state.Gemma4ForwardState`. Under full activation
recompute megatron re-runs the layers in backward without the graph that made what they read,
so those reads go through a gradient relay that carries their gradients back to the source
layer's query and the embedding's output. Under pipeline parallelism a stage passes the keys /
values and per-layer inputs later stages read on the hidden state's last dimension
(:mod:`areal_mega.models.gemma4_pipeline`). Both together run too.

Refused (``ValueError`` naming why): the MoE block with double-wide key/value-shared layers
(:data:`MOE_DOUBLE_WIDE_REFUSED`), router replay, pipeline parallelism with key/value-shared
layers or per-layer inputs without ``variable_seq_lengths``, TP above a layer type's KV heads,
bidirectional attention, attention biases, untied embeddings, RoPE other than default
(sliding) / proportional (full).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from areal_mega.models import gemma4_pipeline as pipeline
from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.family_router import FamilyTopKRouter
from areal_mega.models.gemma3 import (
    FULL,
    SLIDING,
    Gemma3CoreAttention,
    check_gemma_config,
    layer_types_and_window,
    scale_embeddings,
)
from areal_mega.models.gemma4_forward_state import PER_LAYER_INPUT, Gemma4ForwardState

__all__ = [
    "GEMMA4_MODEL_TYPE",
    "MOE_DOUBLE_WIDE_REFUSED",
    "gemma4_moe_fields",
    "Gemma4TopKRouter",
    "Gemma4MoELayer",
    "gemma4_routing",
    "layout_refusal",
    "gemma4_arch_fields",
    "Gemma4Config",
    "gemma4_transformer_config",
    "gemma4_block_spec",
    "finish_gemma4_model",
    "Gemma4RMSNorm",
    "Gemma4SelfAttention",
    "Gemma4TransformerLayer",
    "Gemma4RotaryTables",
]

GEMMA4_MODEL_TYPE = "gemma4_text"
MOE_DOUBLE_WIDE_REFUSED = (
    "gemma4_text: enable_moe_block with use_double_wide_mlp and key/value-shared layers is not "
    "supported (the shared layers' dense branch would be twice as wide; no released MoE "
    "model has them)"
)


def _rope_of(hf: dict, layer_type: str) -> dict:
    """One layer type's RoPE parameters (transformers 5's ``rope_parameters`` per type)."""
    rp = (hf.get("rope_parameters") or {}).get(layer_type)
    if rp is None:
        raise ValueError(f"rope_parameters[{layer_type!r}] is missing")
    return dict(rp)


def gemma4_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``gemma4_text`` config
    dict. Raises ``ValueError`` naming the key of any feature this implementation lacks."""
    moe = gemma4_moe_fields(hf) if hf.get("enable_moe_block") else {}
    check_gemma_config(hf, GEMMA4_MODEL_TYPE, "Gemma4ForCausalLM", "hidden_activation")
    n_layers = int(hf["num_hidden_layers"])
    layer_types, window = layer_types_and_window(
        hf, [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    )
    local, full = _rope_of(hf, SLIDING), _rope_of(hf, FULL)
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters[{SLIDING!r}].rope_type={local.get('rope_type')!r} is not "
            "supported (default only)"
        )
    if full.get("rope_type") != "proportional":
        raise ValueError(
            f"rope_parameters[{FULL!r}].rope_type={full.get('rope_type')!r} is not supported "
            "(proportional only)"
        )
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    global_kv = int(hf.get("num_global_key_value_heads") or kv_heads) if k_eq_v else kv_heads
    shared = int(hf.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n_layers:
        raise ValueError(f"num_kv_shared_layers={shared}: must be in [0, {n_layers})")
    first_shared = n_layers - shared
    for t in set(layer_types[first_shared:]):
        if t not in layer_types[:first_shared]:
            raise ValueError(
                f"num_kv_shared_layers={shared}: no earlier {t!r} layer to share keys/values"
            )
    if heads % global_kv:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_global_key_value_heads="
            f"{global_kv}"
        )
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    ple_dim = int(hf.get("hidden_size_per_layer_input") or 0)
    if moe and shared and hf.get("use_double_wide_mlp"):
        raise ValueError(MOE_DOUBLE_WIDE_REFUSED)
    return dict(
        decoder_fields(
            hf,
            model_type=GEMMA4_MODEL_TYPE,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        **moe,
        rope_theta=float(full["rope_theta"]),
        qkv_bias=False,
        qk_norm=True,
        sliding_window=window,
        activation="gelu_tanh",
        layer_types=layer_types,
        rope_local_theta=float(local["rope_theta"]),
        rope_scaling_factor=float(full.get("factor", 1.0)),
        rotary_percent=float(full.get("partial_rotary_factor", 1.0)),
        softmax_scale=1.0,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        global_head_dim=int(hf.get("global_head_dim") or head_dim),
        global_kv_heads=global_kv,
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(hf.get("use_double_wide_mlp")),
        per_layer_input_size=ple_dim,
        per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"])
        if ple_dim
        else 0,
    )


def gemma4_moe_fields(hf: dict) -> dict[str, Any]:
    """Pure: the MoE fields of a ``gemma4_text`` config with ``enable_moe_block`` (every layer
    has the block): ``num_experts`` experts of width ``moe_intermediate_size``, ``top_k_experts``
    chosen per token, the layer's dense MLP (``intermediate_size``) as megatron's shared expert,
    no balancing loss (transformers computes none). ``ValueError`` naming a missing key."""
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not hf.get(key):
            raise ValueError(f"gemma4_text: enable_moe_block=True needs {key}, got {hf.get(key)!r}")
    experts, topk = int(hf["num_experts"]), int(hf["top_k_experts"])
    if not 0 < topk <= experts:
        raise ValueError(f"gemma4_text: top_k_experts={topk} not in [1, num_experts={experts}]")
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_norm_topk_prob=True,
        moe_score_function="softmax",
        router_aux_loss_coef=0.0,
        moe_shared_ffn_hidden_size=int(hf["intermediate_size"]),
    )


@dataclass
class Gemma4Config(TransformerConfig):
    """megatron ``TransformerConfig`` with Gemma 4's per-layer choices (see the module)."""

    layer_types: tuple = ()
    sliding_window: Optional[int] = None
    attn_logit_softcapping: Optional[float] = None  # read by Gemma3CoreAttention
    global_kv_channels: int = 0
    global_query_groups: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

    def is_sliding(self, layer_number: int) -> bool:
        """Whether megatron's 1-based global ``layer_number`` is a sliding-window layer."""
        return self.layer_types[layer_number - 1] == SLIDING

    def is_shared(self, layer_number: int) -> bool:
        """Whether the layer reads the keys / values of an earlier layer."""
        return layer_number > self.num_layers - self.num_kv_shared_layers

    def stores_kv(self, layer_number: int) -> bool:
        """Whether the layer is the last non-shared layer of its type while shared layers
        exist (the one whose keys / values they read)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if self.num_kv_shared_layers == 0 or layer_number > first_shared:
            return False
        kind = self.layer_types[layer_number - 1]
        return kind not in self.layer_types[layer_number:first_shared]


def layout_refusal(arch, tp: int, pp: int) -> Optional[str]:
    """Why ``arch`` cannot run at this TP / PP (None when it can): TP above the full layers'
    KV heads (every PP size runs)."""
    if arch.global_kv_heads % tp:
        return (
            f"gemma4_text: num_global_key_value_heads={arch.global_kv_heads} is not divisible "
            f"by TP={tp}"
        )
    return None


def gemma4_transformer_config(arch, kw: dict) -> Gemma4Config:
    """The :class:`Gemma4Config` of ``arch`` from the builder's generic keyword arguments
    (``ValueError`` for TP above a layer type's KV heads, pipeline parallelism with
    key/value-shared layers or per-layer inputs without ``variable_seq_lengths``)."""
    pp = kw.get("pipeline_model_parallel_size", 1)
    why = layout_refusal(arch, kw.get("tensor_model_parallel_size", 1), pp)
    if why:
        raise ValueError(why)
    if (
        pp > 1
        and (arch.num_kv_shared_layers or arch.per_layer_input_size)
        and not kw.get("variable_seq_lengths")
    ):
        raise ValueError(
            "gemma4_text: pipeline parallelism with key/value-shared layers or per-layer "
            "inputs needs variable_seq_lengths (the stages send more than the hidden state)"
        )
    kw = dict(
        kw,
        activation_func=_gelu_tanh,
        softmax_scale=1.0,
        window_size=None,
        layer_types=tuple(arch.layer_types),
        sliding_window=arch.sliding_window,
        global_kv_channels=arch.global_head_dim,
        global_query_groups=arch.global_kv_heads,
        attention_k_eq_v=arch.attention_k_eq_v,
        num_kv_shared_layers=arch.num_kv_shared_layers,
        double_wide_mlp=arch.double_wide_mlp,
        per_layer_input_size=arch.per_layer_input_size,
        per_layer_vocab_size=arch.per_layer_vocab_size,
        # layers of different shapes: one checkpoint tensor per layer, not stacked
        hetereogenous_dist_checkpoint=True,
    )
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.moe_shared_ffn_hidden_size,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=True,
        )
    kw.pop("cp_comm_type", None)
    return Gemma4Config(**kw)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class Gemma4RMSNorm(torch.nn.Module):
    """transformers' ``Gemma4RMSNorm``: ``x * (ms + eps) ** -0.5 * weight`` in fp32, cast
    back; the weight starts at one."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # replicated across TP: with sequence parallelism its gradient is a partial sum
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return (_rms(x, self.eps) * self.weight.float()).type_as(x)


def _sized_linear(build, rows: int, input_size: int, _output_size: int, **kwargs):
    """``build`` (megatron's column-parallel linear) with ``rows`` output rows."""
    return build(input_size, rows, **kwargs)


class Gemma4SelfAttention(SelfAttention):
    """Self-attention with the layer type's head size and KV heads, the scale-less value norm,
    K = V (full layers with ``attention_k_eq_v``) and key/value sharing (see the module)."""

    def __init__(self, config: Gemma4Config, submodules, layer_number: int, *args, **kwargs):
        self.sliding = config.is_sliding(layer_number)
        self.shared = config.is_shared(layer_number)
        self.k_eq_v = config.attention_k_eq_v and not self.sliding
        layer_config = copy.copy(config)
        if not self.sliding:
            layer_config.kv_channels = config.global_kv_channels
            if self.k_eq_v:
                layer_config.num_query_groups = config.global_query_groups
        hd, heads = layer_config.kv_channels, layer_config.num_attention_heads
        groups = layer_config.num_query_groups
        rows = heads * hd + (0 if self.shared else (1 if self.k_eq_v else 2) * groups * hd)
        submodules = dataclasses.replace(
            submodules, linear_qkv=functools.partial(_sized_linear, submodules.linear_qkv, rows)
        )
        super().__init__(layer_config, submodules, layer_number, *args, **kwargs)
        if self.shared:
            self.k_layernorm = None  # no keys of its own
        self.stores_kv = config.stores_kv(layer_number)
        self.state: Optional[Gemma4ForwardState] = None  # set by finish_gemma4_model
        self.local_dim = config.kv_channels  # the sliding layers' table width

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """``(query, key, value)``: [sq, b, heads, hd] / [sq, b, groups, hd] (this rank's)."""
        if output_gate or not split_qkv:
            raise ValueError("gemma4_text: no attention output gate and no fused QKV RoPE")
        mixed, _ = self.linear_qkv(hidden_states)
        hd = self.hidden_size_per_attention_head
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        kind = SLIDING if self.sliding else FULL
        if self.shared:
            query = mixed.view(*mixed.shape[:2], -1, hd)
            key, value = self.state.kv[kind]
            key = self.state.read((kind, "key"), key)
            value = self.state.read((kind, "value"), value)
        else:
            parts = [per_group * hd, hd] + ([] if self.k_eq_v else [hd])
            split = torch.split(mixed.view(*mixed.shape[:2], groups, sum(parts)), parts, dim=3)
            query = split[0].reshape(*mixed.shape[:2], -1, hd)
            key = split[1]
            value = key if self.k_eq_v else split[2]
            key = self.k_layernorm(key)
            value = _rms(value, self.config.layernorm_epsilon).type_as(value)
            if self.stores_kv:
                self.state.kv[kind] = (key, value)
                # the query's gradient comes after the shared layers' backward
                query = self.state.deliver(query, kv_kinds=(kind,))
        return self.q_layernorm(query), key, value

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """As the parent, with this layer type's rotary table out of the side-by-side ones."""
        if rotary_pos_emb is not None:
            local = self.local_dim
            rotary_pos_emb = (
                rotary_pos_emb[..., :local] if self.sliding else rotary_pos_emb[..., local:]
            )
        return super().forward(
            hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
        )


class Gemma4TransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer`` with Gemma 4's post-sublayer norms, the per-layer input
    after the MLP and the ``layer_scalar`` buffer (see the module); key/value-shared layers'
    MLP twice as wide with ``double_wide_mlp``."""

    def __init__(self, config: Gemma4Config, submodules, layer_number: int = 1, **kwargs):
        number = _global_layer_number(config, layer_number, kwargs)  # layer_number: the chunk's
        if config.double_wide_mlp and config.is_shared(number):
            config = copy.copy(config)
            config.ffn_hidden_size = 2 * config.ffn_hidden_size
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        if self.layer_number != number:
            raise RuntimeError(
                f"gemma4_text: megatron numbered the layer {self.layer_number}, not {number}: "
                "its layer offset rule changed, revisit _global_layer_number"
            )
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.post_self_attn_layernorm = Gemma4RMSNorm(config, h, eps)
        self.post_mlp_layernorm = Gemma4RMSNorm(config, h, eps)
        self.self_attn_bda = _post_norm_bda(self.self_attn_bda, self.post_self_attn_layernorm)
        self.mlp_bda = _post_norm_bda(self.mlp_bda, self.post_mlp_layernorm)
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))
        d = config.per_layer_input_size
        if d:
            self.per_layer_input_gate = _replicated_linear(config, h, d)
            self.per_layer_projection = _replicated_linear(config, d, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(config, h, eps)
        self.state: Optional[Gemma4ForwardState] = None  # set by finish_gemma4_model

    def forward(self, *args, **kwargs):
        """The parent's layer, then the per-layer input block and the layer scalar."""
        hidden, context = super().forward(*args, **kwargs)
        if self.config.per_layer_input_size:
            x = _gelu_tanh(self.per_layer_input_gate(hidden))
            index = self.layer_number - 1
            x = x * self.state.read(
                (PER_LAYER_INPUT, index), self.state.per_layer_inputs[:, :, index]
            )
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(x))
        return hidden * self.layer_scalar, context


def _global_layer_number(config, layer_number: int, kwargs: dict) -> int:
    """The 1-based global number megatron's ``TransformerLayer`` will give the chunk's layer
    ``layer_number`` (its offset rule, before the layer is built)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    if kwargs.get("is_mtp_layer") or not kwargs.get("add_layer_offset", True):
        return layer_number
    pg = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    return layer_number + get_transformer_layer_offset(
        config, kwargs.get("vp_stage"), get_pg_rank(pg.pp)
    )


def gemma4_routing(logits: torch.Tensor, topk: int, per_expert_scale: torch.Tensor):
    """transformers' ``Gemma4TextRouter`` choice of ``logits`` [tokens, experts]: ``(probs,
    routing_map)``, both [tokens, experts] as megatron's routers return them. A softmax over
    every expert, its top-k renormalised to sum to one, each chosen weight times its
    expert's ``per_expert_scale``; in fp32, the weights cast back to ``logits``' dtype."""
    scores = torch.softmax(logits.float(), dim=-1)
    chosen, top = torch.topk(scores, topk, dim=-1)
    chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    chosen = chosen * per_expert_scale.float()[top]
    probs = torch.zeros_like(scores).scatter(1, top, chosen).type_as(logits)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    return probs, routing_map


class Gemma4TopKRouter(FamilyTopKRouter):
    """megatron's ``TopKRouter`` with Gemma 4's router: the gate reads the scale-less RMS norm of
    the layer's input times the learnt ``scale`` and ``hidden_size ** -0.5``; the choice and
    weights are :func:`gemma4_routing`. Without load-balancing losses (transformers computes
    none), token dropping and router replay, which it refuses."""

    family = GEMMA4_MODEL_TYPE

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        dtype, device = config.params_dtype, self.weight.device
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=dtype, device=device))
        self.per_expert_scale = torch.nn.Parameter(
            torch.ones(config.num_moe_experts, dtype=dtype, device=device)
        )
        for p in (self.scale, self.per_expert_scale):
            # replicated across TP: with sequence parallelism each rank routes its own tokens
            p.sequence_parallel = bool(config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """The gate's logits of the norm of ``input`` (transformers' order of operations)."""
        x = _rms(input, self.config.layernorm_epsilon).type_as(input)
        x = x * self.scale * self.config.hidden_size**-0.5
        return super().gating(x)

    def route(self, logits: torch.Tensor):
        """:func:`gemma4_routing` of ``logits`` [tokens, experts]."""
        return gemma4_routing(logits, self.topk, self.per_expert_scale)


class Gemma4MoELayer(MoELayer):
    """megatron's ``MoELayer`` as Gemma 4's MLP block with ``enable_moe_block``: the dense MLP
    (megatron's shared expert) and the routed experts side by side, each with its own norm
    before and after, summed. The layer gives it its un-normalised input (its
    ``pre_mlp_layernorm`` is an identity): the router normalises it itself, the dense branch
    through ``pre_shared_expert_layernorm`` (transformers' ``pre_feedforward_layernorm``), the
    experts through ``pre_moe_layernorm`` (``pre_feedforward_layernorm_2``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kw):
        super().__init__(config, submodules, layer_number, pg_collection, **kw)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.pre_shared_expert_layernorm = Gemma4RMSNorm(config, h, eps)
        self.pre_moe_layernorm = Gemma4RMSNorm(config, h, eps)
        self.post_shared_expert_layernorm = Gemma4RMSNorm(config, h, eps)
        self.post_moe_layernorm = Gemma4RMSNorm(config, h, eps)

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """The dense branch, normalised before and after."""
        out = super().shared_experts_compute(self.pre_shared_expert_layernorm(hidden_states))
        return self.post_shared_expert_layernorm(out)

    def preprocess(self, hidden_states, probs, routing_map):
        """The experts' input is normalised by their own norm (the router's is not)."""
        return super().preprocess(self.pre_moe_layernorm(hidden_states), probs, routing_map)

    def postprocess(self, output, shared_expert_output):
        """The experts' combined output normalised, plus the dense branch's."""
        output = self.post_moe_layernorm(self.token_dispatcher.combine_postprocess(output))
        return output + shared_expert_output


def _replicated_linear(config, n_in: int, n_out: int) -> torch.nn.Linear:
    """A bias-free linear replicated across TP (its weight marked sequence-parallel: under SP
    each rank sees its own tokens, so its gradient is a partial sum over TP)."""
    lin = torch.nn.Linear(n_in, n_out, bias=False, dtype=config.params_dtype)
    config.init_method(lin.weight)
    lin.weight.sequence_parallel = bool(config.sequence_parallel)
    return lin


def _post_norm_bda(bda, norm):
    """A bias-dropout-add builder whose added branch is normalised first (no bias)."""

    def builder(training, fused):
        add = bda(training, fused)

        def norm_then_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                raise ValueError("gemma4_text: a bias would be added after the post-norm")
            return add((norm(x), None), residual, prob)

        return norm_then_add

    return builder


def gemma4_block_spec(config: Gemma4Config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec: megatron's local layer spec with Gemma 4's layer, attention, norms and
    the packed attention with each layer's window; ``ValueError`` for TransformerEngine's spec,
    which is not wired."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if use_te:
        raise ValueError(
            "gemma4_text runs on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    experts = config.num_moe_experts
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    spec.module = Gemma4TransformerLayer
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = Gemma4RMSNorm
    if experts:
        mlp = layer.mlp
        if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
            raise ValueError(f"gemma4_text: an MoE layer spec of an unknown form: {mlp!r}")
        subs = dataclasses.replace(mlp.keywords["submodules"], router=Gemma4TopKRouter)
        layer.mlp = functools.partial(Gemma4MoELayer, **dict(mlp.keywords, submodules=subs))
        layer.pre_mlp_layernorm = IdentityOp  # Gemma4MoELayer normalises each branch itself
    layer.self_attention.module = Gemma4SelfAttention
    attn = layer.self_attention.submodules
    attn.core_attention = Gemma3CoreAttention
    attn.q_layernorm = attn.k_layernorm = Gemma4RMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=Gemma4RMSNorm)


class Gemma4RotaryTables(torch.nn.Module):
    """Both rotary tables, the sliding layers' (``head_dim``) and the full layers'
    (``global_head_dim``, proportional: only ``partial_rotary_factor`` of the frequencies
    non-zero), side by side on the last dimension, in place of ``GPTModel.rotary_pos_emb``."""

    def __init__(self, config: Gemma4Config, arch, cp_group=None):
        super().__init__()
        common = dict(
            rotary_percent=1.0,
            rotary_interleaved=False,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=cp_group,
        )
        self.local = RotaryEmbedding(
            kv_channels=arch.head_dim, rotary_base=arch.rope_local_theta, **common
        )
        self.full = RotaryEmbedding(
            kv_channels=arch.global_head_dim, rotary_base=arch.rope_theta, **common
        )
        hd = arch.global_head_dim
        angles = int(arch.rotary_percent * hd // 2)
        dev = self.full.inv_freq.device
        exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=dev).float() / hd
        inv = torch.cat([1.0 / (arch.rope_theta**exps), torch.zeros(hd // 2 - angles, device=dev)])
        self.full.inv_freq = inv / arch.rope_scaling_factor

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """megatron's rotary length of the step (same for both tables)."""
        return self.full.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """``[max_seq_len, 1, 1, head_dim + global_head_dim]``."""
        return torch.cat(
            [
                self.local(max_seq_len, offset, packed_seq, cp_group),
                self.full(max_seq_len, offset, packed_seq, cp_group),
            ],
            dim=-1,
        )


def finish_gemma4_model(model, arch, config: Gemma4Config, cp_group=None) -> None:
    """Give a freshly built ``GPTModel`` Gemma 4's rotary tables, embedding scale, per-layer
    input modules (first stage), the forward state its layers share and, under pipeline
    parallelism, what the chunk sends and receives besides the hidden state
    (:mod:`areal_mega.models.gemma4_pipeline`)."""
    model.rotary_pos_emb = Gemma4RotaryTables(config, arch, cp_group=cp_group)
    scale_embeddings(model, arch)
    state = Gemma4ForwardState(relayed=config.recompute_granularity == "full")
    layers = model.decoder.layers
    for layer in layers:
        layer.state = layer.self_attention.state = state
    model.register_forward_pre_hook(lambda *_: state.begin())
    model.decoder.register_forward_hook(lambda _m, _a, out: state.resume_in_backward(out))
    tp = config.tensor_model_parallel_size
    if not model.post_process:
        sent = pipeline.in_flight(config, layers[-1].layer_number, tp)
        model.decoder.register_forward_hook(lambda _m, _a, out: pipeline.send(out, state, sent))
    if not model.pre_process:
        got = pipeline.in_flight(config, layers[0].layer_number - 1, tp)
        factor = tp if config.sequence_parallel else 1

        def split_received(decoder, _args):
            if decoder.input_tensor is not None:
                decoder.input_tensor = pipeline.receive(
                    decoder.input_tensor, config.hidden_size, state, got, factor
                )

        model.decoder.register_forward_pre_hook(split_received)
    if not state.relayed:  # after the send above
        model.decoder.register_forward_hook(lambda *_: state.begin())
    d = config.per_layer_input_size
    if not d or getattr(model, "embedding", None) is None:
        return
    n = config.num_layers
    tp_group = model.pg_collection.tp
    model.per_layer_embedding = tensor_parallel.VocabParallelEmbedding(
        config.per_layer_vocab_size,
        n * d,
        config=config,
        init_method=config.init_method,
        tp_group=tp_group,
    )
    model.per_layer_model_proj = tensor_parallel.ColumnParallelLinear(
        config.hidden_size,
        n * d,
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=True,
        tp_group=tp_group,
    )
    model.per_layer_proj_norm = Gemma4RMSNorm(config, d, config.layernorm_epsilon)

    def per_layer_inputs(_module, _args, kwargs, embedded):
        input_ids = kwargs["input_ids"]  # [b, s]
        tok = model.per_layer_embedding(input_ids.transpose(0, 1).contiguous())
        tok = tok * torch.tensor(math.sqrt(d), dtype=tok.dtype)
        if config.sequence_parallel:
            tok = tensor_parallel.scatter_to_sequence_parallel_region(tok, group=tp_group)
        proj, _ = model.per_layer_model_proj(embedded)  # SP: gathers the sequence
        if config.sequence_parallel:
            proj = tensor_parallel.scatter_to_sequence_parallel_region(proj, group=tp_group)
        proj = proj * config.hidden_size**-0.5
        proj = model.per_layer_proj_norm(proj.view(*proj.shape[:2], n, d))
        state.per_layer_inputs = (proj + tok.view(*tok.shape[:2], n, d)) * 2.0**-0.5
        # the decoder's input: its gradient comes after every layer's backward
        return state.deliver(embedded, per_layer_inputs=True)

    model.embedding.register_forward_hook(per_layer_inputs, with_kwargs=True)
