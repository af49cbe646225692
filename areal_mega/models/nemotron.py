"""Nemotron (``model_type: nemotron``: Nemotron-3, Nemotron-4, Minitron) on megatron's local
layer spec.

The architecture fields come from Megatron-Bridge's provider (LayerNorm, zero-centred gamma,
squared-ReLU MLP without a gate, no linear biases, partial rotary); what megatron's local spec
lacks is the norm: its torch ``LayerNorm`` refuses ``layernorm_zero_centered_gamma`` (TE and
apex implement it). :class:`LayerNorm1P` is transformers' ``NemotronLayerNorm1P``: LayerNorm
with a bias and the gain ``1 + weight``, every norm of the model (input, pre-MLP and final).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from areal_mega.models.decoder_fields import decoder_fields
from areal_mega.models.gemma3 import block_spec_with_norm

NEMOTRON_MODEL_TYPE = "nemotron"
_RELU2 = ("relu2",)


class LayerNorm1P(torch.nn.Module):
    """LayerNorm over the last dimension with gain ``1 + weight`` and a bias, computed in the
    input's dtype (transformers' ``NemotronLayerNorm1P``); the weight and bias start at zero.
    Megatron's norm signature ``(config, hidden_size, eps)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # replicated across TP: with sequence parallelism their gradients are partial sums
        for p in (self.weight, self.bias):
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return F.layer_norm(x, (self.hidden_size,), self.weight + 1, self.bias, self.eps)


def nemotron_arch_fields(hf: dict) -> dict[str, Any]:
    """Pure: the :class:`~areal_mega.models.builder.HFArch` fields of a ``nemotron`` config
    dict (the converters' facts; the megatron config comes from the bridge's provider). Raises
    ``ValueError`` naming the key of any feature the provider does not carry."""
    act = hf.get("hidden_act", "relu2")
    if act not in _RELU2:
        raise ValueError(f"hidden_act={act!r} is not supported for nemotron (relu2 only)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(
                f"{key}=True is not supported for nemotron (Megatron-Bridge's provider sets "
                "add_bias_linear=False and its registry maps no bias)"
            )
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope type {rp.get('rope_type', rp.get('type'))!r} is not supported")
    partial = hf.get("partial_rotary_factor", rp.get("partial_rotary_factor", 0.5))
    return dict(
        decoder_fields(
            hf,
            model_type=NEMOTRON_MODEL_TYPE,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            eps_key="norm_eps",
            initializer_range=0.0134,
        ),
        qkv_bias=False,
        qk_norm=False,
        rotary_percent=float(partial),
        activation="relu2",
        normalization="LayerNorm",
        gated_mlp=False,
    )


def nemotron_block_spec(config, *, use_te: bool, vp_stage: Optional[int] = None):
    """The block spec of this pipeline stage (chunk) of a Nemotron model: megatron's local
    layer spec with :class:`LayerNorm1P` as every norm, and our packed attention."""
    return block_spec_with_norm(
        config, LayerNorm1P, "LayerNorm", NEMOTRON_MODEL_TYPE, use_te=use_te, vp_stage=vp_stage
    )
