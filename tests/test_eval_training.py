"""Evaluation during RL training: the schedule (pure), the config rules, and a CPU run with
launch.local whose metrics.jsonl and plot carry the eval/* curves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from areal_mega.tracking.metrics import eval_curve_keys
from areal_mega.train.evaluation import eval_due

ROOT = Path(__file__).resolve().parents[1]


def test_eval_schedule():
    cfg = load_config(None, ["eval.every_steps=4", "eval.data=a.jsonl", "total_steps=10"])
    assert [s for s in range(0, 11) if eval_due(cfg.eval, s, 10)] == [0, 4, 8, 10]
    off = load_config(None, ["eval.data=a.jsonl,b.jsonl"])  # every_steps 0: off
    assert off.eval.data == ["a.jsonl", "b.jsonl"]
    assert not any(eval_due(off.eval, s, 10) for s in range(11))


def test_eval_config_rules():
    with pytest.raises(ConfigError, match="eval.data is empty"):
        load_config(None, ["eval.every_steps=2"])
    with pytest.raises(ConfigError, match="mode=rl"):
        load_config(None, ["eval.every_steps=2", "eval.data=a.jsonl", "mode=sft"])
    with pytest.raises(ConfigError, match="eval.n_samples"):
        load_config(None, ["eval.n_samples=0"])


def test_eval_curve_keys():
    rows = [
        {
            "step": 0,
            "eval/pass@1": 0.1,
            "eval/b/pass@1": 0.2,
            "eval/a/pass@1": 0.0,
            "eval/pass@2": 0.3,
        },
        {"step": 1, "reward/mean": 0.5},
    ]
    assert eval_curve_keys(rows) == ["eval/pass@1", "eval/a/pass@1", "eval/b/pass@1"]


@pytest.mark.slow
def test_cpu_run_with_periodic_eval(tmp_path):
    """Evaluations at step 0, every 2 steps and at the end, each at the version just
    published; per-source keys; nothing of the evaluation reaches the training data."""
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
    data = tmp_path / "data"
    write_task_files(data, task="reverse", n_train=256, n_test=8)
    (data / "add.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1), "source": "add"}) + "\n"
            for a in range(10, 14)
        )
    )
    run = tmp_path / "run"
    batch, n = 4, 4
    args = [
        sys.executable,
        "-m",
        "areal_mega.launch.local",
        "--config",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        f"model.path={model}",
        f"data.train_path={data / 'train.jsonl'}",
        f"logging.run_dir={run}",
        "logging.progress_bar=false",
        "logging.tensorboard=true",
        "logging.plot=true",
        f"rollout.batch_size={batch}",
        f"rollout.n_samples={n}",
        "total_steps=3",
        "recover=off",
        "cluster.kill_grace_s=5",
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
        f"eval.data={data / 'test.jsonl'},{data / 'add.jsonl'}",
        "eval.every_steps=2",
        "eval.n_samples=2",
        "eval.temperature=1.0",
        "eval.pass_threshold=0.2",
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert r["eval/version"] == r["step"]
        assert r["eval/n_prompts"] == 12 and r["eval/n_samples"] == 2
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1
        assert r["eval/add/n_prompts"] == 4 and r["eval/test/n_prompts"] == 8
        assert 0 < r["eval/response_len"] <= 6 and 0 <= r["eval/truncation_rate"] <= 1
    # the evaluation never entered the training data: each step trained batch x n samples
    trained = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert sum(len(t["sample_ids"]) for t in trained) == 3 * batch * n
    # staleness bound (eta = 1 in the recipe) over training groups only: <= (3 + 1 + 1) batches
    assert rows[-1]["dataplane/accepted"] <= (3 + 1 + 1) * batch * n
    assert eval_curve_keys(rows) == ["eval/pass@1", "eval/add/pass@1", "eval/test/pass@1"]
    assert (run / "reward_curve.png").stat().st_size > 0
    assert any((run / "tensorboard").iterdir())


def test_demo_summary_skips_the_step0_evaluation_row(tmp_path):
    from areal_mega.demo import summarize as demo_summary

    f = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/pass@1": 0.5}] + [
        {"step": s, "reward/mean": 0.1 * s, "mismatch": 0.0, "time/step": 1.0} for s in (1, 2, 3)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = demo_summary(f)
    assert s["steps"] == 3 and s["reward_first10"] == pytest.approx(0.2)


def test_worker_evaluator_scores_each_source_like_training(tmp_path):
    """With data.sources and no eval.reward_fn, an eval item of a training source is scored by
    that source's reward function (and kwargs), any other item by rollout.reward_fn."""
    from areal_mega.eval.worker_hook import WorkerEvaluator
    from areal_mega.models.tiny import build_char_tokenizer

    f = tmp_path / "rev.jsonl"
    f.write_text(
        "".join(
            json.dumps({"prompt": p, "answer": p[:-1][::-1], "source": s}) + "\n"
            for p, s in (("12=", "rev"), ("34=", "other"))
        )
    )
    sources = [
        {
            "name": "rev",
            "path": str(f),
            "reward_fn": "areal_mega.rewards:exact_match_reward",
            "reward_kwargs": {"eos_token": "!"},
        }
    ]
    cfg = load_config(
        None,
        [
            "data.sources=" + json.dumps(sources),
            "data.train_path=",
            f"eval.data={f}",
            "eval.every_steps=1",
            "data.apply_chat_template=false",
            "rollout.reward_fn=areal_mega.rewards:char_match_reward",
        ],
    )
    ev = WorkerEvaluator.from_config(cfg, build_char_tokenizer("digits"))
    assert [it["source"] for it in ev.items] == ["rev", "other"]
    assert set(ev.reward_fns) == {"rev"}
    # the source's kwargs are bound: "21!" ends with its EOS text, so it is an exact match
    assert ev.reward_fns["rev"]("12=", "21!", "21", finish_reason="length") == 1.0
    assert ev.reward_fn("34=", "4", "43") == 0.5  # char_match_reward for the rest
    off = load_config(None, [f"eval.data={f}"])
    assert WorkerEvaluator.from_config(off, build_char_tokenizer("digits")) is None
