"""The demo's vision-language task (``python -m areal_mega.demo task=vlm``): the task switch
on the command line, the RL overrides checked before any work, and the held-out greedy
decoding of image prompts (batched prompts each decoded with their own images: equal to one
prompt at a time, and the pictures change the answers)."""

import os
import subprocess
import sys

import pytest

from areal_mega.data.synthetic_vision import write_task
from areal_mega.demo import TASKS, parse_args, vl_greedy_tokens
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.workers import ROOT


def test_task_switch_on_the_command_line():
    a = parse_args(["task=vlm", "optimizer.lr=1e-4"])
    assert (a.task, a.overrides) == ("vlm", ["optimizer.lr=1e-4"])
    assert (a.sft_steps, a.rl_steps) == (TASKS["vlm"].sft_steps, TASKS["vlm"].rl_steps)
    assert parse_args(["--task", "vlm", "--sft-steps", "7"]).sft_steps == 7
    assert parse_args([]).task == "reverse" and parse_args([]).sft_steps == 120
    assert TASKS["vlm"].recipe.name == "tiny-vl-cpu.yaml"
    for bad in (["task=nope"], ["--task", "reverse", "task=vlm"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_vlm_demo_rejects_a_bad_override_before_any_work(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.demo",
            "--run-dir",
            str(tmp_path / "d"),
            "task=vlm",
            "no_such.key=1",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode != 0 and "config error: no_such" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_greedy_decoding_of_image_prompts_batched_equals_one_at_a_time(tmp_path):
    # a wide random initialisation: the pictures move the logits enough to change the argmax
    model = make_tiny_model(
        tmp_path / "m", arch="qwen2_5_vl", charset="ascii", seed=3, initializer_range=0.2
    )
    data = write_task(tmp_path / "data", "count", n_train=1, n_test=12, seed=0)
    batched = vl_greedy_tokens(model, data / "test.jsonl", 3, batch_size=12)
    single = vl_greedy_tokens(model, data / "test.jsonl", 3, batch_size=1)
    assert batched == single and len(batched) == 12
    assert len({tuple(x) for x in batched}) > 1  # the same question: the images differ
