"""Falcon-H1's megatron-core modules (the layer spec, the parallel Mamba / attention mixer, the
muP-scaled Mamba input projection and MLP, the embedding and logit scales); what they compute
and why the engine builds its own Falcon-H1 is :mod:`areal_mega.models.falcon_h1`'s docstring."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from areal_mega.models.falcon_h1 import MULTIPLIERS_ATTR, FalconH1Multipliers
from areal_mega.models.varlen_attention import VarlenDotProductAttention

__all__ = [
    "FalconH1InProj",
    "FalconH1Mixer",
    "FalconH1MixerSubmodules",
    "FalconH1MLP",
    "falcon_h1_layer_spec",
    "finish_falcon_h1_model",
    "attach_multipliers",
]


def _multipliers_of(config) -> FalconH1Multipliers:
    m = getattr(config, MULTIPLIERS_ATTR, None)
    if m is None:
        raise ValueError("falcon_h1: the TransformerConfig carries no Falcon-H1 multipliers")
    return m


class FalconH1InProj(ColumnParallelLinear):
    """The Mamba mixer's input projection (column parallel): ``W (x * ssm_in_multiplier)``, its
    sections z, x, B, C, dt then scaled by ``ssm_multipliers`` (this rank's slice of each)."""

    def __init__(self, input_size: int, output_size: int, *, config, tp_group=None, **kw):
        super().__init__(input_size, output_size, config=config, tp_group=tp_group, **kw)
        m = _multipliers_of(config)
        tp = tp_group.size() if tp_group is not None else 1
        heads, head_dim = config.mamba_num_heads, config.mamba_head_dim
        inner, bc = heads * head_dim // tp, config.mamba_num_groups * config.mamba_state_dim // tp
        sizes = (inner, inner, bc, bc, heads // tp)
        vector = torch.cat([torch.full((n,), v) for n, v in zip(sizes, m.ssm)])
        self.register_buffer("mup_vector", vector, persistent=False)
        self.ssm_in = m.ssm_in

    def forward(self, x, *args, **kwargs):
        """``(W (x * ssm_in) * mup_vector, bias)``."""
        out, bias = super().forward(x * self.ssm_in, *args, **kwargs)
        return out * self.mup_vector.to(out.dtype), bias


@dataclasses.dataclass
class FalconH1MixerSubmodules(SelfAttentionSubmodules):
    """megatron's self-attention submodules and the Mamba mixer's spec."""

    mamba_mixer: Any = None


class FalconH1Mixer(SelfAttention):
    """A Falcon-H1 layer's token mixer: megatron's self-attention and a Mamba-2 mixer side by
    side on the same normed input, ``mamba * ssm_out + attention(x * attention_in) *
    attention_out`` (the keys times ``key_multiplier``)."""

    def __init__(self, config, submodules: FalconH1MixerSubmodules, layer_number: int, **kw):
        super().__init__(config, submodules, layer_number, **kw)
        self.multipliers = _multipliers_of(config)
        self.mamba_mixer = build_module(
            submodules.mamba_mixer,
            config=config,
            d_model=config.hidden_size,
            layer_number=layer_number,
            pg_collection=self.pg_collection,
            pp_layer_offset=kw.get("pp_layer_offset") or 0,
        )

    def get_query_key_value_tensors(self, *args, **kwargs):
        """megatron's query, key and value, the key times ``key_multiplier`` (before RoPE, as
        transformers applies it)."""
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError("falcon_h1: the key multiplier needs split query / key / value")
        query, key, value = out
        return query, key * self.multipliers.key, value

    def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
        """``(mamba(x) * ssm_out + attention(x * attention_in) * attention_out, None)``."""
        m = self.multipliers
        mamba, _ = self.mamba_mixer(hidden_states, packed_seq_params=packed_seq_params)
        attention, bias = super().forward(
            hidden_states * m.attention_in,
            attention_mask,
            *args,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )
        if bias is not None:
            attention = attention + bias
        return mamba * m.ssm_out + attention * m.attention_out, None


class FalconH1MLP(MLP):
    """megatron's gated MLP with Falcon-H1's multipliers: ``down(up(x) * silu(gate(x) * g)) * d``
    (``mlp_multipliers`` = (g, d))."""

    def forward(self, hidden_states, *args, **kwargs):
        """``(output, None)``."""
        gate_mult, down_mult = _multipliers_of(self.config).mlp
        fc1, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1 = fc1 + bias
        gate, up = torch.chunk(fc1, 2, dim=-1)
        out, bias = self.linear_fc2(up * F.silu(gate * gate_mult))
        if bias is not None:
            out = out + bias
        return out * down_mult, None


def falcon_h1_layer_spec(mixer_params: dict):
    """The local layer spec: megatron's local GPT layer (RMSNorms, our packed attention) with
    :class:`FalconH1Mixer` as its self-attention (megatron's Mamba mixer inside, built with
    ``mixer_params``) and :class:`FalconH1MLP` as its MLP."""
    spec = get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, normalization="RMSNorm"
    )
    attn = spec.submodules.self_attention
    sub = attn.submodules
    attn.module = FalconH1Mixer
    attn.submodules = FalconH1MixerSubmodules(
        **{f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)},
        mamba_mixer=ModuleSpec(
            module=MambaMixer,
            params=dict(mixer_params),
            submodules=MambaMixerSubmodules(in_proj=FalconH1InProj, out_proj=RowParallelLinear),
        ),
    )
    attn.submodules.core_attention = VarlenDotProductAttention
    # the local spec's MLP is a builder (``MLP.as_mlp_submodule`` with its submodules)
    spec.submodules.mlp = functools.partial(
        FalconH1MLP.as_mlp_submodule, **spec.submodules.mlp.keywords
    )
    return spec


def finish_falcon_h1_model(model, multipliers: FalconH1Multipliers) -> None:
    """Scale a ``GPTModel``'s embeddings by ``embedding_multiplier`` (first pipeline stage) and
    its logits by ``lm_head_multiplier`` (``GPTModel._scale_logits``, where every logits path
    passes)."""
    if getattr(model, "embedding", None) is not None and multipliers.embedding != 1.0:

        def scale_embeddings(_module, _inputs, output):
            return output * multipliers.embedding

        model.embedding.register_forward_hook(scale_embeddings)
    if multipliers.lm_head != 1.0:

        def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
            return type(self)._scale_logits(self, logits) * multipliers.lm_head

        model._scale_logits = types.MethodType(scale_logits, model)


def attach_multipliers(config, multipliers: FalconH1Multipliers) -> None:
    """Give ``config`` (a ``TransformerConfig``) the multipliers the modules read."""
    setattr(config, MULTIPLIERS_ATTR, multipliers)
