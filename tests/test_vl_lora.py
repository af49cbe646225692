"""LoRA on a vision-language model (Qwen2.5-VL, Qwen3-VL) is refused naming why: by the pure
support check, by the config check against model.path (before anything starts) and by
MegatronEngine before it builds the model; what the reason names is checked in our code (the
adapters' PEFT names come from the text families' tables, which have no vision-language
family; transformers' vision-language models keep the language model under
model.language_model; the Qwen3-VL tower's linears carry the names the adapter walk matches)."""

import json

import pytest

from areal_mega.config import ConfigError, LoraConfig, ModelConfig, load_config
from areal_mega.lora.targets import LoraSupportError, check_lora_support

REASON = "LoRA on {} \\(vision-language\\): not supported yet"


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    """Tiny Qwen2.5-VL and Qwen3-VL configs (config.json only: the refusals read no weights)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    out = {}
    # the released models' head dim (128): 64 rotary pairs in the multimodal sections
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    for mt, cls in (("qwen2_5_vl", Qwen2_5_VLConfig), ("qwen3_vl", Qwen3VLConfig)):
        d = tmp_path_factory.mktemp(mt)
        text = dict(num_hidden_layers=2, rope_parameters=rope)
        cfg = cls(text_config=text, vision_config=dict(depth=2)).to_dict()
        (d / "config.json").write_text(json.dumps(cfg))
        out[mt] = d
    return out


def test_support_check_refuses_vision_language_models():
    args = dict(
        model_type="qwen3_vl", is_moe=False, is_mla=False, targets=["q_proj"], rank=8, tp=1, cp=1
    )
    check_lora_support(**args)  # as a text model it would pass
    with pytest.raises(LoraSupportError, match=REASON.format("qwen3_vl")) as e:
        check_lora_support(**args, vision_language=True)
    why = str(e.value)
    assert "model.language_model" in why and "vision tower" in why and "freeze_vision" in why


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_config_check_refuses_it_against_model_path(vl_dirs, model_type):
    from areal_mega.config import check_against_model

    d = vl_dirs[model_type]
    cfg = load_config(None, ["lora.enabled=true", f"model.path={d}"])
    with pytest.raises(ConfigError, match=REASON.format(model_type)):
        check_against_model(cfg)
    check_against_model(load_config(None, [f"model.path={d}"]))  # without LoRA: accepted


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_engine_refuses_it_before_building_the_model(vl_dirs, model_type):
    """MegatronEngine raises while reading the config: the refusal needs no mesh nor model
    (none is passed; the model would be built on it after this check)."""
    from areal_mega.config import OptimizerConfig
    from areal_mega.engine.megatron_engine import MegatronEngine

    with pytest.raises(LoraSupportError, match=REASON.format(model_type)):
        MegatronEngine(
            ModelConfig(path=str(vl_dirs[model_type]), dtype="fp32"),
            role="actor",
            mesh=None,
            optimizer_cfg=OptimizerConfig(lr=1e-3),
            lora=LoraConfig(enabled=True),
        )


def test_what_the_reason_names():
    """The PEFT export's names come from the text families' tables (no vision-language family
    there); transformers' Qwen3-VL keeps its decoder layers under model.language_model; the
    stored Qwen3-VL table's vision tower has the linears (linear_qkv, linear_proj, linear_fc1,
    linear_fc2) the adapter walk targets by module name."""
    import inspect

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.vl_mapping import vl_table
    from areal_mega.lora import peft_io
    from areal_mega.models.bridge_provider import VL_PROVIDER_FAMILIES

    assert "hm.hf_names_for(arch" in inspect.getsource(peft_io._adapters)
    assert not set(VL_PROVIDER_FAMILIES) & set(hm.FAMILIES)
    table = vl_table("qwen3_vl")
    assert table["language"]["layer"][0]["hf"][0].startswith("model.language_model.layers.{L}.")
    tower = {r["mcore"].rsplit(".", 2)[-2] for r in table["vision"]}
    assert {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"} <= tower
