"""Qwen3-VL (qwen3_vl, qwen3_vl_moe): the engine does not build it on the CPU and says why
(areal_mega/models/bridge_provider.py NOT_BUILT); the family table names the reason; the
upstream facts the reason names are checked in the installed Megatron-Bridge's source, so this
file fails once upstream changes them (then revisit the family)."""

import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from areal_mega.models.bridge_provider import NOT_BUILT, VL_NOT_BUILT

#: what the tiny configs below need for the refusal (the builder reads model_type only)
CONFIGS = {
    "qwen3_vl": {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"]},
    "qwen3_vl_moe": {
        "model_type": "qwen3_vl_moe",
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    },
}


def _bridge_source(module: str) -> str:
    """A Megatron-Bridge module's source, read from disk without importing the bridge (its
    import needs our TransformerEngine placeholder and takes ~20 s)."""
    (root,) = importlib.util.find_spec("megatron").submodule_search_locations[:1]
    path = Path(root).joinpath(*module.split(".")[1:]).with_suffix(".py")
    assert path.is_file(), path
    return path.read_text()


def _function_source(text: str, header: str) -> str:
    """The body of the function of ``text`` that starts at ``header``, up to the next
    definition at the same or a lower indentation."""
    start = text.index(header)
    indent = len(text[: start].rsplit("\n", 1)[-1])
    lines = text[start:].split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) <= indent and stripped.startswith(
            ("def ", "class ", "@")
        ):
            break
        body.append(line)
    return "\n".join(body)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_builder_and_converters_refuse_it_naming_why(model_type, tmp_path):
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError, read_arch
    from areal_mega.checkpoint.vl_convert import is_vl_model_dir
    from areal_mega.models.builder import SUPPORTED_MODEL_TYPES, parse_hf_config
    from areal_mega.models.vlm.config import is_vl_config

    assert model_type in VL_NOT_BUILT and model_type not in SUPPORTED_MODEL_TYPES
    hf = CONFIGS[model_type]
    assert not is_vl_config(hf)  # not the vision-language builder's: parse_hf_config refuses
    with pytest.raises(ValueError, match="TransformerEngine layers only") as e:
        parse_hf_config(hf)
    assert "TENorm" in str(e.value) and "bidirectional packed" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert not is_vl_model_dir(tmp_path)
    with pytest.raises(UnsupportedModelError, match="TransformerEngine layers only"):
        read_arch(tmp_path)
    if model_type == "qwen3_vl_moe":
        assert "grouped-GEMM experts" in NOT_BUILT[model_type]


def test_family_table_rows_say_why():
    from areal_mega.inference import model_support as ms

    archs = ms.vl_not_built_architectures()
    assert archs == {
        "Qwen3VLForConditionalGeneration": NOT_BUILT["qwen3_vl"],
        "Qwen3VLMoeForConditionalGeneration": NOT_BUILT["qwen3_vl_moe"],
    }
    (row,) = ms.support_rows(
        ["Qwen3VLForConditionalGeneration"],
        engine={},
        causal_lm={},
        kv_paths={},
        vl_not_built=archs,
    )
    assert row["status"] == ms.STATUS["no"] and not row["engine"]
    assert row["status_note"] == NOT_BUILT["qwen3_vl"]
    assert "not a causal LM" in row["note"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "model_families.md").read_text()
    for arch, why in archs.items():
        assert f"| `{arch}` |" in doc and why in doc


def test_upstream_still_builds_qwen3_vl_from_transformer_engine_layers_only():
    """Each TE-only piece NOT_BUILT['qwen3_vl'] names, in the installed Megatron-Bridge."""
    provider = _bridge_source("megatron.bridge.models.qwen_vl.qwen3_vl_provider")
    for cls in ("class Qwen3VLModelProvider", "class Qwen3VLMoEModelProvider"):
        provide = _function_source(provider[provider.index(cls) :], "def provide(")
        assert "get_gpt_layer_with_transformer_engine_spec(" in provide, cls
        assert "provide_language_model" not in provide, cls  # no hook for another spec
    model = _bridge_source("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    init = _function_source(model[model.index("class Qwen3VLModel(") :], "def __init__(")
    assert "get_vit_layer_with_transformer_engine_spec()" in init
    for te in ("patch_norm=TENorm", "TEColumnParallelLinear", "TERowParallelLinear"):
        assert te in init, te
    assert "use_hf_vision_model is not supported" in init
    block = _bridge_source("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block")
    assert "deepstack_merger_list" in block
    rope = _bridge_source("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope")
    rope_init = _function_source(
        rope[rope.index("class Qwen3VLMultimodalRotaryEmbedding") :], "def __init__("
    )
    assert "torch.cuda.current_device()" in rope_init


def test_our_packed_attention_and_vl_conversion_lack_what_its_vision_tower_needs():
    """The local-spec pieces the reason names: our packed attention is causal whatever the
    layer's mask type (a ViT attends both ways within an image), and our vision-language table
    takes whole-module copies only (the bridge's Qwen3-VL vision rows are per layer, with a
    concatenated QKV)."""
    import torch

    from areal_mega.checkpoint.bridge_tables import UnsupportedMappingError, vl_table_from_rows
    from areal_mega.models.varlen_attention import (
        VarlenDotProductAttention,
        varlen_causal_attention,
    )

    assert "varlen_causal_attention(" in inspect.getsource(VarlenDotProductAttention.forward)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 4, generator=g) for _ in range(3))
    out = varlen_causal_attention(q, k, v, [0, 3, 7], scale=0.5).reshape(7, 2, 4)
    # the first token of each slot (an image's first patch) sees only itself
    assert torch.allclose(out[0], v[0]) and torch.allclose(out[3], v[3])
    with pytest.raises(UnsupportedMappingError, match="neither the language model's"):
        vl_table_from_rows(
            [
                {
                    "megatron": "vision_model.decoder.layers.*.self_attention.linear_qkv.weight",
                    "hf": ["model.visual.blocks.*.attn.qkv.weight"],
                    "kind": "qkv",
                }
            ]
        )
