"""Gemma 3 text (areal_mega/models/gemma3.py): the config reader against transformers' own
``Gemma3TextConfig`` spellings, its refusals, the megatron config it gives, and the modules'
math against transformers' ``Gemma3RMSNorm``. The engine-vs-transformers logits, layouts and RL
steps are in tests/test_new_families.py."""

import math

import pytest
import torch

from areal_mega.models.builder import parse_hf_config, transformer_config_from_hf
from areal_mega.models.gemma3 import FULL, SLIDING, Gemma3RMSNorm, gemma3_arch_fields

GEMMA = dict(
    model_type="gemma3_text",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=64,
    max_position_embeddings=128,
    sliding_window=8,
    query_pre_attn_scalar=16,
    hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
)


def test_transformers_config_is_read_as_transformers_reads_it():
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(
        **{k: v for k, v in GEMMA.items() if k != "model_type"},
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 1234.0},
            FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
        },
        layer_types=[SLIDING, FULL, FULL, SLIDING],
    ).to_dict()
    arch = parse_hf_config(hf)
    assert arch.layer_types == (SLIDING, FULL, FULL, SLIDING)
    assert (arch.rope_local_theta, arch.rope_theta, arch.rope_scaling_factor) == (1234.0, 5e5, 8.0)
    assert arch.sliding_window == 8 and arch.head_dim == 12 and arch.qk_norm
    assert arch.tie_word_embeddings and arch.activation == "gelu_tanh"
    assert math.isclose(arch.softmax_scale, 16**-0.5)


def test_hub_spelling_and_default_pattern():
    """Hub configs: rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern
    (every 6th layer full) instead of layer_types."""
    hub = dict(
        GEMMA,
        num_hidden_layers=12,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    f = gemma3_arch_fields(hub)
    assert [i for i, t in enumerate(f["layer_types"]) if t == FULL] == [5, 11]
    assert (f["rope_local_theta"], f["rope_theta"], f["rope_scaling_factor"]) == (1e4, 1e6, 8.0)
    assert gemma3_arch_fields(dict(GEMMA, rope_theta=1e6))["rope_scaling_factor"] == 1.0


@pytest.mark.parametrize(
    "override,key",
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="silu"), "hidden_activation"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (
            dict(
                rope_parameters={SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
            ),
            "rope_type",
        ),
        (dict(layer_types=[SLIDING, "chunked_attention", FULL, FULL]), "layer_types"),
        (dict(layer_types=[SLIDING, FULL]), "layer_types"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(sliding_window=0), "sliding_window"),
    ],
)
def test_unsupported_features_are_refused_by_name(override, key):
    with pytest.raises(ValueError, match=key):
        parse_hf_config(dict(GEMMA, **override))


def test_full_attention_only_needs_no_window():
    f = gemma3_arch_fields(dict(GEMMA, sliding_window=None, layer_types=[FULL] * 4))
    assert f["sliding_window"] is None


def test_megatron_config_per_layer_attention():
    arch = parse_hf_config(dict(GEMMA, layer_types=[SLIDING, FULL, SLIDING, FULL]))
    cfg = transformer_config_from_hf(arch, tp=2)
    assert cfg.window_size is None and cfg.sliding_window == 8  # per layer, not global
    assert [cfg.is_sliding(n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    assert math.isclose(cfg.softmax_scale, 16**-0.5)
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(cfg.activation_func(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert cfg.gated_linear_unit and cfg.qk_layernorm and cfg.kv_channels == 12


def test_rmsnorm_equals_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as HFNorm

    cfg = transformer_config_from_hf(parse_hf_config(GEMMA))
    ours, theirs = Gemma3RMSNorm(cfg, 32, eps=1e-6), HFNorm(32, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(32))  # (1 + w): zero is the identity
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(ours(x), theirs(x)) and ours(x).dtype == torch.bfloat16
