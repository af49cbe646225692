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


F, S = "full", "shared"


@pytest.mark.parametrize(
    "types, schedule",
    [
        ([F], (1, 0)),
        ([F, F, F], (1, 0)),
        ([F, S], (2, 1)),
        ([F, S, F, S], (2, 1)),
        ([F, F, S, F, S, F], (2, 2)),  # transformers' index_topk_freq 2 (default offset 2)
        ([F, S, S, F, S, S], (3, 1)),
        ([F, F, F, S], (2, 3)),
    ],
)
def test_indexer_share_schedule_gives_exactly_the_shared_layers(types, schedule):
    from areal_mega.models.dsa import _shares, indexer_share_schedule

    assert indexer_share_schedule(types) == schedule
    assert _shares(len(types), *schedule) == [t == S for t in types]


def test_every_transformers_schedule_has_megatrons():
    from transformers import GlmMoeDsaConfig

    from areal_mega.models.dsa import _shares, indexer_share_schedule

    for n in range(1, 9):
        for freq in range(1, 5):
            for offset in range(1, 5):  # offset 0 makes layer 0 shared (transformers raises)
                types = GlmMoeDsaConfig(
                    num_hidden_layers=n, index_topk_freq=freq, index_skip_topk_offset=offset
                ).indexer_types
                got = indexer_share_schedule(types)
                assert _shares(n, *got) == [t == S for t in types], (n, freq, offset)


@pytest.mark.parametrize(
    "types, match",
    [
        ([S, F], "first layer is 'shared'"),
        ([F, S, F, F], "no frequency and offset"),
        ([F, "sparse"], "'sparse'"),
    ],
)
def test_glm_moe_dsa_indexer_types_without_a_schedule_are_refused_naming_the_key(types, match):
    hf = dict(tiny_config("glm_moe_dsa", num_layers=len(types)), indexer_types=types)
    with pytest.raises(ValueError, match=f"indexer_types=.*{match}"):
        parse_hf_config(hf)


def test_upstream_glm5_provider_still_shares_top_k_at_offset_0_by_default():
    """transformers makes indexer_types from index_topk_freq with index_skip_topk_offset 2 by
    default (full, full, shared, full for freq 2), the bridge's provider with offset 0 (megatron
    then shares layers 1 and 3 instead): CORRECTIONS['glm_moe_dsa'] sets the schedule of
    indexer_types."""
    hf = dict(tiny_config("glm_moe_dsa", num_layers=4, index_topk_freq=2))
    hf.pop("index_skip_topk_offset")  # a hub config that gives the frequency only
    assert hf["indexer_types"] == [F, F, S, F]
    raw = bp.provider_for(hf)
    assert (raw.dsa_indexer_topk_freq, raw.dsa_indexer_skip_topk_offset) == (2, 0), (
        "the bridge now reads transformers' default offset: drop the schedule from "
        "CORRECTIONS['glm_moe_dsa']"
    )
    fields = bp.provider_arch_fields(hf)[0]
    assert (fields["dsa_indexer_topk_freq"], fields["dsa_indexer_skip_topk_offset"]) == (2, 2)


def test_a_pipeline_stage_may_not_start_on_a_shared_layer():
    from areal_mega.models.dsa import stage_start_error

    assert stage_start_error(4, 2, 1, 2) is None  # full, shared | full, shared
    assert stage_start_error(4, 1, 0, 2) is None
    msg = stage_start_error(4, 2, 2, 2)  # full, full | shared, full
    assert "layer 2" in msg and "dsa_indexer_topk_freq=2" in msg


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
