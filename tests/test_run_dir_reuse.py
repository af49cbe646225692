"""A run directory an earlier run used (issue: nothing trusted that was not checked).

* ``recover=off`` in a used run directory is refused up front, by the launcher and by the
  trainer, instead of training from scratch and dying at the first save with interleaved
  metrics;
* the cached ``<run_dir>/init_mcore`` conversion is reused only when it was made from the same
  HF model with the same settings; a different ``model.path`` is converted again.
Real trainer processes (SFT mode: the trainer alone) on tiny models.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.common.net import free_port
from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from areal_mega.run_dir import SOURCE_FILE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("reuse")
    kw = dict(
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    a = make_tiny_model(d / "model_a", seed=1, **kw)
    b = make_tiny_model(d / "model_b", seed=2, **kw)
    write_task_files(d / "data", task="reverse", n_train=64, n_test=8)
    return a, b, d / "data"


def _overrides(run_dir, model, data, *extra):
    return [
        "mode=sft",
        f"model.path={model}",
        f"logging.run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}",
        "total_steps=1",
        "seed=3",
        "data.sft_batch_size=8",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        *extra,
    ]


def _run(module, args, timeout=600):
    # a free port: another test's trainer may hold the default 29500 at the same time
    env = dict(
        os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port())
    )
    cmd = [sys.executable, "-m", module, "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _first_loss(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return rows[0]["loss"]


def test_recover_off_in_a_used_run_dir_is_refused_before_any_work(assets, tmp_path):
    a, _, data = assets
    run = tmp_path / "run"
    first = _run("areal_mega.trainer", _overrides(run, a, data, "recover=off"))
    assert first.returncode == 0, first.stderr[-3000:]
    metrics_before = (run / "metrics.jsonl").read_text()
    for module in ("areal_mega.launch.local", "areal_mega.trainer"):
        again = _run(module, _overrides(run, a, data, "recover=off"))
        assert again.returncode != 0, module
        assert "recover=auto" in again.stderr and str(run) in again.stderr, again.stderr[-2000:]
        assert "checkpoint" in again.stderr
    assert (run / "metrics.jsonl").read_text() == metrics_before  # nothing appended


def test_init_conversion_of_another_model_is_not_reused(assets, tmp_path):
    a, b, data = assets
    run = tmp_path / "run"
    assert _run("areal_mega.trainer", _overrides(run, a, data)).returncode == 0
    assert json.loads((run / "init_mcore" / SOURCE_FILE).read_text())["hf_dir"] == str(a)
    # an earlier run's state is gone (say it crashed before its first checkpoint, or the
    # user cleared it) but its init_mcore conversion of model A is still there
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").unlink()
    second = _run("areal_mega.trainer", _overrides(run, b, data))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "converting" in second.stdout and "again" in second.stdout
    assert json.loads((run / "init_mcore" / SOURCE_FILE).read_text())["hf_dir"] == str(b)
    fresh = tmp_path / "fresh_b"
    assert _run("areal_mega.trainer", _overrides(fresh, b, data)).returncode == 0
    assert _first_loss(run) == pytest.approx(_first_loss(fresh), abs=1e-6)
