"""The engine's architecture fields from Megatron-Bridge's providers
(areal_mega/models/bridge_provider.py): they agree with the facts our converters read from the
same HF config, and each provider defect we correct (or family we keep translating ourselves)
is still there upstream: these tests fail once the bridge fixes one, to drop the workaround.

The numerics (engine logits = transformers') are checked by the family tests
(tests/test_new_families.py, tests/test_moe_families.py and the dense-family tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.models import bridge_provider as bp
from areal_mega.models.builder import normalize_hf_config, parse_hf_config
from areal_mega.models.tiny import ARCHS, TinyModelSpec
from areal_mega.models.tiny_configs import tiny_hf_config

ROOT = Path(__file__).resolve().parents[1]
#: the tiny configs of the family tests (Mistral / Gemma 3 with a window and own head_dim)
SPECS = {
    "mistral": dict(head_dim=24, sliding_window=8),
    "gemma3_text": dict(head_dim=24, sliding_window=8, rope_theta=1e6, query_pre_attn_scalar=32),
    "qwen3_moe": dict(tie_word_embeddings=False),
    "gpt_oss": dict(head_dim=16, sliding_window=8, moe_intermediate_size=48),
    "exaone_moe": dict(sliding_window=8, tie_word_embeddings=False),
    "exaone4": dict(sliding_window=8),
    "qwen3_next": dict(head_dim=16, tie_word_embeddings=False),
    "qwen3_5_text": dict(head_dim=16, tie_word_embeddings=False),
    "qwen3_5_moe_text": dict(head_dim=16, tie_word_embeddings=False),
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 1e6,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_config(arch, **kw):
    spec = TinyModelSpec(arch=arch, **{**SPECS.get(arch, {}), **kw})
    return normalize_hf_config(tiny_hf_config(spec, 22, 0, 1).to_dict())


def test_every_engine_family_is_provided_or_translated_with_a_reason():
    assert set(ARCHS) == (
        set(bp.PROVIDER_FAMILIES) | set(bp.OWN_TRANSLATOR) | set(bp.HYBRID_FAMILIES)
    )
    assert not set(bp.PROVIDER_FAMILIES) & set(bp.OWN_TRANSLATOR)
    assert not set(bp.HYBRID_FAMILIES) & (set(bp.PROVIDER_FAMILIES) | set(bp.OWN_TRANSLATOR))
    assert all(len(why) > 40 for why in bp.OWN_TRANSLATOR.values())
    assert set(bp.CORRECTIONS) <= set(bp.PROVIDER_FAMILIES) | set(bp.VL_PROVIDER_FAMILIES)


@pytest.mark.parametrize("arch", bp.PROVIDER_FAMILIES)
def test_provider_agrees_with_the_converters_facts(arch):
    """The provider's architecture = what the converters read from the same config (shapes,
    biases, norms, window, experts and their layer pattern, rotary share, tied embeddings)."""
    hf = tiny_config(arch)
    a = parse_hf_config(hf)
    f, gpt, is_mla = bp.provider_arch_fields(hf)
    assert is_mla == a.is_mla
    assert (f["num_layers"], f["hidden_size"], f["num_attention_heads"]) == (
        a.num_layers,
        a.hidden_size,
        a.num_heads,
    )
    assert f["ffn_hidden_size"] == a.ffn_hidden_size
    assert f["layernorm_epsilon"] == a.rms_norm_eps and f["normalization"] == a.normalization
    gpt_oss = a.model_type == "gpt_oss"  # biases on every linear layer (QKV's too), YaRN
    assert (f["add_qkv_bias"] or gpt_oss) == a.qkv_bias and f["qk_layernorm"] == a.qk_norm
    assert f["add_bias_linear"] is gpt_oss and f["gated_linear_unit"] is a.gated_mlp
    if a.is_mla:
        assert (f["q_lora_rank"], f["kv_lora_rank"], f["v_head_dim"]) == (
            a.mla_q_lora_rank,
            a.mla_kv_lora_rank,
            a.mla_v_head_dim,
        )
        assert (f["qk_head_dim"], f["qk_pos_emb_head_dim"]) == (
            a.mla_qk_nope_head_dim,
            a.mla_qk_rope_head_dim,
        )
        assert f["rope_type"] == "rope" and f["rotary_base"] == a.rope_theta
    else:
        assert f["num_query_groups"] == a.num_kv_heads
        assert f.get("kv_channels", a.hidden_size // a.num_heads) == a.head_dim
        assert gpt["rotary_base"] == a.rope_theta
    want_window = None if a.sliding_window is None else (a.sliding_window - 1, 0)
    assert f.get("window_size") == want_window
    if a.model_type.startswith("exaone"):  # the window and the rotary per layer
        from areal_mega.models.exaone import nope_layers, window_layers

        assert list(f["window_attn_skip_freq"]) == list(window_layers(hf))
        assert list(f["no_rope_freq"]) == list(nope_layers(hf))
        assert any(window_layers(hf)) and any(nope_layers(hf))
    elif gpt_oss:  # the window per layer of layer_types, rotary on all
        want = [1 if t == "sliding_attention" else 0 for t in a.layer_types]
        assert f["window_attn_skip_freq"] == want and not f.get("no_rope_freq")
    else:
        assert not f.get("window_attn_skip_freq") and not f.get("no_rope_freq")
    if a.linear_attention_layers is not None:  # Qwen3-Next: gated delta-net layers
        assert f["experimental_attention_variant"] == "gated_delta_net"
        assert list(f["linear_attention_freq"]) == list(a.linear_attention_layers)
        assert 0 in a.linear_attention_layers and 1 in a.linear_attention_layers
        heads = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
        assert tuple(f["linear_" + k] for k in heads) == a.gdn_heads
    assert f.get("attention_output_gate", False) == a.attention_output_gate
    assert gpt["rotary_percent"] == a.rotary_percent
    assert gpt["share_embeddings_and_output_weights"] == a.tie_word_embeddings
    assert gpt["position_embedding_type"] == ("yarn" if gpt_oss else "rope")
    if a.is_moe:
        assert f["num_moe_experts"] == a.num_experts and f["moe_router_topk"] == a.moe_topk
        # megatron's default expert width is ffn_hidden_size (MiniMax-M2's provider relies on it)
        assert f.get("moe_ffn_hidden_size", f["ffn_hidden_size"]) == a.moe_ffn_hidden_size
        assert list(f["moe_layer_freq"]) == list(a.moe_layer_pattern)
        assert f["moe_router_score_function"] == a.moe_score_function
        # Ernie 4.5's expert bias is its router's own (megatron's config refuses a bias on
        # softmax scores), and so is the renormalisation of its pre-softmax top-k
        own_router = a.model_type == "ernie4_5_moe"
        megatron_bias = a.moe_expert_bias and not own_router
        assert f.get("moe_router_enable_expert_bias", False) == megatron_bias
        assert f.get("moe_shared_expert_intermediate_size") == a.moe_shared_ffn_hidden_size
        if own_router:
            assert f["moe_router_pre_softmax"] is True and a.moe_norm_topk_prob
        elif a.moe_score_function == "softmax":
            assert f["moe_router_pre_softmax"] == (not a.moe_norm_topk_prob)
        else:
            assert f.get("moe_router_topk_scaling_factor") == a.moe_routed_scaling_factor
            assert f.get("moe_router_num_groups") == a.moe_num_groups
    else:
        assert not f.get("num_moe_experts")


def test_qwen3_moe_dense_layers_are_kept():
    """mlp_only_layers / decoder_sparse_step make layers dense (transformers and our
    converters); the corrected provider fields follow them."""
    hf = dict(tiny_config("qwen3_moe", num_layers=4), mlp_only_layers=[0])
    assert bp.provider_arch_fields(hf)[0]["moe_layer_freq"] == [0, 1, 1, 1]
    hf = dict(tiny_config("qwen3_moe", num_layers=4), decoder_sparse_step=2)
    assert bp.provider_arch_fields(hf)[0]["moe_layer_freq"] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "change,key",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ],
)
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_gated_delta_net_families_refuse_what_they_do_not_build_naming_the_key(arch, change, key):
    if key == "norm_topk_prob" and arch == "qwen3_5_text":
        change = dict(change, num_experts=4)  # a router's option: MoE configs only
    with pytest.raises(ValueError, match=key):
        parse_hf_config(dict(tiny_config(arch), **change))


# ---- upstream defects: each test fails once the bridge is fixed (then drop the workaround)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
def test_upstream_mla_providers_still_default_to_yarn(arch):
    raw = bp.provider_for(tiny_config(arch))
    assert raw.rope_type == "yarn", (
        "the bridge now gives plain RoPE for a config without rope_scaling: drop the RoPE "
        f"part of CORRECTIONS[{arch!r}]"
    )


def test_upstream_qwen25_vl_provider_still_keeps_its_default_mrope_section():
    """The tiny Qwen2.5-VL's head dim is 16 (mrope_section [2, 3, 3]); the provider keeps the
    released models' [16, 24, 24], which fails in the rotary embedding's split."""
    from areal_mega.models.vlm.tiny import tiny_qwen25_vl_config

    spec = TinyModelSpec(arch="qwen2_5_vl")
    hf = normalize_hf_config(tiny_qwen25_vl_config(spec, 26, 0, 1).to_dict())
    want = hf["text_config"]["rope_parameters"]["mrope_section"]
    assert want == [2, 3, 3]
    assert list(bp.provider_for(hf).mrope_section) == [16, 24, 24], (
        "the bridge now reads the config's mrope_section: drop CORRECTIONS['qwen2_5_vl']"
    )
    assert bp.provider_arch_fields(hf)[0]["mrope_section"] == want


def test_upstream_qwen3_moe_provider_still_ignores_dense_layers():
    hf = dict(tiny_config("qwen3_moe", num_layers=4), mlp_only_layers=[0])
    raw = bp.provider_for(hf)
    assert raw.moe_layer_freq in (1, [1, 1, 1, 1]), (
        "the bridge now reads mlp_only_layers: drop CORRECTIONS['qwen3_moe']"
    )


def test_upstream_qwen3_next_provider_still_reads_the_top_level_rotary_share():
    """transformers reads rope_parameters.partial_rotary_factor (0.5 in the tiny config, whose
    top level keeps Qwen3NextConfig's default 0.25); the provider reads the top level, and
    makes every layer MoE whatever mlp_only_layers says."""
    hf = dict(tiny_config("qwen3_next", num_layers=4), mlp_only_layers=[0])
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert hf["partial_rotary_factor"] == 0.25
    raw = bp.provider_for(hf)
    assert raw.rotary_percent == 0.25, (
        "the bridge now reads rope_parameters: drop the rotary part of CORRECTIONS['qwen3_next']"
    )
    assert raw.moe_layer_freq in (1, [1, 1, 1, 1]), (
        "the bridge now reads mlp_only_layers: drop that part of CORRECTIONS['qwen3_next']"
    )
    f, gpt, _ = bp.provider_arch_fields(hf)
    assert gpt["rotary_percent"] == 0.5 and f["moe_layer_freq"] == [0, 1, 1, 1]


def test_upstream_gemma3_provider_still_has_one_window_for_every_layer():
    """Gemma 3 alternates sliding and full layers; the provider's config has one window (its
    TE layer spec picks per layer), so the config alone cannot drive the local spec."""
    hf = tiny_config("gemma3_text")
    assert "full_attention" in hf["layer_types"]
    raw = bp.provider_for(hf)
    assert raw.window_size is not None and not hasattr(raw, "layer_types"), (
        "the bridge's Gemma 3 config now carries the per-layer choice: try moving "
        "gemma3_text to PROVIDER_FAMILIES"
    )


@pytest.mark.parametrize(
    "arch", ["glm4_moe", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "olmoe", "gpt_oss"]
)
def test_upstream_providers_still_untie_every_embedding(arch):
    hf = tiny_config(arch, tie_word_embeddings=True)
    assert bp.provider_for(hf).share_embeddings_and_output_weights is False, (
        f"the bridge now reads tie_word_embeddings for {arch}: drop _tied from its CORRECTIONS"
    )
    assert bp.provider_arch_fields(hf)[1]["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize(
    "model_type,text", [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")]
)
def test_qwen3_5_vision_language_checkpoints_are_refused_naming_the_text_model(model_type, text):
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError, read_arch

    hf = {"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 64}
    with pytest.raises(ValueError, match=f"vision-language.*{text}"):
        parse_hf_config(hf)
    with pytest.raises(UnsupportedModelError, match=f"vision-language.*{text}"):
        read_arch(hf)


def test_upstream_olmoe_provider_still_ignores_norm_topk_prob():
    hf = dict(tiny_config("olmoe"), norm_topk_prob=True)
    assert bp.provider_for(hf).moe_router_pre_softmax is True, (
        "the bridge now reads norm_topk_prob: drop that part of CORRECTIONS['olmoe']"
    )
    assert bp.provider_arch_fields(hf)[0]["moe_router_pre_softmax"] is False
    assert bp.provider_arch_fields(tiny_config("olmoe"))[0]["moe_router_pre_softmax"] is True


def test_upstream_minimax_m2_provider_still_ignores_partial_rotary_factor():
    hf = tiny_config("minimax_m2", head_dim=24)
    assert "rotary_dim" not in hf and hf["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert bp.provider_for(hf).rotary_percent == 1.0, (
        "the bridge now reads partial_rotary_factor: drop CORRECTIONS['minimax_m2']"
    )
    assert bp.provider_arch_fields(hf)[1]["rotary_percent"] == 0.5
    # a hub config's rotary_dim, which the provider reads, gives the same share
    hub = dict(hf, rotary_dim=12)
    assert bp.provider_arch_fields(hub)[1]["rotary_percent"] == 0.5


def test_upstream_gpt_oss_provider_still_ignores_the_configs_yarn_and_layer_types():
    """The provider writes the released models' YaRN constants and alternates windows from
    layer 0; the corrected fields say what the config says."""
    hf = dict(tiny_config("gpt_oss"), layer_types=["full_attention", "sliding_attention"])
    p = bp.provider_for(hf)
    assert (p.yarn_rotary_scaling_factor, p.yarn_original_max_position_embeddings) == (
        32.0,
        4096,
    ), "the bridge now reads gpt_oss's rope_parameters: drop that part of CORRECTIONS"
    assert p.window_attn_skip_freq == 2, "the bridge now reads layer_types: drop that part"
    f = bp.provider_arch_fields(hf)[0]
    assert (f["yarn_rotary_scaling_factor"], f["yarn_original_max_position_embeddings"]) == (
        4.0,
        16,
    )
    assert f["yarn_correction_range_round_to_int"] is False  # the tiny config's truncate
    assert f["window_attn_skip_freq"] == [0, 1] and f["window_size"] == (7, 0)
    assert f["softmax_type"] == "learnable" and f["activation_func_clamp_value"] == 7.0
    assert f["glu_linear_offset"] == 1.0


def test_upstream_ernie4_5_moe_provider_still_misdescribes_router_rotary_and_layers():
    """The bridge's Ernie 4.5 provider: a sigmoid router with megatron's expert bias, rotary
    base 500000 whatever rope_theta says, MoE layers from moe_layer_start_index alone; the
    corrected fields follow transformers (softmax scores, the config's base, every
    moe_layer_interval-th layer from the start to moe_layer_end_index)."""
    hf = dict(tiny_config("ernie4_5_moe", num_layers=6), moe_layer_interval=2)
    hf["moe_layer_end_index"] = 4
    assert hf["rope_parameters"]["rope_theta"] == 10000.0
    raw = bp.provider_for(hf)
    assert raw.moe_router_score_function == "sigmoid" and raw.moe_router_enable_expert_bias, (
        "the bridge's Ernie router changed: check ErnieTopKRouter and CORRECTIONS"
    )
    assert raw.rotary_base == 500000.0, "the bridge now reads rope_theta for Ernie 4.5"
    assert list(raw.moe_layer_freq) == [0, 1, 1, 1, 1, 1], (
        "the bridge now reads moe_layer_interval / moe_layer_end_index: drop that part of "
        "CORRECTIONS['ernie4_5_moe']"
    )
    f, gpt, _ = bp.provider_arch_fields(hf)
    assert f["moe_router_score_function"] == "softmax" and f["moe_router_pre_softmax"]
    assert not f["moe_router_enable_expert_bias"]
    assert gpt["rotary_base"] == 10000.0
    assert f["moe_layer_freq"] == [0, 1, 0, 1, 0, 0]
    assert list(parse_hf_config(hf).moe_layer_pattern) == f["moe_layer_freq"]
    # no shared experts: none in megatron (the provider says a size of 0)
    hf = dict(tiny_config("ernie4_5_moe"), moe_num_shared_experts=0)
    assert bp.provider_for(hf).moe_shared_expert_intermediate_size == 0
    assert "moe_shared_expert_intermediate_size" not in bp.provider_arch_fields(hf)[0]
    assert parse_hf_config(hf).moe_shared_ffn_hidden_size is None


@pytest.mark.parametrize(
    "change,words",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "YaRN only"),
        ({"attention_bias": False}, "attention_bias=false"),
    ],
)
def test_gpt_oss_options_the_engine_does_not_reproduce_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(tiny_config("gpt_oss"), **change))


def test_gpt_oss_expert_tensor_parallelism_is_refused_naming_why(tmp_path):
    """megatron-core takes biased experts only at expert-TP 1: the engine and the converter
    refuse expert TP > 1 for GPT-OSS with that reason and the allocation that gives the
    experts TP 1 beside attention's TP, which both build."""
    from areal_mega.checkpoint.convert import check_layout
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
    from areal_mega.models.builder import transformer_config_from_hf

    arch = parse_hf_config(tiny_config("gpt_oss"))
    for kw in (dict(tp=2), dict(tp=2, etp=2), dict(tp=1, etp=2)):
        with pytest.raises(ValueError, match=r"expert tensor parallelism 1.*\(attn:d1t2\|ffn:t1\)"):
            transformer_config_from_hf(arch, **kw)
        with pytest.raises(UnsupportedModelError, match="expert tensor parallelism 1.*--etp 1"):
            check_layout(arch, **kw, where="config.json")
    check_layout(arch, ep=2, pp=2, where="config.json")
    check_layout(arch, tp=2, etp=1, where="config.json")
    config = transformer_config_from_hf(arch, tp=2, etp=1, sequence_parallel=True)
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(use_bias=True), "use_bias=True"),
        (dict(moe_num_experts=[4, 4]), "moe_num_experts"),
        (dict(moe_layer_start_index=[1, 1]), "moe_layer_start_index"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_scaling type"),
    ],
)
def test_ernie4_5_moe_options_megatron_cannot_reproduce_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(tiny_config("ernie4_5_moe"), **change))


def test_upstream_glm4_moe_lite_provider_still_ignores_mlp_layer_types():
    hf = dict(
        tiny_config("glm4_moe_lite", num_layers=4), mlp_layer_types=["dense"] * 2 + ["sparse"] * 2
    )
    raw = bp.provider_for(hf)
    assert list(raw.moe_layer_freq) == [0, 1, 1, 1], (
        "the bridge now reads mlp_layer_types: drop that part of CORRECTIONS['glm4_moe_lite']"
    )
    assert bp.provider_arch_fields(hf)[0]["moe_layer_freq"] == [0, 0, 1, 1]


def test_upstream_hy_v3_provider_still_needs_first_k_dense_replace():
    """HYV3Config has no first_k_dense_replace, which the bridge's HY-V3 provider reads."""
    AutoBridge = bp._import_auto_bridge()
    hf = tiny_config("hy_v3", num_layers=4)
    assert "first_k_dense_replace" not in hf
    with pytest.raises(AttributeError, match="first_k_dense_replace"):
        AutoBridge.from_hf_config(bp.hf_config_object(hf)).to_megatron_provider(load_weights=False)
    # the filled-in key is the number of leading dense layers (the provider then builds)
    assert bp.INPUT_CORRECTIONS["hy_v3"][1](hf)["first_k_dense_replace"] == 1
    assert bp.provider_for(hf).moe_layer_freq == [0, 1, 1, 1]


GEMMA4 = dict(
    model_type="gemma4_text",
    architectures=["Gemma4ForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    head_dim=8,
    global_head_dim=16,
    attention_k_eq_v=False,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=64,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        },
    },
    rms_norm_eps=1e-2,
)


def test_upstream_gemma4_dense_provider_still_differs_where_we_translate_it():
    """Gemma 4 text keeps our translator (OWN_TRANSLATOR, areal_mega/models/gemma4.py) for
    what the bridge's dense provider and modules do differently from transformers; this fails
    once upstream changes one of them (then revisit the reason and the family)."""
    import copy
    import inspect
    import types

    import torch

    p = bp.provider_for(GEMMA4)
    assert type(p).__name__ == "Gemma4DenseProvider"
    # full-attention layers get the global KV heads although attention_k_eq_v is off
    # (transformers' full layers then keep num_key_value_heads; ours: parse_hf_config)
    assert (p.num_global_query_groups, p.num_query_groups, p.attention_k_eq_v) == (1, 2, False)
    assert parse_hf_config(GEMMA4).global_kv_heads == 2
    staged = copy.copy(p)
    staged.pipeline_model_parallel_size = 2
    with pytest.raises(NotImplementedError, match="PP=1"):
        staged.provide()
    # the value norm ignores the config's epsilon (1e-2 here): it divides by sqrt(ms + 1e-6)
    from megatron.bridge.models.gemma.modeling_gemma4 import (
        Gemma4DenseSelfAttention,
        Gemma4DenseTransformerLayer,
    )

    v = torch.full((1, 8), 0.01)
    attn = types.SimpleNamespace(config=p)
    fixed = v * torch.pow(v.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    assert torch.equal(Gemma4DenseSelfAttention._v_norm(attn, v), fixed), (
        "the bridge's Gemma 4 value norm now reads an epsilon: revisit OWN_TRANSLATOR"
    )
    # the per-layer-input gate and projection are plain Linear layers, never marked
    # sequence-parallel (their gradients are partial sums under TP with SP)
    src = inspect.getsource(Gemma4DenseTransformerLayer.__init__)
    assert "nn.Linear(config.hidden_size, _ple_dim" in src
    assert "sequence_parallel" not in src, "the bridge now marks the per-layer-input linears"


def test_gemma4_refuses_what_it_does_not_build_naming_why():
    """PP with key/value-shared layers or per-layer inputs without variable_seq_lengths, TP
    above the full layers' KV heads, the MoE block without its keys or with double-wide
    shared layers and router replay are refused naming why; PP and full activation
    recompute, alone and together, are built with both (their logprobs and gradients:
    gemma4_text's pp2, tp2sp_recompute and pp2_recompute in tests/test_new_families.py)."""
    from areal_mega.models import gemma4
    from areal_mega.models.builder import transformer_config_from_hf

    arch = parse_hf_config(GEMMA4)
    plain = parse_hf_config(dict(GEMMA4, num_kv_shared_layers=0))
    for a in (arch, plain):
        assert transformer_config_from_hf(a, pp=2).pipeline_model_parallel_size == 2
        for granularity in ("full", "selective"):
            got = transformer_config_from_hf(a, recompute_granularity=granularity)
            assert got.recompute_granularity == granularity
        for granularity in ("full", "selective"):
            got = transformer_config_from_hf(a, pp=2, recompute_granularity=granularity)
            assert got.recompute_granularity == granularity
        with pytest.raises(ValueError, match="needs variable_seq_lengths"):
            transformer_config_from_hf(a, pp=2, variable_seq_lengths=False)
    neither = parse_hf_config(dict(GEMMA4, num_kv_shared_layers=0, hidden_size_per_layer_input=0))
    transformer_config_from_hf(neither, pp=2, recompute_granularity="full")
    k_eq_v = parse_hf_config(dict(GEMMA4, attention_k_eq_v=True))
    with pytest.raises(ValueError, match="num_global_key_value_heads=1 is not divisible by TP=2"):
        transformer_config_from_hf(k_eq_v, tp=2)
    # the MoE block: its keys are needed, double-wide shared layers are refused, router
    # replay is refused (its own router), and the layer's MLP is Gemma 4's MoE layer
    moe = dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2)
    with pytest.raises(ValueError, match="needs moe_intermediate_size"):
        parse_hf_config(moe)
    moe["moe_intermediate_size"] = 16
    with pytest.raises(ValueError) as e:
        parse_hf_config(dict(moe, use_double_wide_mlp=True))
    assert str(e.value) == gemma4.MOE_DOUBLE_WIDE_REFUSED
    with pytest.raises(ValueError, match=r"top_k_experts=5 not in \[1, num_experts=4\]"):
        parse_hf_config(dict(moe, top_k_experts=5))
    moe_arch = parse_hf_config(moe)
    assert (moe_arch.num_experts, moe_arch.moe_topk, moe_arch.moe_ffn_hidden_size) == (4, 2, 16)
    assert moe_arch.moe_shared_ffn_hidden_size == 48  # the dense branch: intermediate_size
    config = transformer_config_from_hf(moe_arch, ep=2)
    assert (config.num_moe_experts, config.moe_shared_expert_intermediate_size) == (4, 48)
    from areal_mega.engine.routing_replay import check_replay_target

    with pytest.raises(ValueError, match="gemma4_text.*its own module"):
        check_replay_target(True, "actor", moe_arch)
    # the converters refuse the same layouts
    from areal_mega.checkpoint.convert import check_layout
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError

    check_layout(arch, pp=2)
    with pytest.raises(UnsupportedModelError, match="not divisible by TP=2"):
        check_layout(k_eq_v, tp=2)
    assert gemma4.layout_refusal(arch, 1, 2) is None


def test_upstream_falcon_h1_model_still_lacks_what_its_not_built_reason_names(tmp_path):
    """The engine builds Falcon-H1 as its own GPTModel layers (areal_mega/models/falcon_h1.py)
    for what the bridge's own FalconH1Model lacks on the engine's path; this fails once
    upstream changes one of them (then revisit whether the bridge's model would do). The same
    config the bridge's model cannot take (norm_before_gate) builds and converts here."""
    import dataclasses
    import inspect

    from megatron.core.ssm.mamba_mixer import MambaMixer

    from areal_mega.checkpoint.hf_mapping import read_arch

    bp._import_auto_bridge()  # installs the TransformerEngine placeholder the specs import
    from megatron.bridge.models.falcon_h1.modeling_falconh1 import (
        falconh1_block,
        falconh1_layer,
        falconh1_layer_specs,
        falconh1_model,
    )
    from megatron.core.extensions import transformer_engine as te

    # no packed sequences: neither the model's nor the stack's forward takes them, and the
    # layer's Mamba call has no way to pass them on
    for fn in (
        falconh1_model.FalconH1Model.forward,
        falconh1_block.FalconH1Stack.forward,
        falconh1_layer._run_mamba_mixer_with_static_cache_namespace,
    ):
        assert "packed_seq_params" not in inspect.signature(fn).parameters, fn.__qualname__
    # the final norm is TE's whatever the spec; the MLP's norm only inside TE's fused linear
    assert "self.final_norm = TENorm(" in inspect.getsource(falconh1_block.FalconH1Stack)
    fields = {f.name for f in dataclasses.fields(falconh1_layer.FalconH1Submodules)}
    assert not {"pre_mlp_layernorm", "mlp_norm"} & fields, fields
    mlp = falconh1_layer_specs.falconh1_stack_spec.submodules.falconh1_layer.submodules.mlp
    assert mlp.submodules.linear_fc1 is te.TELayerNormColumnParallelLinear
    # transformers' default mamba_norm_before_gate reaches megatron's mixer, which refuses it
    hf = dict(
        model_type="falcon_h1",
        architectures=["FalconH1ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
    )
    assert bp.provider_for(hf).norm_before_gate is True
    assert "assert not self.norm_before_gate" in inspect.getsource(MambaMixer.__init__)
    assert "falcon_h1" not in bp.NOT_BUILT
    assert parse_hf_config(hf).mamba_beside_attention
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert read_arch(tmp_path).has_mamba


def test_upstream_hy_v3_provider_still_ignores_mlp_layer_types():
    hf = dict(
        tiny_config("hy_v3", num_layers=4),
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        first_k_dense_replace=1,
    )
    raw = bp.provider_for(hf)
    assert list(raw.moe_layer_freq) == [0, 1, 1, 1], (
        "the bridge now reads mlp_layer_types: drop CORRECTIONS['hy_v3'] (and check "
        "INPUT_CORRECTIONS['hy_v3'])"
    )
    assert bp.provider_arch_fields(hf)[0]["moe_layer_freq"] == [0, 1, 0, 1]
    assert parse_hf_config(hf).moe_layer_pattern == (0, 1, 0, 1)


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(num_experts_per_tok=1), "top-1"),
        (dict(num_shared_experts=0), "num_shared_experts"),
        (dict(attention_bias=True), "o_proj"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_hy_v3_options_megatron_cannot_reproduce_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(tiny_config("hy_v3"), **change))


def test_exaone_moe_layer_pattern_as_transformers_reads_it():
    """Without layer_types transformers makes every sliding_window_pattern-th layer full
    attention (no rotary), the others sliding (rotary): the provider and our reading agree."""
    from areal_mega.models.exaone import nope_layers, window_layers

    hf = tiny_config("exaone_moe", num_layers=8)
    del hf["layer_types"]
    hf["mlp_layer_types"] = ["dense"] + ["sparse"] * 7
    f = bp.provider_arch_fields(hf)[0]
    assert window_layers(hf) == (1, 1, 1, 0) * 2 and nope_layers(hf) == (0, 0, 0, 1) * 2
    assert list(f["window_attn_skip_freq"]) == list(window_layers(hf))
    assert list(f["no_rope_freq"]) == list(nope_layers(hf))
    assert parse_hf_config(hf).layer_types == ("sliding_attention",) * 3 + ("full_attention",) + (
        "sliding_attention",
    ) * 3 + ("full_attention",)


def test_exaone_hub_pattern_string_beside_layer_types_is_accepted():
    """Hub EXAONE configs carry ``sliding_window_pattern: "LLLG"`` beside ``layer_types``
    (which transformers reads): the layer types decide."""
    for arch in ("exaone4", "exaone_moe"):
        hf = dict(tiny_config(arch), sliding_window_pattern="LLLG")
        assert parse_hf_config(hf).layer_types == ("sliding_attention", "full_attention")
        assert bp.provider_arch_fields(hf)[0]["no_rope_freq"] == [0, 1]


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(layer_types=None, sliding_window_pattern="LLLG"), "sliding_window_pattern"),
        (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types"),
    ],
)
def test_exaone_moe_options_megatron_cannot_reproduce_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(tiny_config("exaone_moe"), **change))


def test_upstream_exaone4_provider_still_sets_no_window_nor_nope():
    """EXAONE 4 with sliding layers: the provider leaves every layer full attention with
    rotary; the correction gives the sliding layers their window and the others no rotary."""
    hf = tiny_config("exaone4")
    raw = bp.provider_for(hf)
    assert raw.window_size is None and not raw.no_rope_freq, (
        "the bridge's EXAONE 4 provider now sets the window / NoPE layers: drop "
        "CORRECTIONS['exaone4'] (test_provider_agrees_with_the_converters_facts checks them)"
    )
    f = bp.provider_arch_fields(hf)[0]
    got = (f["window_size"], f["window_attn_skip_freq"], f["no_rope_freq"])
    assert got == ((7, 0), [1, 0], [0, 1])
    # without a window (EXAONE-4.0-1.2B) every layer is full attention with rotary
    no_window = dict(hf, sliding_window=None, layer_types=["full_attention"] * 2)
    f = bp.provider_arch_fields(no_window)[0]
    assert f["window_size"] is None and not f["window_attn_skip_freq"] and not f["no_rope_freq"]


@pytest.mark.parametrize("arch", ["exaone4", "exaone_moe"])
def test_exaone_llama3_rope_reaches_the_gpt_model(arch):
    """llama3 RoPE (megatron's constants): the providers' rope_scaling and factor are GPTModel
    keywords; the default rope type scales nothing."""
    gpt = bp.provider_arch_fields(dict(tiny_config(arch), rope_parameters=LLAMA3))[1]
    assert gpt["rope_scaling"] is True and gpt["rope_scaling_factor"] == 16.0
    assert gpt["rotary_base"] == 1e6
    assert bp.provider_arch_fields(tiny_config(arch))[1]["rope_scaling"] is False


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(rope_parameters=dict(LLAMA3, low_freq_factor=2.0)), "low_freq_factor"),
        (dict(rope_parameters=dict(LLAMA3, original_max_position_embeddings=4096)), "original_max"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "linear"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_exaone4_options_megatron_cannot_reproduce_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        parse_hf_config(dict(tiny_config("exaone4"), **change))


def test_hy_v3_fp32_combine_is_the_dtype_add():
    """enable_moe_fp32_combine (accepted either way): adding two bf16 tensors in fp32 and
    casting back rounds as the bf16 add does."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4096, generator=g).mul(8).to(torch.bfloat16) for _ in range(2))
    assert torch.equal((a.float() + b.float()).to(torch.bfloat16), a + b)
    for flag in (True, False):
        assert parse_hf_config(dict(tiny_config("hy_v3"), enable_moe_fp32_combine=flag)).is_moe


def test_qwen3_moe_without_norm_topk_prob_routes_as_transformers():
    """A config without ``norm_topk_prob``: transformers' default (False, no renormalisation
    of the top-k softmax weights) is megatron's pre-softmax router, in the provider and in the
    converters' facts."""
    hf = tiny_config("qwen3_moe")
    del hf["norm_topk_prob"]
    from transformers import Qwen3MoeConfig

    assert Qwen3MoeConfig().norm_topk_prob is False
    assert bp.provider_arch_fields(hf)[0]["moe_router_pre_softmax"] is True
    assert parse_hf_config(hf).moe_norm_topk_prob is False


@pytest.mark.parametrize("arch", bp.PROVIDER_FAMILIES)
def test_cached_fields_equal_the_providers(arch, tmp_path, monkeypatch):
    """The disk cache returns what the provider gives, values and types (callables, tuples)."""
    monkeypatch.setenv("AREAL_MEGA_CACHE_DIR", str(tmp_path))
    hf = tiny_config(arch)
    fresh = bp.provider_arch_fields(hf)
    (entry,) = (tmp_path / "bridge_providers").glob("*.json")
    cached = bp._read_cached(json.dumps(hf, sort_keys=True, default=str))
    assert cached is not None
    fields, gpt, is_mla = cached
    fix = bp.CORRECTIONS.get(arch)
    if fix is not None:
        fix[1](hf, fields, gpt)
    assert (fields, gpt, is_mla) == fresh
    assert {k: type(v) for k, v in fields.items()} == {k: type(v) for k, v in fresh[0].items()}
    assert bp.provider_arch_fields(hf) == fresh
    assert entry.stat().st_size > 0


def test_a_warm_cache_spares_the_bridge_import_and_a_bad_entry_is_recomputed(tmp_path):
    """A process that finds the fields in the cache does not import Megatron-Bridge; a corrupt
    or foreign entry is ignored (with a warning) and written again; another package version
    is another key."""
    env = dict(os.environ, AREAL_MEGA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    hf = tiny_config("qwen2")
    (tmp_path / "hf.json").write_text(json.dumps(hf))
    probe = (
        "import json, sys\n"
        "from areal_mega.models import bridge_provider as bp\n"
        f"f, g, m = bp.provider_arch_fields(json.load(open({str(tmp_path / 'hf.json')!r})))\n"
        "print(json.dumps([f['num_layers'], f['activation_func'].__name__, m,"
        " 'megatron.bridge' in sys.modules]))\n"
    )

    def run():
        r = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr

    first, _ = run()
    assert first[-1] is True  # computed: the bridge was imported
    (entry,) = (tmp_path / "bridge_providers").glob("*.json")
    second, _ = run()
    assert second == first[:-1] + [False]
    entry.write_text(entry.read_text()[:40])  # a torn write
    third, err = run()
    assert third == first and "ignoring the bridge provider cache entry" in err
    assert json.loads(entry.read_text())["config"] == json.dumps(hf, sort_keys=True)
    key = bp._cache_file(json.dumps(hf, sort_keys=True))
    bp._code_key.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bp, "_version", lambda dist: "0.0-other")
            assert bp._cache_file(json.dumps(hf, sort_keys=True)) != key
    finally:
        bp._code_key.cache_clear()


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AREAL_MEGA_CACHE_DIR", "off")
    assert bp.provider_cache_dir() is None and bp._cache_file("{}") is None
