"""Gemma 3 (text, ``model_type: gemma3_text``, ``Gemma3ForCausalLM``) on megatron's local spec.

What Gemma 3 changes against the Llama math of :mod:`areal_mega.models.builder`, each matched
to transformers' ``Gemma3TextModel``:

* every RMSNorm scales by ``(1 + weight)`` (weights stored zero-centred), computed in fp32:
  :class:`Gemma3RMSNorm` (input, pre-feedforward, q/k and final norms);
* the attention output and the MLP output are normalised *before* their residual adds
  (``post_attention_layernorm`` / ``post_feedforward_layernorm``). megatron's
  ``TransformerLayer`` has no slot for that; like Megatron-Bridge's Gemma 3 provider the norm
  sits inside the row-parallel output projection (:class:`RowParallelLinearWithPostNorm`), so
  the parameters are ``self_attention.linear_proj.post_layernorm.weight`` and
  ``mlp.linear_fc2.post_layernorm.weight``, the names of the bridge's registry;
* the word embeddings are multiplied by ``sqrt(hidden_size)`` in the embedding's dtype;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``; the MLP is a GELU-tanh GLU;
* ``layer_types`` choose per layer between sliding-window attention (window ``sliding_window``,
  RoPE base ``rope_local_base_freq``) and full attention (RoPE base ``rope_theta``, optionally
  linearly scaled): :class:`DualRotaryEmbedding` gives every layer both rotary tables stacked
  ``[local, full]`` and :class:`Gemma3SelfAttention` / :class:`Gemma3CoreAttention` pick the
  layer's table and window by its global layer number.

Refused (``ValueError`` naming the key): logit soft-capping, bidirectional attention, rope
types other than default/linear, a local RoPE that is scaled, other activations, biases.
TransformerEngine's spec is not wired (the local spec runs on CPU and GPU).

Gemma 1 (``model_type: gemma``) is a Llama layer with these norms, activation and embedding
scale: its megatron config comes from Megatron-Bridge's Gemma provider
(:mod:`areal_mega.models.bridge_provider`), its block spec from :func:`gemma_block_spec`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.varlen_attention import VarlenDotProductAttention

__all__ = [
    "GEMMA3_MODEL_TYPE",
    "SLIDING",
    "FULL",
    "gemma3_arch_fields",
    "Gemma3Config",
    "gemma3_transformer_config",
    "gemma3_block_spec",
    "finish_gemma3_model",
    "Gemma3RMSNorm",
    "RowParallelLinearWithPostNorm",
    "DualRotaryEmbedding",
    "Gemma3SelfAttention",
    "Gemma3CoreAttention",
    "GEMMA_MODEL_TYPE",
    "gemma_arch_fields",
    "gemma_block_spec",
    "block_spec_with_norm",
    "post_norm_block_spec",
    "check_gemma_config",
    "default_rope",
    "layer_types_and_window",
    "scale_embeddings",
]

#: Gemma (1): the Gemma 3 norms, activation and embedding scale on a plain Llama layer
GEMMA_MODEL_TYPE = "gemma"

GEMMA3_MODEL_TYPE = "gemma3_text"
SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _rope_of(hf: dict, layer_type: str) -> dict:
    """The RoPE parameters of one layer type, from transformers 5's ``rope_parameters``
    (``{layer_type: {...}}``) or the hub spelling (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling`` for full layers)."""
    rp = hf.get("rope_parameters") or {}
    if layer_type in rp and rp[layer_type] is not None:
        return dict(rp[layer_type])
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    out = dict(hf.get("rope_scaling") or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = hf.get("rope_theta", 1_000_000.0)
    return out


def check_gemma_config(hf: dict, model_type: str, architecture: str, act_key: str) -> None:
    """What every Gemma (1, 2, 3) refuses, naming the key (``ValueError``): bidirectional
    attention, an activation other than GELU-tanh (named ``act_key`` in the message), attention
    biases, untied embeddings (``architecture``'s bridge registry maps no ``lm_head``)."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal LM only)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"{act_key}={act!r} is not supported (gelu_pytorch_tanh only)")
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {model_type}")
    if not hf.get("tie_word_embeddings", True):
        raise ValueError(
            f"tie_word_embeddings=False is not supported for {model_type} "
            f"(Megatron-Bridge's {architecture} registry maps no lm_head)"
        )


def default_rope(hf: dict) -> dict:
    """The RoPE parameters of a Gemma (1, 2) config, which must be the default type
    (``ValueError`` naming it otherwise)."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope type {rp.get('rope_type', rp.get('type'))!r} is not supported")
    return rp


def layer_types_and_window(hf: dict, default: list) -> tuple:
    """``(layer_types, sliding window or None)`` of a config with per-layer attention
    (``default``: the layer types when the config has none), validated (``ValueError``
    naming the key)."""
    n_layers = int(hf["num_hidden_layers"])
    layer_types = tuple(hf.get("layer_types") or default)
    if len(layer_types) != n_layers or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(
            f"layer_types={list(layer_types)!r}: need {n_layers} entries, each "
            f"{SLIDING!r} or {FULL!r}"
        )
    if SLIDING not in layer_types:
        return layer_types, None
    window = hf.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r}: must be a positive integer")
    return layer_types, int(window)


def gemma3_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``gemma3_text`` config
    dict. Raises ``ValueError`` naming the key of any feature this implementation lacks."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(
                f"{key}={hf[key]!r} is not supported (logit soft-capping; Gemma 3 "
                "has none: set it to null)"
            )
    check_gemma_config(hf, GEMMA3_MODEL_TYPE, "Gemma3ForCausalLM", "hidden_activation")
    n_layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    pattern = int(hf.get("sliding_window_pattern", 6))
    layer_types, window = layer_types_and_window(
        hf, [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    )
    local, full = _rope_of(hf, SLIDING), _rope_of(hf, FULL)
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters[{SLIDING!r}].rope_type="
            f"{local.get('rope_type')!r} is not supported (default only)"
        )
    full_type = full.get("rope_type", "default")
    if full_type not in ("default", "linear"):
        raise ValueError(
            f"rope_scaling type {full_type!r} (full-attention layers) is not "
            "supported (default or linear)"
        )
    factor = float(full.get("factor", 1.0)) if full_type == "linear" else 1.0
    head_dim = int(hf.get("head_dim") or hidden // heads)
    return dict(
        decoder_fields(
            hf,
            model_type=GEMMA3_MODEL_TYPE,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        rope_theta=float(full["rope_theta"]),
        qkv_bias=False,
        qk_norm=True,
        sliding_window=window,
        activation="gelu_tanh",
        layer_types=layer_types,
        rope_local_theta=float(local["rope_theta"]),
        rope_scaling_factor=factor,
        softmax_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
    )


@dataclass
class Gemma3Config(TransformerConfig):
    """megatron ``TransformerConfig`` with Gemma 3's per-layer attention choice: ``layer_types``
    (global layer index -> ``sliding_attention`` / ``full_attention``) and the window of the
    sliding layers (``window_size`` itself stays None: it would apply to every layer)."""

    layer_types: tuple = ()
    sliding_window: Optional[int] = None
    attn_logit_softcapping: Optional[float] = None  # Gemma 2 (areal_mega/models/gemma2.py)

    def is_sliding(self, layer_number: int) -> bool:
        """Whether megatron's 1-based global ``layer_number`` is a sliding-window layer."""
        return self.layer_types[layer_number - 1] == SLIDING


def gemma3_transformer_config(arch, kw: dict) -> Gemma3Config:
    """The :class:`Gemma3Config` of ``arch`` from the builder's generic keyword arguments."""
    kw = dict(
        kw,
        activation_func=_gelu_tanh,
        softmax_scale=arch.softmax_scale,
        window_size=None,
        layer_types=tuple(arch.layer_types),
        sliding_window=arch.sliding_window,
        attn_logit_softcapping=arch.attn_logit_softcapping,
    )
    kw.pop("cp_comm_type", None)
    return Gemma3Config(**kw)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


class Gemma3RMSNorm(torch.nn.Module):
    """RMSNorm scaling by ``(1 + weight)`` in fp32, cast back to the input's dtype
    (transformers' ``Gemma3RMSNorm``); the weight starts at zero."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # replicated across TP: with sequence parallelism its gradient is a partial sum
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class RowParallelLinearWithPostNorm(RowParallelLinear):
    """megatron's ``RowParallelLinear`` followed by a norm of its (reduced) output, named
    ``post_layernorm``: Gemma 3's post-attention / post-feedforward norm (:class:`Gemma3RMSNorm`;
    a subclass sets another ``post_norm``, a module of megatron's norm signature)."""

    post_norm = Gemma3RMSNorm

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = self.post_norm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        """``(norm(output), bias)``; no bias (``skip_bias_add`` returns None)."""
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:
            raise ValueError("RowParallelLinearWithPostNorm: a bias would be added after the norm")
        return self.post_layernorm(output), None


class DualRotaryEmbedding(torch.nn.Module):
    """Both rotary tables of Gemma 3, stacked ``[local, full]`` on a new first dimension, in
    place of ``GPTModel.rotary_pos_emb`` (which megatron passes unchanged to every layer)."""

    def __init__(self, config: Gemma3Config, arch, cp_group=None):
        super().__init__()
        common = dict(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=cp_group,
        )
        self.local = RotaryEmbedding(rotary_base=arch.rope_local_theta, **common)
        self.full = RotaryEmbedding(rotary_base=arch.rope_theta, **common)
        # linear scaling (transformers' "linear" rope type) divides the frequencies
        self.full.inv_freq = self.full.inv_freq / arch.rope_scaling_factor

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """megatron's rotary length of the step (same for both tables)."""
        return self.full.get_rotary_seq_len(*args, **kwargs)

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None
    ) -> torch.Tensor:
        """``[2, max_seq_len, 1, 1, d]``: the local and the full table."""
        return torch.stack(
            [
                self.local(max_seq_len, offset, packed_seq, cp_group),
                self.full(max_seq_len, offset, packed_seq, cp_group),
            ]
        )


class Gemma3SelfAttention(SelfAttention):
    """megatron ``SelfAttention`` that takes its layer's table out of the stacked
    :class:`DualRotaryEmbedding` output."""

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """As the parent, with ``rotary_pos_emb`` [2, ...] reduced to this layer's table."""
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[0 if self.config.is_sliding(self.layer_number) else 1]
        return super().forward(
            hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
        )


class Gemma3CoreAttention(VarlenDotProductAttention):
    """The packed local attention with the window of its layer (sliding layers only) and the
    attention-logit soft-cap (Gemma 2)."""

    def __init__(self, config: Gemma3Config, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.window = config.sliding_window if config.is_sliding(self.layer_number) else None
        self.softcap = config.attn_logit_softcapping


def gemma3_block_spec(config: Gemma3Config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk): megatron's local layer spec with
    Gemma 3's norms, post-norm projections and per-layer attention, and its final norm (Gemma 2:
    the same without QK norms)."""
    return post_norm_block_spec(
        config,
        norm=Gemma3RMSNorm,
        pre_norm=Gemma3RMSNorm,
        post_linear=RowParallelLinearWithPostNorm,
        self_attention=Gemma3SelfAttention,
        core_attention=Gemma3CoreAttention,
        model_type="gemma3_text and gemma2",
        use_te=use_te,
        vp_stage=vp_stage,
    )


def post_norm_block_spec(
    config,
    *,
    norm,
    pre_norm,
    post_linear,
    core_attention,
    model_type: str,
    use_te: bool,
    self_attention=None,
    vp_stage: Optional[int] = None,
):
    """megatron's local layer spec (RMSNorm) whose attention output projection and MLP down
    projection are ``post_linear`` (a :class:`RowParallelLinearWithPostNorm`: the sublayer's
    output normalised before the residual add), ``pre_norm`` before each sublayer (IdentityOp:
    none), ``norm`` as the QK norms (when ``config.qk_layernorm``) and the final norm, and
    ``self_attention`` / ``core_attention`` as the attention modules (None: megatron's
    ``SelfAttention``): Gemma 2 / 3 and EXAONE 4. ``ValueError`` naming ``model_type`` for
    TransformerEngine's spec, which is not wired."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if use_te:
        raise ValueError(
            f"{model_type} run on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    qk_norm = bool(config.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    layer = spec.submodules
    layer.input_layernorm = pre_norm
    layer.pre_mlp_layernorm = pre_norm
    if self_attention is not None:
        layer.self_attention.module = self_attention
    attn = layer.self_attention.submodules
    attn.core_attention = core_attention
    if qk_norm:
        attn.q_layernorm = attn.k_layernorm = norm
    attn.linear_proj = post_linear
    # the dense MLP spec is a partial of MLP.as_mlp_submodule over (frozen) MLPSubmodules
    mlp = layer.mlp
    layer.mlp = functools.partial(
        mlp.func,
        *mlp.args,
        **dict(
            mlp.keywords,
            submodules=dataclasses.replace(mlp.keywords["submodules"], linear_fc2=post_linear),
        ),
    )
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=norm)


def finish_gemma3_model(model, arch, config: Gemma3Config, cp_group=None) -> None:
    """Give a freshly built ``GPTModel`` Gemma 3's rotary tables and embedding scale."""
    model.rotary_pos_emb = DualRotaryEmbedding(config, arch, cp_group=cp_group)
    scale_embeddings(model, arch)


def scale_embeddings(model, arch) -> None:
    """Multiply a ``GPTModel``'s word embeddings by ``sqrt(hidden_size)`` in their dtype (every
    Gemma; first pipeline stage only)."""
    if getattr(model, "embedding", None) is not None:
        scale = math.sqrt(arch.hidden_size)

        def scale_embeddings(module, _inputs, output):
            return output * torch.tensor(scale, dtype=module.word_embeddings.weight.dtype)

        model.embedding.register_forward_hook(scale_embeddings)


def gemma_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``gemma`` config dict
    (the converters' facts; the megatron config comes from the bridge's provider). Raises
    ``ValueError`` naming the key of any feature this implementation lacks."""
    check_gemma_config(hf, GEMMA_MODEL_TYPE, "GemmaForCausalLM", "hidden_act")
    default_rope(hf)
    return dict(
        decoder_fields(
            hf,
            model_type=GEMMA_MODEL_TYPE,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        qkv_bias=False,
        qk_norm=False,
        activation="gelu_tanh",
    )


def gemma_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk) of a Gemma (1) model: megatron's local
    layer spec with :class:`Gemma3RMSNorm` (``(1 + w)``, fp32) as every norm, and our packed
    attention. The bridge's provider says ``layernorm_zero_centered_gamma``, which megatron's
    local (torch) norm does not implement; its TE spec does."""
    return block_spec_with_norm(
        config, Gemma3RMSNorm, "RMSNorm", GEMMA_MODEL_TYPE, use_te=use_te, vp_stage=vp_stage
    )


def block_spec_with_norm(
    config, norm, normalization: str, model_type: str, *, use_te: bool, vp_stage=None
):
    """megatron's local layer spec (``normalization``) with ``norm`` (a module of megatron's
    norm signature) as every norm of the block, input, pre-MLP and final, and our packed
    attention: the dense families whose norm megatron's torch norm does not implement
    (Gemma's ``(1 + w)`` RMSNorm, Nemotron's ``LayerNorm1P``). ``ValueError`` naming
    ``model_type`` for TransformerEngine's spec, which is not wired."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if use_te:
        raise ValueError(
            f"{model_type} runs on megatron's local layer spec only "
            "(model.attention_backend other than TransformerEngine)"
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, normalization=normalization
    )
    layer = spec.submodules
    layer.input_layernorm = norm
    layer.pre_mlp_layernorm = norm
    layer.self_attention.submodules.core_attention = VarlenDotProductAttention
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=norm)
