"""Which architectures our engine and CPU server run (areal_mega/inference/model_support.py)
and the command that lists Megatron-Bridge's models against them."""

import json
import subprocess
import sys
from pathlib import Path

from areal_mega.inference import model_support as ms

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
    assert not rows["OlmoeForCausalLM"]["engine"]
    for arch in ("GemmaForCausalLM", "Gemma3ForCausalLM"):
        assert rows[arch]["engine"] and rows[arch]["server"] == ms.ENGINE_HF_CACHE
    assert rows["OlmoeForCausalLM"]["server"] == ms.SERVER_PATHS["hf_cache"]
