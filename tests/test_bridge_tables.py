"""The HF <-> megatron name tables come from Megatron-Bridge: the stored file equals what the
installed bridge's registries give, the table form handles every row kind, and our streamed
QKV transform equals the bridge's own merge/split functions bit for bit."""

import pytest
import torch

from areal_mega.checkpoint import hf_mapping
from areal_mega.checkpoint.bridge_tables import (
    BRIDGED_ARCHITECTURES,
    UnsupportedMappingError,
    derive_tables,
    load_tables,
    table_from_rows,
)


@pytest.fixture(scope="module")
def derived():
    return derive_tables()  # imports megatron.bridge (~10 s): once for the module


def test_stored_tables_equal_the_installed_bridge(derived):
    stored = load_tables()
    assert stored == derived, "run: python tools/sync_bridge_tables.py"
    assert set(stored["families"]) == set(BRIDGED_ARCHITECTURES)


def test_families_are_the_bridge_tables():
    fams = hf_mapping.FAMILIES
    assert set(fams) == set(BRIDGED_ARCHITECTURES)
    qwen2 = {m.mcore: m for m in fams["qwen2"].dense_layer}
    assert qwen2["self_attention.linear_qkv.bias"].kind == "qkv"
    assert qwen2["mlp.linear_fc1.weight"].hf == (
        "model.layers.{L}.mlp.gate_proj.weight",
        "model.layers.{L}.mlp.up_proj.weight",
    )
    assert "self_attention.linear_qkv.bias" not in {m.mcore for m in fams["llama"].dense_layer}
    moe = fams["qwen3_moe"]
    assert {m.mcore for m in moe.moe_layer} >= {
        "mlp.router.weight",
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
    }
    # its dense layers (mlp_only_layers) take the dense MLP rows of Qwen3's registry
    assert {m.mcore for m in moe.dense_layer} == {m.mcore for m in fams["qwen3"].dense_layer}
    kinds = {m.mcore: m.kind for m in moe.global_maps}
    assert kinds == {
        "embedding.word_embeddings.weight": "vocab",
        "output_layer.weight": "vocab",
        "decoder.final_layernorm.weight": "copy",
    }


def test_table_from_rows_forms_and_refusals():
    rows = [
        {
            "megatron": "embedding.word_embeddings.weight",
            "hf": ["model.embed_tokens.weight"],
            "kind": "copy",
        },
        {
            "megatron": "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight",
            "hf": ["model.layers.*.input_layernorm.weight"],
            "kind": "copy",
        },  # TE only
        {
            "megatron": "decoder.layers.*.input_layernorm.weight",
            "hf": ["model.layers.*.input_layernorm.weight"],
            "kind": "copy",
        },
        {
            "megatron": "decoder.layers.*.mlp.experts.linear_fc2.weight*",
            "hf": ["model.layers.*.mlp.experts.*.down_proj.weight"],
            "kind": "copy",
        },  # grouped
        {
            "megatron": "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
            "hf": ["model.layers.*.mlp.experts.*.down_proj.weight"],
            "kind": "copy",
        },  # same
        {
            "megatron": "decoder.layers.*.mlp.experts.linear_fc1.weight*",
            "hf": [
                "model.layers.*.mlp.experts.*.gate_proj.weight",
                "model.layers.*.mlp.experts.*.up_proj.weight",
            ],
            "kind": "glu",
        },  # only grouped
        {
            "megatron": "mtp.layers.*.enorm.weight",
            "hf": ["model.layers.*.enorm.weight"],
            "kind": "copy",
        },  # not built
        {
            "megatron": "decoder.layers.*.input_layernorm.weight",
            "hf": ["other.*.weight"],
            "kind": "copy",
        },  # duplicate
    ]
    t = table_from_rows(rows)
    assert t["global"] == [
        {
            "mcore": "embedding.word_embeddings.weight",
            "hf": ["model.embed_tokens.weight"],
            "kind": "vocab",
        }
    ]
    assert t["layer"] == [
        {
            "mcore": "input_layernorm.weight",
            "hf": ["model.layers.{L}.input_layernorm.weight"],
            "kind": "copy",
        },
        {
            "mcore": "mlp.experts.local_experts.{E}.linear_fc2.weight",
            "hf": ["model.layers.{L}.mlp.experts.{E}.down_proj.weight"],
            "kind": "copy",
        },
        {
            "mcore": "mlp.experts.local_experts.{E}.linear_fc1.weight",
            "hf": [
                "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
                "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
            ],
            "kind": "glu",
        },
    ]
    with pytest.raises(UnsupportedMappingError, match="outside decoder.layers"):
        table_from_rows([{"megatron": "vision.*.w", "hf": ["v.*.w"], "kind": "copy"}])
    with pytest.raises(UnsupportedMappingError, match="wildcard other than"):
        table_from_rows(
            [{"megatron": "decoder.layers.*.mlp.x.*.w", "hf": ["m.*.x.*.w"], "kind": "copy"}]
        )
    with pytest.raises(UnsupportedMappingError, match="more than two wildcards"):
        table_from_rows([{"megatron": "decoder.layers.*.w", "hf": ["a.*.b.*.c.*"], "kind": "copy"}])


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 8), (6, 1, 4), (4, 4, 16)])
def test_our_qkv_transform_equals_the_bridge_functions(derived, heads, groups, head_dim):
    from megatron.bridge.models.conversion.param_mapping import merge_qkv_weights, split_qkv_weights
    from megatron.core.transformer import TransformerConfig

    hidden = heads * head_dim
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
    )
    g = torch.Generator().manual_seed(heads * 100 + groups)
    q = torch.randn(heads * head_dim, hidden, generator=g)
    k, v = (torch.randn(groups * head_dim, hidden, generator=g) for _ in range(2))
    ours = hf_mapping.qkv_to_mcore(q, k, v, heads, groups, head_dim)
    assert torch.equal(ours, merge_qkv_weights(cfg, q, k, v))
    for a, b in zip(
        hf_mapping.qkv_to_hf(ours, heads, groups, head_dim), split_qkv_weights(cfg, ours)
    ):
        assert torch.equal(a, b)
    qb, kb, vb = q[:, 0].contiguous(), k[:, 0].contiguous(), v[:, 0].contiguous()  # biases
    assert torch.equal(
        hf_mapping.qkv_to_mcore(qb, kb, vb, heads, groups, head_dim),
        merge_qkv_weights(cfg, qb, kb, vb),
    )
