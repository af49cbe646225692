"""tools/export_lora.py on a real LoRA checkpoint (tests/helpers/lora_export_worker.py: a tiny
qwen3, one training step, ``engine.save`` with the ``lora`` record), checked with the real ``peft``:

* the exported PEFT adapter, loaded by ``PeftModel.from_pretrained`` on the HF base, gives the
  training engine's logprobs at that checkpoint (fp32);
* the ``--merge-into`` directory, loaded by transformers, equals
  ``PeftModel(...).merge_and_unload()`` and the engine;
* the rows of gate/up ``lora_B`` that Megatron-Bridge saves with SwiGLU sharding at TP > 1
  come back in PEFT order (a TP2 save exports bit-equal to the TP1 one; checked by hand, the
  ordering itself here);
* refusals name the file: a full (non-LoRA) checkpoint, a base whose files differ from the
  recorded identity, a missing base, a non-empty output, a missing checkpoint.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from areal_mega.checkpoint.dist_ckpt import CheckpointError
from areal_mega.lora.ckpt_export import (
    checkpoint_peft_tensors,
    export_peft_adapter,
    open_lora_checkpoint,
)
from tests.helpers.conversions import ROOT
from tests.helpers.lora_worker import hf_logprobs, max_diff
from tests.helpers.workers import worker_cmd, worker_env

TOL = 1e-5


def _tool(*args):
    return subprocess.run(
        [sys.executable, "tools/export_lora.py", "--no-progress", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_export")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(
        worker_cmd("lora_export_worker", out),
        cwd=ROOT,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=400,
    )
    res = json.loads((out / "make.0.json").read_text())
    assert res.get("ok") == 1.0, (res.get("error"), p.stderr[-3000:])
    return out


@pytest.fixture(scope="module")
def exported(run):
    p = _tool(
        "--ckpt",
        str(run / "run" / "checkpoints"),
        "--out",
        str(run / "adapter"),
        "--merge-into",
        str(run / "merged"),
        "--report",
        str(run / "report.json"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_exported_adapter_in_peft_gives_the_engine_logprobs(exported):
    from peft import PeftModel

    exp = torch.load(exported / "expected.pt", weights_only=True)
    cfg = json.loads((exported / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0 and cfg["peft_type"] == "LORA"
    model = PeftModel.from_pretrained(_load(exported / "hf_qwen3"), exported / "adapter")
    diff = max_diff(hf_logprobs(model, exp["mbs"]), exp["logprobs"])
    assert diff < TOL, diff
    base_diff = max_diff(hf_logprobs(_load(exported / "hf_qwen3"), exp["mbs"]), exp["logprobs"])
    assert base_diff > 0.1, base_diff  # the trained adapters change the output
    report = json.loads((exported / "report.json").read_text())
    assert report["adapter"]["tensors"] == 28 and report["adapter"]["iteration"] == 1


def test_merged_directory_equals_peft_merge_and_unload(exported):
    from peft import PeftModel

    exp = torch.load(exported / "expected.pt", weights_only=True)
    merged = _load(exported / "merged")
    ref = PeftModel.from_pretrained(
        _load(exported / "hf_qwen3"), exported / "adapter"
    ).merge_and_unload()
    theirs = ref.state_dict()
    ours = merged.state_dict()
    assert set(ours) == set(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < TOL
    assert max_diff(hf_logprobs(merged, exp["mbs"]), exp["logprobs"]) < TOL
    assert (exported / "merged" / "config.json").is_file()
    assert json.loads((exported / "report.json").read_text())["merged"]["merged"] == 14


def test_full_checkpoint_is_refused(run):
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint.*convert_mcore_to_hf"):
        open_lora_checkpoint(run / "mcore_qwen3")
    p = _tool("--ckpt", str(run / "mcore_qwen3"), "--out", str(run / "never"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "not a LoRA checkpoint" in p.stderr and "areal_meta.json" in p.stderr
    assert not (run / "never").exists()


def test_base_identity_is_checked(run, tmp_path):
    copy = tmp_path / "base_copy"
    shutil.copytree(run / "hf_qwen3", copy)  # same bytes and file times: accepted
    assert open_lora_checkpoint(run / "run" / "checkpoints", base=copy).base == copy
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "note": "edited"}))
    with pytest.raises(CheckpointError, match="config_sha256 of .*base_copy.* differs"):
        open_lora_checkpoint(run / "run" / "checkpoints", base=copy)
    ck = open_lora_checkpoint(run / "run" / "checkpoints", base=copy, check_identity=False)
    assert len(checkpoint_peft_tensors(ck)) == 28
    with pytest.raises(CheckpointError, match="nowhere/config.json: missing"):
        open_lora_checkpoint(run / "run" / "checkpoints", base=tmp_path / "nowhere")


def test_missing_checkpoint_and_non_empty_output_are_refused(run, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_lora_checkpoint(tmp_path / "no_run")
    ck = open_lora_checkpoint(run / "run" / "checkpoints" / "iter_0000001")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="busy: exists and is not empty"):
        export_peft_adapter(ck, tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_text() == "keep me"


def test_nothing_to_do_is_an_argument_error(run):
    p = _tool("--ckpt", str(run / "run" / "checkpoints"))
    assert p.returncode == 2 and "nothing to do" in p.stderr, p.stderr[-2000:]
