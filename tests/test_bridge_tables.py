"""The HF <-> megatron name tables come from Megatron-Bridge: the stored file equals what the
installed bridge's registries give, the table form handles every row kind, and our streamed
QKV transform (and Qwen3-Next's gated QKV and delta-net input projection) equals the bridge's
own merge/split functions bit for bit."""

import pytest
import torch

from areal_mega.checkpoint import hf_mapping
from areal_mega.checkpoint.bridge_tables import (
    BRIDGED_ARCHITECTURES,
    VL_BRIDGED_ARCHITECTURES,
    UnsupportedMappingError,
    derive_tables,
    load_tables,
    table_from_rows,
    vl_table_from_rows,
)


@pytest.fixture(scope="module")
def derived():
    return derive_tables()  # imports megatron.bridge (~10 s): once for the module


def test_stored_tables_equal_the_installed_bridge(derived):
    stored = load_tables()
    assert stored == derived, "run: python tools/sync_bridge_tables.py"
    assert set(stored["families"]) == set(BRIDGED_ARCHITECTURES)
    assert set(stored["vl_families"]) == set(VL_BRIDGED_ARCHITECTURES)


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


def test_vl_table_from_rows_splits_the_language_model_and_whole_modules():
    rows = [
        {
            "megatron": "language_model.embedding.word_embeddings.weight",
            "hf": ["model.embed_tokens.weight"],
            "kind": "copy",
        },
        {
            "megatron": "language_model.decoder.layers.*.mlp.linear_fc1.weight",
            "hf": ["model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"],
            "kind": "glu",
        },
        {"megatron": "visual.**", "hf": ["visual.**"], "kind": "copy"},
    ]
    table = vl_table_from_rows(rows)
    assert table["subtrees"] == [{"mcore": "visual.", "hf": "visual."}]
    assert table["language"]["global"] == [
        {
            "mcore": "embedding.word_embeddings.weight",
            "hf": ["model.embed_tokens.weight"],
            "kind": "vocab",
        }
    ]
    assert table["language"]["layer"][0]["hf"] == [
        "model.layers.{L}.mlp.gate_proj.weight",
        "model.layers.{L}.mlp.up_proj.weight",
    ]
    for bad in (
        {"megatron": "vision_model.x.weight", "hf": ["v.x.weight"], "kind": "copy"},
        {"megatron": "visual.**", "hf": ["visual.**"], "kind": "qkv"},
        {"megatron": "visual.*.x.**", "hf": ["visual.*.x.**"], "kind": "copy"},
    ):
        with pytest.raises(UnsupportedMappingError, match="neither the language model"):
            vl_table_from_rows([bad])


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


def test_fused_expert_transforms_equal_the_bridges_gpt_oss_mappings(derived):
    """One expert's slice of GPT-OSS's fused ``gate_up_proj`` [E, H, 2I] / ``down_proj``
    [E, I, H] (and their biases) to megatron and back: our transform = the bridge's
    ``GPTOSSMLPGateUpProjMapping`` (transpose, then its ``_interleave``) and the down
    projection's transpose, bit for bit; the table addresses expert E as ``name[E]``."""
    from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSMLPGateUpProjMapping

    from areal_mega.checkpoint.safetensors_io import split_row_name

    layer = {m.mcore: m for m in hf_mapping.FAMILIES["gpt_oss"].moe_layer}
    fc1 = layer["mlp.experts.local_experts.{E}.linear_fc1.weight"]
    assert fc1.kind == "fused_expert_glu"
    assert fc1.hf == ("model.layers.{L}.mlp.experts.gate_up_proj[{E}]",)
    assert split_row_name("a.gate_up_proj[3]") == ("a.gate_up_proj", 3)
    assert split_row_name("a.gate_up_proj") is None
    g = torch.Generator().manual_seed(0)
    hidden, inter = 6, 4
    gate_up = torch.randn(3, hidden, 2 * inter, generator=g)
    down, bias = torch.randn(3, inter, hidden, generator=g), torch.randn(3, 2 * inter, generator=g)
    mapping = GPTOSSMLPGateUpProjMapping("decoder.layers.*.mlp.experts.linear_fc1.weight*", "x")
    for e in range(3):
        ours = hf_mapping.expert_to_mcore("fused_expert_glu", gate_up[e])
        assert torch.equal(ours, mapping._interleave(gate_up[e].t()))
        assert torch.equal(ours[:inter], gate_up[e][:, 0::2].t())  # gate rows first
        assert torch.equal(hf_mapping.expert_to_hf("fused_expert_glu", ours), gate_up[e])
        b = hf_mapping.expert_to_mcore("fused_expert_glu", bias[e])
        assert torch.equal(b, mapping._interleave(bias[e]))
        assert torch.equal(hf_mapping.expert_to_hf("fused_expert_glu", b), bias[e])
        fc2 = hf_mapping.expert_to_mcore("fused_expert", down[e])
        assert fc2.shape == (hidden, inter) and torch.equal(fc2, down[e].t())
        assert torch.equal(hf_mapping.expert_to_hf("fused_expert", fc2), down[e])


def test_row_names_read_one_row_of_a_stored_tensor(tmp_path):
    """``SafetensorsDir`` reads ``x[i]`` (one expert of a fused tensor) from the row's bytes
    alone, and names a missing row or tensor."""
    from safetensors.torch import save_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir, SafetensorsError

    x = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)
    save_file({"x": x, "y": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    d = SafetensorsDir(tmp_path)
    assert "x[2]" in d and "x[3]" not in d and "z[0]" not in d
    assert d.info("x[1]") == (torch.float32, (2, 4)) and d.info("y[0]") == (torch.float32, ())
    for i in range(3):
        assert torch.equal(d.get(f"x[{i}]"), x[i])
    with pytest.raises(SafetensorsError, match="has no row 3"):
        d.get("x[3]")


def test_qwen3_next_transforms_equal_the_bridge_functions(derived):
    """Qwen3-Next's (and Qwen3.5's) gated delta-net input projection and gated QKV (our row blocks,
    areal_mega/checkpoint/hf_mapping_gdn.py) bit for bit against the bridge's merge / split
    functions, whole and streamed; the output norm's offset there and back."""
    from megatron.bridge.models.conversion.param_mapping import (
        merge_gdn_linear_weights,
        merge_qkv_weights,
        split_gdn_linear_weights,
        split_qkv_weights,
    )
    from megatron.core.transformer import TransformerConfig

    from areal_mega.checkpoint import hf_mapping_gdn as gdn
    from areal_mega.models.builder import HFArch

    nk, nv, dk, dv, heads, groups, hd, hidden = 2, 6, 4, 5, 4, 2, 8, 16
    arch = HFArch(
        "qwen3_next",
        *(32, hidden, 1, heads, groups, hd, 32, 64, 1e4, 1e-6, False, False, True),
        gdn_heads=(nk, nv, dk, dv),
        attention_output_gate=True,
    )
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=hd,
        attention_output_gate=True,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
    )
    g = torch.Generator().manual_seed(5)
    qkvz = torch.randn(nk * (2 * dk + 2 * dv * nv // nk), hidden, generator=g)
    ba = torch.randn(2 * nv, hidden, generator=g)
    ours = gdn.to_mcore(arch, "gdn_in_proj", [qkvz, ba])
    assert torch.equal(ours, merge_gdn_linear_weights(cfg, qkvz, ba))
    streamed = gdn.to_mcore_segments(arch, "gdn_in_proj", ["a", "b"], {"a": qkvz, "b": ba}.get)
    assert torch.equal(torch.cat(list(streamed)), ours)
    for a, b in zip(gdn.to_hf(arch, "gdn_in_proj", ours), split_gdn_linear_weights(cfg, ours)):
        assert torch.equal(a, b)
    q = torch.randn(2 * heads * hd, hidden, generator=g)  # per head [q; gate]
    k, v = (torch.randn(groups * hd, hidden, generator=g) for _ in range(2))
    fused = gdn.to_mcore(arch, "gated_qkv", [q, k, v])
    assert torch.equal(fused, merge_qkv_weights(cfg, q, k, v))
    for a, b in zip(gdn.to_hf(arch, "gated_qkv", fused), split_qkv_weights(cfg, fused)):
        assert torch.equal(a, b)
    # Qwen3.5: the same projection in four flat tensors (the bridge's separate mapping goes
    # through the grouped form)
    from megatron.bridge.models.conversion import param_mapping as pm

    qkv_z_b_a = gdn.to_hf(arch, "gdn_in_proj_split", ours)
    grouped = pm._fuse_gdn_separate_to_grouped(cfg, *qkv_z_b_a)
    assert torch.equal(merge_gdn_linear_weights(cfg, *grouped), ours)
    for a, b in zip(qkv_z_b_a, pm._split_gdn_grouped_to_separate(cfg, qkvz, ba)):
        assert torch.equal(a, b)
    assert torch.equal(gdn.to_mcore(arch, "gdn_in_proj_split", qkv_z_b_a), ours)
    w = torch.rand(8, generator=g) * 1.5 + 0.5  # [0.5, 2]: w - 1 and back is exact
    zero_centred = torch.cat(list(gdn.to_mcore_segments(arch, "minus_one", ["w"], {"w": w}.get)))
    assert torch.equal(zero_centred, w - 1)
    assert torch.equal(gdn.to_hf(arch, "minus_one", zero_centred)[0], w)


def test_nemotron_h_embedding_name_and_layer_rows(derived, tmp_path):
    """The bridge's Nemotron-H registry names the embedding ``backbone.embeddings.weight``,
    transformers 5.12.1 saves ``backbone.embedding.weight``: our table takes transformers' name
    (``hf_mapping._HF_NAME_FIXES``; fails once the bridge agrees, then drop the fix). Every HF
    tensor of a saved tiny Nemotron-H is one our per-layer-type rows name, and no other."""
    from safetensors import safe_open

    from areal_mega.models.builder import load_hf_config, parse_hf_config
    from areal_mega.models.tiny import make_tiny_model

    glob = {r["mcore"]: r["hf"] for r in derived["families"]["nemotron_h"]["global"]}
    assert glob["embedding.word_embeddings.weight"] == ["backbone.embeddings.weight"]
    d = make_tiny_model(tmp_path, arch="nemotron_h", hybrid_pattern="M*-M")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert "backbone.embedding.weight" in saved
    arch = parse_hf_config(load_hf_config(d))
    assert arch.hybrid_layer_pattern == "M*-M"
    names = hf_mapping.hf_tensor_names(arch)
    assert len(names) == len(set(names)) and set(names) == saved
