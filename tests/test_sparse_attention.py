"""DeepSeek sparse attention families against the bridge's providers and megatron-core:
GLM-MoE-DSA (built: areal_mega/models/dsa.py; its end-to-end checks are
tests/test_new_families.py's) and DeepSeek-V4 (refused: the pinned megatron-core lacks its
attention). Each upstream pin fails once upstream changes what it pins."""

import pytest

from areal_mega.models import bridge_provider as bp
from areal_mega.models.builder import normalize_hf_config, parse_hf_config
from areal_mega.models.tiny import TinyModelSpec
from areal_mega.models.tiny_configs import tiny_hf_config


def tiny_config(arch, **kw):
    return normalize_hf_config(tiny_hf_config(TinyModelSpec(arch=arch, **kw), 22, 0, 1).to_dict())


def test_upstream_glm_moe_dsa_provider_still_needs_indexer_rope_interleave():
    """GlmMoeDsaConfig has no indexer_rope_interleave, which the bridge's GLM-5 provider reads;
    transformers' indexer rotates in the half-split layout, which the filled-in False says."""
    AutoBridge = bp._import_auto_bridge()
    hf = tiny_config("glm_moe_dsa", num_layers=4)
    assert "indexer_rope_interleave" not in hf
    with pytest.raises(AttributeError, match="indexer_rope_interleave"):
        AutoBridge.from_hf_config(bp.hf_config_object(hf)).to_megatron_provider(load_weights=False)
    assert bp.INPUT_CORRECTIONS["glm_moe_dsa"][1](hf)["indexer_rope_interleave"] is False
    assert bp.provider_for(hf).dsa_indexer_rope_interleaved is False


def test_upstream_glm_moe_dsa_provider_still_ignores_mlp_layer_types():
    """The provider makes the first first_k_dense_replace layers dense (default 3);
    transformers reads mlp_layer_types. The indexer's sizes and the DSA variant come through,
    and RL builds it without megatron's indexer loss."""
    from areal_mega.models.builder import transformer_config_from_hf

    hf = dict(
        tiny_config("glm_moe_dsa", num_layers=4),
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    )
    raw = bp.provider_for(hf)
    assert list(raw.moe_layer_freq) != [0, 1, 0, 1], (
        "the bridge now reads mlp_layer_types: drop CORRECTIONS['glm_moe_dsa']"
    )
    fields = bp.provider_arch_fields(hf)[0]
    assert fields["moe_layer_freq"] == [0, 1, 0, 1]
    assert fields["experimental_attention_variant"] == "dsa"
    assert (fields["dsa_indexer_n_heads"], fields["dsa_indexer_head_dim"]) == (8, 16)
    assert fields["dsa_indexer_topk"] == 6
    arch = parse_hf_config(hf)
    assert arch.moe_layer_pattern == (0, 1, 0, 1) and arch.dsa_indexer == (8, 16, 6)
    config = transformer_config_from_hf(arch)
    assert config.dsa_indexer_loss_coeff == 0.0 and config.dsa_kernel_backend == "none"


def test_glm_moe_dsa_shared_indexer_layers_are_refused_naming_the_key():
    hf = dict(tiny_config("glm_moe_dsa", num_layers=2), indexer_types=["full", "shared"])
    with pytest.raises(ValueError, match="indexer_types=.*'shared'"):
        parse_hf_config(hf)


def test_deepseek_v4_is_refused_naming_the_attention_megatron_core_lacks(tmp_path):
    """The bridge's DeepSeek-V4 provider asks for an attention variant the pinned
    megatron-core does not have; when a megatron-core upgrade accepts it, the family can be
    built (and this test fails)."""
    import typing

    from megatron.core.transformer import TransformerConfig

    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError, read_arch

    variants = typing.get_args(
        typing.get_args(TransformerConfig.__annotations__["experimental_attention_variant"])[0]
    )
    assert "dsv4_hybrid" not in variants, variants
    hf = {"model_type": "deepseek_v4", "num_hidden_layers": 2, "hidden_size": 64}
    with pytest.raises(ValueError, match="dsv4_hybrid") as e:
        parse_hf_config(hf)
    assert "not supported" in str(e.value)
    with pytest.raises(UnsupportedModelError, match="dsv4_hybrid"):
        read_arch(hf)
