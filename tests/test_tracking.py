"""The run log on its own (no trainer): ``logging.trackers`` checked with errors naming the key,
secrets redacted, the real W&B (offline) and MLflow (local file store) runs read back with
their own readers, a resumed run continuing the same tracker runs with no step twice,
``samples.jsonl`` decoded by the model's tokenizer, and the rollout counters carried once per
delivered group (a relaunched worker included)."""

import json
import sys

import pytest
from transformers import AutoTokenizer

from areal_mega.config import ConfigError, config_from_dict
from areal_mega.dataplane.trajectory import Trajectory
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rollout.counts import CARRY_KEY, CountCarrier, carried_counts
from areal_mega.security import REDACTED, redact_secrets
from areal_mega.tracking import RunLog
from tests.helpers.tracker_readers import mlflow_client, wandb_history

SECRETS = ("hmac-secret-1234", "server-key-5678", "agent-key-9012")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("trk") / "model",
        arch="llama",
        charset="digits",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
    )


def _cfg(run_dir, model, **logging):
    return config_from_dict(
        {
            "name": "trk",
            "model": {"path": str(model)},
            "dataplane": {"secret": SECRETS[0]},
            "rollout": {
                "api_key": SECRETS[1],
                "workflow_kwargs": {"env": {"OPENAI_API_KEY": SECRETS[2]}},
            },
            "logging": {"run_dir": str(run_dir), "tensorboard": False, **logging},
        }
    )


def test_bad_tracker_names_the_key():
    with pytest.raises(ConfigError, match=r"logging.trackers: unknown tracker 'neptune'"):
        config_from_dict({"logging": {"trackers": ["neptune"]}})
    cfg = config_from_dict({"logging": {"trackers": ["tensorboard", "wandb", "mlflow"]}})
    assert cfg.logging.trackers == ["tensorboard", "wandb", "mlflow"]


def test_a_chosen_tracker_that_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's "cannot be imported"
    with pytest.raises(
        ConfigError,
        match=r"logging.trackers: 'mlflow' is chosen but the "
        r"'mlflow' package is not installed: pip install -e \.\[mlflow\]",
    ):
        config_from_dict({"logging": {"trackers": ["mlflow"]}})


def test_redact_secrets_keeps_the_rest():
    tree = {
        "dataplane": {"secret": "s"},
        "rollout": {
            "api_key": "k",
            "batch_size": 4,
            "workflow_kwargs": {"env": {"HF_TOKEN": "t", "MODE": "x"}},
        },
        "data": {"prompt_key": "prompt"},
        "scheduler": {"max_tokens_per_mb": 512},
        "teacher": {"api_key": None},
    }
    out = redact_secrets(tree)
    assert out["dataplane"]["secret"] == out["rollout"]["api_key"] == REDACTED
    assert out["rollout"]["workflow_kwargs"]["env"] == {"HF_TOKEN": REDACTED, "MODE": "x"}
    assert out["rollout"]["batch_size"] == 4 and out["data"]["prompt_key"] == "prompt"
    assert out["scheduler"]["max_tokens_per_mb"] == 512 and out["teacher"]["api_key"] is None


def _traj(prompt, completion, reward, group, version, tok):
    p, c = tok.encode(prompt), tok.encode(completion)
    return Trajectory.from_tokens(
        p, c, [-0.5] * len(c), [version] * len(c), reward=reward, group_id=group
    )


def test_trackers_resume_without_duplicated_steps(tmp_path, model, monkeypatch):
    """Steps 1-4 logged, then a resume from the checkpoint of step 2 that redoes steps 3-4 and
    goes on to 6: every tracker holds steps 1..6 once, the same run id throughout; the redone
    steps keep their first values in the trackers (metrics.jsonl holds the redone ones)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: auto -> offline
    run = tmp_path / "run"
    cfg = _cfg(run, model, trackers=["wandb", "mlflow"], log_samples_every=2, log_samples_groups=1)
    tok = AutoTokenizer.from_pretrained(model)
    trajs = [
        _traj("12", "34", 1.0, "g1", 3, tok),
        _traj("12", "5", 0.0, "g1", 3, tok),
        _traj("77", "7", 0.5, "g2", 3, tok),
    ]
    log = RunLog(cfg, run)
    for step in range(1, 5):
        log.log_samples(step, trajs, {trajs[0].sample_id: 0.5})
        log.log(
            step,
            {
                "reward/mean": step / 10,
                "loss": float("nan"),
                "ppo_kl": 0.0,
                "ppo_kl/first_minibatch": 0.0,
            },
        )
    log.close()
    wandb_id = json.loads((run / "wandb_run.json").read_text())["id"]
    log = RunLog(cfg, run, resume_step=2)
    for step in range(3, 7):
        log.log(step, {"reward/mean": step / 10 + 1.0})
    log.close()
    assert json.loads((run / "wandb_run.json").read_text())["id"] == wandb_id
    history = [r for r in wandb_history(run) if "reward/mean" in r]
    assert [r["_step"] for r in history] == [1, 2, 3, 4, 5, 6]
    expected = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 1.5, 6: 1.6}
    assert {r["_step"]: r["reward/mean"] for r in history} == pytest.approx(expected)
    assert not any("loss" in r for r in history)  # NaN is left out, not logged
    assert any(r.get("samples/_type") == "table-file" for r in history)
    client, run_id = mlflow_client(run)
    got = client.get_metric_history(run_id, "reward.mean")  # a file store: "/" -> "."
    assert sorted(m.step for m in got) == [1, 2, 3, 4, 5, 6]
    assert {m.step: m.value for m in got} == pytest.approx(expected)
    params = client.get_run(run_id).data.params
    assert params["rollout.batch_size"] == "16" and params["dataplane.secret"] == REDACTED
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == [
        "samples/step_0000002.jsonl",
        "samples/step_0000004.jsonl",
    ]
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2]  # resume cut step 4's rows
    assert [(r["prompt"], r["completion"], r["advantage"]) for r in rows] == [
        ("12", "34", 0.5),
        ("12", "5", None),
    ]
    assert rows[0]["version_min"] == rows[0]["version_max"] == 3
    assert rows[0]["response_len"] == 2 and rows[0]["finish_reason"] == "stop"
    leaked = [
        str(f)
        for f in run.rglob("*")
        if f.is_file() and any(s.encode() in f.read_bytes() for s in SECRETS)
    ]
    assert leaked == []


@pytest.mark.parametrize("reached_store", [True, False])
def test_mlflow_resume_after_a_crash_between_the_store_and_the_state(
    tmp_path, model, reached_store
):
    """A SIGKILL after step 3's metrics reached MLflow but before the tracker saved its state
    (the e2e trackers run once hit this window): the resumed run does not log step 3 again;
    killed before they reached the store, step 3 is logged by the resumed run."""
    from mlflow.entities import Metric

    run = tmp_path / "run"
    cfg = _cfg(run, model, trackers=["mlflow"])
    log = RunLog(cfg, run)
    for step in (1, 2):
        log.log(step, {"reward/mean": step / 10})
    mlf = next(t for t in log.trackers if t.name == "mlflow")
    # what the killed process left: log()'s first two actions for step 3, not its last
    mlf.state.save(pending={"step": 3, "key": "reward.mean"})
    if reached_store:
        mlf.client.log_batch(mlf.run_id, metrics=[Metric("reward.mean", 0.3, 0, 3)])
    log = RunLog(cfg, run, resume_step=2)
    for step in (3, 4):
        log.log(step, {"reward/mean": step / 10 + 1.0})
    log.close()
    client, run_id = mlflow_client(run)
    got = {m.step: m.value for m in client.get_metric_history(run_id, "reward.mean")}
    assert len(client.get_metric_history(run_id, "reward.mean")) == 4
    assert got == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3 if reached_store else 1.3, 4: 1.4})
    assert json.loads((run / "mlflow_run.json").read_text())["pending"] is None


def test_counts_ride_once_per_delivered_group():
    state = {"failed": 0}
    carrier = CountCarrier(lambda: dict(state))
    g1 = [Trajectory.from_tokens([1], [2], [0.0], [0]) for _ in range(2)]
    state.update(failed=3, **{"agent_failed/exit_code": 6})
    assert carrier.attach(g1) == {"failed": 3, "agent_failed/exit_code": 6}
    assert CARRY_KEY not in g1[1].meta
    g2 = [Trajectory.from_tokens([1], [2], [0.0], [0])]
    assert carrier.attach(g2) == {} and CARRY_KEY not in g2[0].meta  # nothing new
    state["failed"] = 4
    carrier.attach(g2)
    assert carried_counts(g1 + g2) == {"rollout/failed": 4.0, "rollout/agent_failed/exit_code": 6.0}
    # a relaunched worker counts from zero and continues the delivered totals
    relaunched = CountCarrier(lambda: {"failed": 1}, start=carrier.delivered)
    g3 = [Trajectory.from_tokens([1], [2], [0.0], [0])]
    relaunched.attach(g3)
    assert g3[0].meta[CARRY_KEY] == {"failed": 1}
    assert relaunched.delivered == {"failed": 5, "agent_failed/exit_code": 6}
