"""Gemma 2 (``model_type: gemma2``, ``Gemma2ForCausalLM``) on megatron's local spec.

Gemma 2 is Gemma 3's layer (:mod:`areal_mega.models.gemma3`: ``(1 + w)`` fp32 RMSNorms, the
post-attention and post-feedforward norms inside the output projections, GELU-tanh GLU,
embeddings scaled by ``sqrt(hidden_size)``, softmax scale ``query_pre_attn_scalar ** -0.5``,
``layer_types`` choosing sliding-window or full attention per layer) without QK norms, with one
RoPE base for every layer, and with two soft-caps, each matched to transformers'
``Gemma2Model``:

* attention logits: ``c · tanh(scores / c)`` before the mask (``attn_logit_softcapping``),
  computed by the packed attention (:func:`areal_mega.models.varlen_attention.attention`);
* final logits: ``c · tanh(logits / c)`` (``final_logit_softcapping``), applied where
  megatron's ``GPTModel`` scales its logits (:func:`softcap_logits`), so every logits path
  (the loss rows, the full logits, the vocabulary-parallel logprobs) sees them capped.

transformers computes the attention soft-cap in its eager attention only (its SDPA path drops
it): our CPU rollout server loads such models with ``attn_implementation="eager"``
(:mod:`areal_mega.inference.server_state`). Refused (``ValueError`` naming the key): rope types
other than default, bidirectional attention, biases, other activations, untied embeddings.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.gemma3 import (
    FULL,
    SLIDING,
    check_gemma_config,
    default_rope,
    layer_types_and_window,
)

GEMMA2_MODEL_TYPE = "gemma2"


def _cap(hf: dict, key: str):
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key}={value!r}: must be a positive number or null")
    return float(value)


def gemma2_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``gemma2`` config dict.
    Raises ``ValueError`` naming the key of any feature this implementation lacks."""
    check_gemma_config(hf, GEMMA2_MODEL_TYPE, "Gemma2ForCausalLM", "hidden_activation")
    rp = default_rope(hf)
    n_layers = int(hf["num_hidden_layers"])
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    layer_types, window = layer_types_and_window(
        hf, [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
    )
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta = float(hf.get("rope_theta", rp.get("rope_theta", 10_000.0)))
    return dict(
        decoder_fields(
            hf, model_type=GEMMA2_MODEL_TYPE, max_position_embeddings=8192, rms_norm_eps=1e-6
        ),
        rope_theta=theta,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
        sliding_window=window,
        activation="gelu_tanh",
        layer_types=layer_types,
        rope_local_theta=theta,
        softmax_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        attn_logit_softcapping=_cap(hf, "attn_logit_softcapping"),
        final_logit_softcapping=_cap(hf, "final_logit_softcapping"),
    )


def softcap_logits(model, cap: float) -> None:
    """Cap a ``GPTModel``'s logits at ``cap`` by tanh (after its own scaling, which is the
    identity without muP): ``GPTModel._scale_logits`` is where every logits path passes."""

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = type(self)._scale_logits(self, logits)
        return torch.tanh(logits / cap) * cap

    model._scale_logits = types.MethodType(scale_logits, model)
