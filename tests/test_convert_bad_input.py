"""The converters refuse bad input with a clear message naming the file: unsupported
architecture or option, a layout the model cannot be split into, a missing shard, a truncated
safetensors file, a missing tensor. Pure checks: they fail before any process group exists."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from areal_mega.checkpoint.convert import convert_hf_to_mcore
from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
from areal_mega.checkpoint.safetensors_io import SafetensorsError
from tests.helpers.conversions import ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_mega.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bad") / "llama", arch="llama")


def _copy(src, dst, **cfg_changes):
    shutil.copytree(src, dst)
    if cfg_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(cfg_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type='gpt2'"),
        (
            dict(model_type="qwen3_vl_moe", architectures=["Qwen3VLMoeForConditionalGeneration"]),
            "not supported",
        ),
        # a mistral config.json naming a llama class: the model type and the class disagree
        (dict(model_type="mistral"), "is not a causal LM of model_type 'mistral'"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "llama3"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    ],
)
def test_unsupported_config(tiny, tmp_path, changes, needle):
    d = _copy(tiny, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError) as e:
        convert_hf_to_mcore(d, tmp_path / "out", progress=False)
    assert needle in str(e.value) and str(d / "config.json") in str(e.value)
    assert not (tmp_path / "out").exists()


def test_layout_that_does_not_fit(tiny, tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=4 % TP=3"):
        convert_hf_to_mcore(tiny, tmp_path / "out", tp=3, progress=False)
    with pytest.raises(UnsupportedModelError, match=r"EP=2 needs an MoE model"):
        convert_hf_to_mcore(tiny, tmp_path / "out", ep=2, progress=False)


def test_missing_shard(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(d, max_shard_size="40KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(SafetensorsError, match="missing safetensors file") as e:
        convert_hf_to_mcore(d, tmp_path / "out", progress=False)
    assert shards[1].name in str(e.value)


def test_truncated_safetensors(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(SafetensorsError, match="truncated") as e:
        convert_hf_to_mcore(d, tmp_path / "out", progress=False)
    assert str(f) in str(e.value)
    with open(f, "r+b") as fh:  # cut inside the header
        fh.truncate(20)
    with pytest.raises(SafetensorsError, match="truncated or corrupt header"):
        convert_hf_to_mcore(d, tmp_path / "out", progress=False)


def test_missing_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.up_proj.weight"):
        convert_hf_to_mcore(d, tmp_path / "out", progress=False)


def test_cli_reports_error_and_exit_code(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", model_type="gpt2")
    p = subprocess.run(
        [
            sys.executable,
            "tools/convert_hf_to_mcore.py",
            "--hf-dir",
            str(d),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "error:" in p.stderr and "gpt2" in p.stderr and "Traceback" not in p.stderr


def test_mxfp4_experts_are_named(tmp_path):
    """The hub's GPT-OSS checkpoints store the experts MXFP4-quantized (``*_blocks`` /
    ``*_scales``): refused naming the tensor and how to get a bf16 copy."""
    from safetensors.torch import load_file, save_file

    from areal_mega.models.tiny import make_tiny_model

    src = make_tiny_model(
        tmp_path / "gpt_oss", arch="gpt_oss", head_dim=16, tie_word_embeddings=False
    )
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t = tensors.pop(name)
        tensors[name + "_blocks"] = t.to(torch.uint8)
        tensors[name + "_scales"] = t[..., 0].to(torch.uint8)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="MXFP4-quantized.*Mxfp4Config"):
        convert_hf_to_mcore(src, tmp_path / "out", progress=False)
