"""End to end on CPU, multi-task: two synthetic tasks from two sources (weights 3:1, each with
its own reward function) through launch.local; metrics.jsonl and the reward plot carry one
reward curve per source (reward/<name>)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from areal_mega.tracking.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_two_sources_give_per_source_reward_curves(tmp_path):
    model = make_tiny_model(
        tmp_path / "model",
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    rev, _ = write_task_files(tmp_path / "reverse", task="reverse", n_train=64, n_test=4)
    add, _ = write_task_files(tmp_path / "add", task="add", n_train=64, n_test=4)
    sources = [
        {
            "name": "reverse",
            "path": str(rev),
            "weight": 3,
            "reward_fn": "areal_mega.rewards:char_match_reward",
        },
        {
            "name": "add",
            "path": str(add),
            "weight": 1,
            "reward_fn": "areal_mega.rewards:exact_match_reward",
        },
    ]
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "areal_mega.launch.local",
        "--config",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        f"model.path={model}",
        "data.train_path=",
        "data.test_path=",
        f"data.sources={json.dumps(sources)}",
        f"logging.run_dir={run}",
        "logging.progress_bar=false",
        "logging.plot=true",
        "logging.tensorboard=false",
        "rollout.batch_size=8",
        "rollout.n_samples=4",
        "total_steps=3",
        "recover=off",
        "cluster.kill_grace_s=5",
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("launch.local did not finish:\n" + out.decode()[-3000:])
    assert proc.returncode == 0, out.decode()[-3000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    seen = {"reverse": 0, "add": 0}
    for r in rows:
        for name in seen:
            if f"reward/{name}" in r:
                seen[name] += 1
                assert 0.0 <= r[f"reward/{name}"] <= 1.0
    # 8 prompts a step drawn 3:1: "reverse" appears in every step, "add" in most
    assert seen["reverse"] == 3 and seen["add"] >= 1, seen
    for r in rows:
        print({k: round(v, 3) for k, v in r.items() if k.startswith("reward/")})
    assert (run / "reward_curve.png").stat().st_size > 1000
    worker_log = (run / "logs" / "rollout_worker.log").read_text()
    assert "Traceback" not in worker_log
