"""Secrets hidden by value, not only by key name: workflow kwargs named like ``OPENAI_KEY``,
``SERPER_KEY``, ``GH_PAT``, ``DB_PASS``, an ``Authorization`` header, a password in a URL (the
MLflow URI's included) and the value of a secret-named environment variable never reach the
trackers (real W&B offline and MLflow file-store runs), ``samples.jsonl`` or the log; files that
may hold one (``config.yaml``, the online journal) are 0600."""

import json
import logging
import os
import stat

import pytest
from transformers import AutoTokenizer

from areal_mega.config import config_from_dict, config_to_dict, load_config
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.launch import local
from areal_mega.models.tiny import make_tiny_model
from areal_mega.run_dir import RunDir
from areal_mega.security import REDACTED, holds_secret, redact_secrets, redact_text
from areal_mega.tracking import RunLog
from areal_mega.workflow.online_journal import OnlineJournal
from tests.helpers.tracker_readers import mlflow_client, wandb_history

OPENAI, SERPER, PAT, DBPASS, BEARER, URLPW, ENVVAL = (
    "sk-openai-1111",
    "serper-2222x",
    "ghp_pat3333",
    "db-pass-4444",
    "bearer-5555x",
    "url-pw-6666",
    "env-only-7777",
)
SECRETS = (OPENAI, SERPER, PAT, DBPASS, BEARER, URLPW, ENVVAL)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny-cpu.yaml")


def _kwargs():
    return {
        "env": {
            "OPENAI_KEY": OPENAI,
            "SERPER_KEY": SERPER,
            "GH_PAT": PAT,
            "DB_PASS": DBPASS,
            "MODE": "fast",
        },
        "headers": {"Authorization": f"Bearer {BEARER}", "Accept": "json"},
        "db_url": f"postgresql://agent:{URLPW}@db.internal:5432/x",
        "note": f"search key is {ENVVAL}",
        "max_turns": 3,
        "pass_threshold": 0.5,
    }


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_redaction_by_name_url_and_value(monkeypatch):
    monkeypatch.setenv("SEARCH_API_TOKEN", ENVVAL)
    tree = {
        "rollout": {"workflow_kwargs": _kwargs()},
        "data": {"prompt_key": "prompt"},
        "logging": {"mlflow": {"tracking_uri": f"https://u:{URLPW}@mlflow.example/"}},
    }
    out = redact_secrets(tree)
    kw = out["rollout"]["workflow_kwargs"]
    assert kw["env"] == {
        "OPENAI_KEY": REDACTED,
        "SERPER_KEY": REDACTED,
        "GH_PAT": REDACTED,
        "DB_PASS": REDACTED,
        "MODE": "fast",
    }
    assert kw["headers"] == {"Authorization": REDACTED, "Accept": "json"}
    assert kw["db_url"] == f"postgresql://agent:{REDACTED}@db.internal:5432/x"
    assert kw["note"] == f"search key is {REDACTED}"  # the environment's value
    assert kw["max_turns"] == 3 and kw["pass_threshold"] == 0.5
    assert out["data"]["prompt_key"] == "prompt"
    assert out["logging"]["mlflow"]["tracking_uri"] == f"https://u:{REDACTED}@mlflow.example/"
    assert not any(s in json.dumps(out) for s in SECRETS)
    assert holds_secret(tree)
    assert (
        redact_text(f"GET https://x:{URLPW}@h/ with {ENVVAL}")
        == f"GET https://x:{REDACTED}@h/ with {REDACTED}"
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("sec") / "model",
        arch="llama",
        charset="digits",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
    )


def test_no_secret_value_reaches_trackers_samples_or_logs(tmp_path, model, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: W&B offline
    monkeypatch.setenv("SEARCH_API_TOKEN", ENVVAL)
    run = tmp_path / "run"
    cfg = config_from_dict(
        {
            "name": "sec",
            "model": {"path": str(model)},
            "rollout": {"workflow_kwargs": _kwargs()},
            "logging": {
                "run_dir": str(run),
                "tensorboard": False,
                "trackers": ["wandb", "mlflow"],
                "log_samples_every": 1,
                "log_samples_groups": 1,
            },
        }
    )
    tok = AutoTokenizer.from_pretrained(model)
    p = tok.encode("12")
    # a completion that echoes a secret (an agent that printed its key): the sample hides it
    traj = Trajectory.from_tokens(
        p, tok.encode("34"), [-0.5, -0.5], [1, 1], reward=1.0, group_id="g"
    )
    log = RunLog(cfg, run)
    log.log_eval_samples(1, [{"prompt": "12", "completion": f"my key {OPENAI}", "reward": 0.0}])
    log.log_samples(1, [traj], {})
    log.log(1, {"reward/mean": 0.5})
    with caplog.at_level(logging.INFO):
        logging.getLogger("areal_mega.test").info("agent said %s and %s", SERPER, ENVVAL)
    log.close()
    ours = [r for r in caplog.records if r.name == "areal_mega.test"]  # W&B logs at close too
    assert ours[-1].getMessage() == f"agent said {REDACTED} and {REDACTED}"
    client, run_id = mlflow_client(run)
    params = client.get_run(run_id).data.params
    assert params["rollout.workflow_kwargs.env.OPENAI_KEY"] == REDACTED
    assert params["rollout.workflow_kwargs.headers.Authorization"] == REDACTED
    assert params["rollout.workflow_kwargs.env.MODE"] == "fast"
    assert any(r.get("eval_samples/_type") == "table-file" for r in wandb_history(run))
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["completion"] == f"my key {REDACTED}"
    leaked = [
        str(f)
        for f in run.rglob("*")
        if f.is_file() and any(s.encode() in f.read_bytes() for s in SECRETS)
    ]
    assert leaked == []


def test_config_yaml_with_a_kwargs_secret_is_private(tmp_path):
    cfg = load_config(
        TINY, [f"logging.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}"]
    )
    cfg.rollout.workflow_kwargs = {"env": {"SERPER_KEY": SERPER}}
    assert holds_secret(config_to_dict(cfg))
    local.build_specs(cfg, "cpu")
    assert _mode(RunDir.from_config(cfg).config_file) == 0o600


def test_online_journal_files_are_private(tmp_path):
    old = os.umask(0)  # the most permissive umask: still the owner's only
    try:
        j = OnlineJournal(tmp_path / "online", fresh=True)
        j.started("s1", 0)
        j.ended({"session_id": "s1", "prompt_index": 0})
        t = Trajectory.from_tokens([1, 2], [3], [-0.1], [0], reward=1.0, group_id="g")
        t.meta.update(prompt_index=0, session_id="s1")
        j.done([t])
        j.close()
    finally:
        os.umask(old)
    files = [f for f in (tmp_path / "online").rglob("*") if f.is_file()]
    assert len(files) == 3
    assert {_mode(f) for f in files} == {0o600} and _mode(tmp_path / "online") == 0o700
