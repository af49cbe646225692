"""Which architectures our engine and CPU server run (areal_mega/inference/model_support.py)
and the command that lists Megatron-Bridge's models against them."""

import json
import subprocess
import sys
from pathlib import Path

from areal_mega.inference import model_support as ms
from areal_mega.models.bridge_provider import VL_END_TO_END

ROOT = Path(__file__).resolve().parents[1]


def test_support_rows_edge_cases():
    engine = {"LlamaForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3_text"}
    causal_lm = {
        "LlamaForCausalLM": ["llama"],
        "GemmaForCausalLM": ["gemma"],
        "Gemma3ForConditionalGeneration": ["gemma3"],
        "Gemma3ForCausalLM": ["gemma3_text"],
    }
    kv = {"llama": "static", "gemma": "hf_cache", "gemma3": "hf_cache", "gemma3_text": "hf_cache"}
    rows = ms.support_rows(
        [
            "LlamaForCausalLM",
            "GemmaForCausalLM",
            "LlamaForCausalLM",
            "KimiK2ForCausalLM",
            "Qwen2_5_VLForConditionalGeneration",
            "Gemma3ForConditionalGeneration",
            "Gemma3ForCausalLM",
        ],
        engine=engine,
        causal_lm=causal_lm,
        kv_paths=kv,
        transformers_classes={
            "LlamaForCausalLM",
            "GemmaForCausalLM",
            "Qwen2_5_VLForConditionalGeneration",
            "Gemma3ForConditionalGeneration",
        },
    )
    by = {r["architecture"]: r for r in rows}
    assert [r["architecture"] for r in rows] == [  # order kept, duplicate dropped
        "LlamaForCausalLM",
        "GemmaForCausalLM",
        "KimiK2ForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM",
    ]
    assert (
        by["LlamaForCausalLM"]["engine"]
        and by["LlamaForCausalLM"]["server"] == ms.SERVER_PATHS["static"]
    )
    assert not by["GemmaForCausalLM"]["engine"]
    assert by["GemmaForCausalLM"]["server"] == ms.SERVER_PATHS["hf_cache"]
    assert (
        by["KimiK2ForCausalLM"]["server"] == "no"
        and "remote code" in by["KimiK2ForCausalLM"]["note"]
        and by["KimiK2ForCausalLM"]["model_type"] is None
    )
    assert "not a causal LM" in by["Qwen2_5_VLForConditionalGeneration"]["note"]
    vl_rows = ms.support_rows(
        ["Qwen2_5_VLForConditionalGeneration"],
        engine=engine,
        causal_lm=causal_lm,
        kv_paths=kv,
        vl_trainer={"Qwen2_5_VLForConditionalGeneration": "trainer only"},
    )
    assert vl_rows[0]["status"] == ms.STATUS["no"]
    assert vl_rows[0]["status_note"] == "trainer only"
    assert vl_rows[0]["server"] == ms.SERVER_PATHS["hf_cache"] and vl_rows[0]["note"] == ""
    assert ms.vl_trainer_architectures() == {}  # every family the trainer builds runs RL
    # a vision-language model RL runs end to end: engine, served with images, CPU
    (vl_rl,) = ms.support_rows(
        ["Qwen2_5_VLForConditionalGeneration"],
        engine=engine,
        causal_lm=causal_lm,
        kv_paths=kv,
        vl_rl={"Qwen2_5_VLForConditionalGeneration": "images end to end"},
    )
    assert vl_rl["engine"] and vl_rl["server"] == ms.SERVER_VL and not vl_rl["note"]
    assert vl_rl["status"] == ms.STATUS["cpu"] and vl_rl["status_note"] == "images end to end"
    assert ms.vl_rl_architectures() == {
        "Qwen2_5_VLForConditionalGeneration": VL_END_TO_END,
        "Qwen3VLForConditionalGeneration": VL_END_TO_END,
    }
    assert by["Gemma3ForConditionalGeneration"]["server"] == ms.SERVER_PATHS["hf_cache"]
    # an engine family on transformers' cache is served end to end by its family test
    assert (
        by["Gemma3ForCausalLM"]["engine"]
        and by["Gemma3ForCausalLM"]["server"] == ms.ENGINE_HF_CACHE
    )
    table = ms.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| `LlamaForCausalLM` | llama | yes |" in table


def test_engine_architectures_are_the_builders():
    engine = ms.engine_architectures()
    assert engine["MistralForCausalLM"] == "mistral" and engine["LlamaForCausalLM"] == "llama"
    from areal_mega.models.builder import SUPPORTED_MODEL_TYPES

    assert set(engine.values()) == set(SUPPORTED_MODEL_TYPES)


def test_list_bridge_models_command():
    p = subprocess.run(
        [sys.executable, "tools/list_bridge_models.py", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["architecture"]: r for r in json.loads(p.stdout)}
    assert len(rows) > 20  # the bridge's own list, not ours
    for arch in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        assert rows[arch]["engine"] and rows[arch]["server"] == ms.SERVER_PATHS["static"]
    assert not rows["Qwen3VLMoeForConditionalGeneration"]["engine"]
    for arch in (
        "GemmaForCausalLM",
        "Gemma3ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Exaone4ForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Gemma4ForCausalLM",
        "FalconH1ForCausalLM",
    ):
        assert rows[arch]["engine"] and rows[arch]["server"] == ms.ENGINE_HF_CACHE
    for arch in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
        vl = rows[arch]  # RL with images (tests/test_vl_rl.py)
        assert vl["engine"] and vl["server"] == ms.SERVER_VL
        assert vl["status"] == ms.STATUS["cpu"] and vl["status_note"] == VL_END_TO_END
    # the families the engine does not build say why (read from their modelling code)
    from areal_mega.models.bridge_provider import NOT_BUILT

    for row in rows.values():
        if row["model_type"] in NOT_BUILT and not row["engine"]:
            assert row["status"] == ms.STATUS["no"]
            assert row["status_note"] == (row["note"] or NOT_BUILT[row["model_type"]]), row
    assert "grouped-GEMM" in rows["Qwen3VLMoeForConditionalGeneration"]["status_note"]
    # docs/model_families.md holds the command's table as it prints it now
    table = ms.markdown_table(list(json.loads(p.stdout)))
    assert table in (ROOT / "docs" / "model_families.md").read_text()


def test_families_not_built_are_refused_naming_why(tmp_path):
    """Building or converting a family the engine does not build names the reason."""
    import pytest

    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError, read_arch
    from areal_mega.models.bridge_provider import GPU_ONLY, NOT_BUILT
    from areal_mega.models.builder import SUPPORTED_MODEL_TYPES, parse_hf_config

    assert not set(NOT_BUILT) & (set(SUPPORTED_MODEL_TYPES) | set(GPU_ONLY))
    assert all(len(why) > 40 for why in NOT_BUILT.values())
    vl_moe = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"]}
    with pytest.raises(ValueError, match="grouped-GEMM"):
        parse_hf_config(vl_moe)
    (tmp_path / "config.json").write_text(json.dumps(vl_moe))
    with pytest.raises(UnsupportedModelError, match="grouped-GEMM"):
        read_arch(tmp_path)
    # Gemma 4's MoE variant without its expert keys is refused naming the first missing one
    gemma4_moe = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "enable_moe_block": True,
    }
    with pytest.raises(ValueError, match="enable_moe_block=True needs num_experts"):
        parse_hf_config(gemma4_moe)
    (tmp_path / "config.json").write_text(json.dumps(gemma4_moe))
    with pytest.raises(UnsupportedModelError, match="enable_moe_block=True needs num_experts"):
        read_arch(tmp_path)
    # Nemotron-H (built): a config with what the engine does not build (MoE layers) is refused
    # naming the key, by the builder and the converters
    nemotron_h = {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "layers_block_type": ["mamba", "moe"],
    }
    with pytest.raises(ValueError, match="hybrid_override_pattern='ME'.*MoE"):
        parse_hf_config(nemotron_h)
    (tmp_path / "config.json").write_text(json.dumps(nemotron_h))
    with pytest.raises(UnsupportedModelError, match="MoE layers"):
        read_arch(tmp_path)


def test_upstream_still_lacks_what_the_not_built_reasons_name():
    """Fails once megatron-core gains what our own modules stand in for (then revisit them):
    an expert bias on softmax router scores, which Ernie 4.5 MoE's ErnieTopKRouter
    (areal_mega/models/ernie4_5_moe.py) adds; and once its torch LayerNorm takes a zero-centred
    gamma, which Nemotron's LayerNorm1P (areal_mega/models/nemotron.py) stands in for."""
    import pytest
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 100.0])  # would pick expert 3 if it were applied
    _, with_bias = topk_routing_with_score_function(
        logits, 1, use_pre_softmax=True, score_function="softmax", expert_bias=bias
    )
    _, without = topk_routing_with_score_function(
        logits, 1, use_pre_softmax=True, score_function="softmax"
    )
    assert torch.equal(with_bias, without) and not bool(with_bias[0, 3])

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="LayerNorm",
        layernorm_zero_centered_gamma=True,
    )
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        WrappedTorchNorm(cfg, 8)
