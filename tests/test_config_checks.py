"""A config is checked before any work starts: against the model's context
(``check_against_model``, called by the launcher, the trainer and the demo), and the demo's RL
overrides before its SFT warm-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.config import ConfigError, check_against_model, load_config, model_context

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-cpu.yaml")


def _model_dir(tmp_path, hf: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    return d


def test_prompt_plus_generation_beyond_the_context_is_one_error_naming_the_keys(tmp_path):
    d = _model_dir(tmp_path, {"max_position_embeddings": 64})
    ok = load_config(
        None, [f"model.path={d}", "data.max_prompt_len=60", "rollout.max_new_tokens=4"]
    )
    check_against_model(ok)  # exactly fits
    bad = load_config(
        None, [f"model.path={d}", "data.max_prompt_len=60", "rollout.max_new_tokens=1000000000"]
    )
    with pytest.raises(ConfigError) as e:
        check_against_model(bad)
    msg = str(e.value)
    assert "data.max_prompt_len=60" in msg and "rollout.max_new_tokens=1000000000" in msg
    assert "context of 64" in msg and str(d / "config.json") in msg
    check_against_model(
        load_config(None, [f"model.path={d}", "mode=sft", "rollout.max_new_tokens=1000000000"])
    )  # no rollout


def test_context_is_read_where_known_and_unknown_is_not_an_error(tmp_path):
    d = _model_dir(tmp_path, {"text_config": {"max_position_embeddings": 128}})
    assert model_context(str(d)) == (128, d / "config.json")
    assert model_context(str(tmp_path / "absent")) is None
    check_against_model(
        load_config(
            None, [f"model.path={tmp_path / 'absent'}", "rollout.max_new_tokens=1000000000"]
        )
    )
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json is not a JSON object"):
        model_context(str(d))


def test_launcher_refuses_before_starting_anything(tmp_path, capsys):
    from areal_mega.launch import local

    d = _model_dir(tmp_path, {"max_position_embeddings": 64})
    run_dir = tmp_path / "run"
    rc = local.main(
        [
            "--config",
            RECIPE,
            f"model.path={d}",
            f"logging.run_dir={run_dir}",
            "rollout.max_new_tokens=1000000000",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "config error" in err and "rollout.max_new_tokens=1000000000" in err
    assert not run_dir.exists()


def test_trainer_refuses_before_starting_anything(tmp_path):
    from areal_mega import trainer

    d = _model_dir(tmp_path, {"max_position_embeddings": 64})
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"data\.max_prompt_len=16 \+ rollout\.max_new"):
        trainer.main(
            [
                "--config",
                RECIPE,
                f"model.path={d}",
                f"logging.run_dir={run_dir}",
                "rollout.max_new_tokens=1000000000",
            ]
        )
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "override,key",
    [
        ("no_such.key=1", "no_such"),
        ("critic.enabled=true", "critic"),
        ("rollout.on_episode_failure=maybe", "rollout.on_episode_failure"),
    ],
)
def test_demo_rejects_a_bad_override_before_any_work(tmp_path, override, key):
    """The demo validates its RL overrides first: it exits non-zero naming the key, and has
    created nothing (no run directory, no SFT log, no model)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "areal_mega.demo", "--run-dir", str(tmp_path / "demo"), override],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode != 0
    assert f"config error: {key}" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
