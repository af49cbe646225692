"""LoRA on a vision-language model: Qwen3-VL's language model takes adapters (the vision tower
and everything else frozen), trained by MegatronEngine on micro-batches with images, published
as a PEFT directory that ``peft.PeftModel`` loads onto transformers' Qwen3-VL with the same
logprobs (tests/helpers/vl_lora_worker.py), DP2 and TP2 equal to one rank; Qwen2.5-VL is
refused naming why (its adapters would be named after the checkpoint, not after transformers'
modules), by the support check, the config check against model.path and the engine before it
builds the model."""

import json
import subprocess
import sys

import pytest

from areal_mega.config import ConfigError, LoraConfig, ModelConfig, load_config
from areal_mega.lora.targets import VL_LORA_FAMILIES, LoraSupportError, check_lora_support
from tests.helpers.conversions import ROOT
from tests.test_qwen3_vl import hf_dir, mcore_dir  # noqa: F401 (module fixtures)

TOL = 1e-5
REASON = "LoRA on qwen2_5_vl \\(vision-language\\): not supported"


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    """Qwen2.5-VL and Qwen3-VL configs (config.json only: the checks read no weights)."""
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


@pytest.fixture(scope="module")
def worker(hf_dir, mcore_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("vl_lora")
    p = subprocess.run(
        [sys.executable, "-m", "tests.helpers.vl_lora_worker", str(hf_dir), str(mcore_dir), out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return dict(json.loads((out / "res.json").read_text()), out_dir=str(out))


def test_adapters_on_the_language_model_only_train_with_images(worker):
    assert worker["trainable"] == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert worker["trainable_outside_adapters"] == []
    assert worker["trainable_outside_language_model"] == []
    assert worker["losses"][1] < worker["losses"][0], worker["losses"]
    assert worker["moved_base"] == [] and worker["adapters_moved"] > 0


def test_published_adapter_loads_in_peft_onto_transformers_qwen3_vl(worker):
    """The PEFT directory on transformers' Qwen3-VL = the engine's logprobs (images included);
    the adapters off = the base model; PEFT adapted the language model's modules only."""
    assert worker["ours_in_peft"] < TOL, worker
    assert worker["adapters_off_vs_base"] < TOL, worker
    assert worker["adapters_change_output"] > 1e-3, worker
    assert worker["peft_modules"] == ["base_model.model.model.language_model"], worker


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_rank_layouts_equal_the_single_rank(
    layout,
    worker,
    hf_dir,  # noqa: F811
    mcore_dir,  # noqa: F811
    tmp_path,
):
    """DP2 (a micro-batch per rank) and TP2 (adapters split over TP, gathered under their PEFT
    names) against the single rank, from the same random adapters (a PEFT directory): the
    logprobs, the loss and the adapters' gradients of one forward-backward with images."""
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import run_ranks
    from tests.helpers.workers import worker_cmd

    port = free_port()
    args = (layout, hf_dir, mcore_dir, worker["out_dir"])
    ranks = run_ranks(
        [worker_cmd("vl_lora_worker", *args, r, 2, port, tmp_path) for r in range(2)],
        timeout=400,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    for r in range(2):
        res = json.loads((tmp_path / f"{layout}.{r}.json").read_text())
        assert res["same_names"] and res["grad_scale"] > 1e-3, res
        assert res["logprobs"] < TOL and res["loss"] < 1e-6 and res["grads"] < 1e-6, res


def test_support_check_takes_qwen3_vl_and_refuses_qwen2_5_vl():
    args = dict(is_moe=False, is_mla=False, targets=["q_proj"], rank=8, tp=1, cp=1)
    assert VL_LORA_FAMILIES == ("qwen3_vl",)
    check_lora_support(model_type="qwen3_vl", vision_language=True, **args)
    with pytest.raises(LoraSupportError, match=REASON) as e:
        check_lora_support(model_type="qwen2_5_vl", vision_language=True, **args)
    why = str(e.value)
    assert "model.language_model.layers.N" in why and "freeze_vision" in why


def test_config_check_against_model_path(vl_dirs):
    from areal_mega.config import check_against_model

    cfg = load_config(None, ["lora.enabled=true", f"model.path={vl_dirs['qwen2_5_vl']}"])
    with pytest.raises(ConfigError, match=REASON):
        check_against_model(cfg)
    check_against_model(load_config(None, [f"model.path={vl_dirs['qwen2_5_vl']}"]))
    check_against_model(
        load_config(None, ["lora.enabled=true", f"model.path={vl_dirs['qwen3_vl']}"])
    )


def test_engine_refuses_qwen2_5_vl_lora_before_building_the_model(vl_dirs):
    """MegatronEngine raises while reading the config: the refusal needs no mesh nor model
    (none is passed; the model would be built on it after this check)."""
    from areal_mega.config import OptimizerConfig
    from areal_mega.engine.megatron_engine import MegatronEngine

    with pytest.raises(LoraSupportError, match=REASON):
        MegatronEngine(
            ModelConfig(path=str(vl_dirs["qwen2_5_vl"]), dtype="fp32"),
            role="actor",
            mesh=None,
            optimizer_cfg=OptimizerConfig(lr=1e-3),
            lora=LoraConfig(enabled=True),
        )


def test_what_the_qwen2_5_vl_reason_names(vl_dirs):
    """Qwen2.5-VL's checkpoint table names the language model model.layers.N, transformers'
    model has it at model.language_model.layers.N; Qwen3-VL's table names the modules."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from areal_mega.checkpoint.vl_mapping import vl_table

    q25 = vl_table("qwen2_5_vl")["language"]["layer"]
    assert all(h.startswith("model.layers.{L}.") for row in q25 for h in row["hf"])
    q3 = vl_table("qwen3_vl")["language"]["layer"]
    assert all(h.startswith("model.language_model.layers.{L}.") for row in q3 for h in row["hf"])
    with torch.device("meta"):
        cfg = AutoConfig.from_pretrained(vl_dirs["qwen2_5_vl"])
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    names = {n for n, _ in model.named_modules()}
    assert "model.language_model.layers.0.self_attn.q_proj" in names
    assert "model.layers.0.self_attn.q_proj" not in names
