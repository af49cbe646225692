"""One ``launch.local`` run (CPU, tiny model) with W&B (offline, chosen automatically: no API
key) and MLflow (a local file store) and an external agent that fails in known ways
(``tests/helpers/counted_agent.py``; ``rollout.on_episode_failure`` left at its default, ``auto``,
which drops a task the agent fails on and goes on), killed with SIGKILL after step 3 (checkpoint
at step 2) and relaunched by the supervisor, so step 3 is redone:

- each tracker's own reader returns the reward of every step of ``metrics.jsonl``, each step
  once, the same tracker run before and after the kill; the eval metrics are there too;
- no secret (``dataplane.secret``, ``rollout.api_key``, an agent's API key) is in any tracker
  file;
- the agents' failures by reason, retries, drops and gateway sessions summed over the metrics
  rows equal the rollout worker's own counts (and the known counts of the first 9 prompts);
- ``samples.jsonl`` holds the logged groups decoded by the model's tokenizer, and the eval
  pass's completions.
"""

import json
import os
import signal
import sys
import time

import pytest
from transformers import AutoTokenizer

from tests.helpers.local_runs import ROOT, _finish, _launch, _metrics, _trainer_pid
from tests.helpers.tracker_readers import mlflow_client, wandb_history

pytestmark = pytest.mark.slow
SECRETS = {
    "dataplane.secret": "hmac-e2e-4242",
    "rollout.api_key": "server-e2e-4343",
    "agent": "agent-e2e-4444",
}


@pytest.fixture(scope="module")
def run(assets, tmp_path_factory):
    """The run directory after the killed and relaunched run finished (4 steps)."""
    model, data = assets
    tmp = tmp_path_factory.mktemp("trackers")
    run, gate, home = tmp / "run", tmp / "gate", tmp / "home"
    gate.mkdir()
    (tmp / "eval.jsonl").write_text(
        "".join(line + "\n" for line in (data / "test.jsonl").read_text().splitlines()[:2])
    )
    kwargs = {
        "command": f"{sys.executable} {ROOT / 'tests' / 'helpers' / 'counted_agent.py'}",
        "timeout_s": 600,
        "max_concurrent": 2,
        "env": {"AGENT_GATE": str(gate), "SOME_API_KEY": SECRETS["agent"]},
    }
    os.environ["HOME"], old_home = str(home), os.environ.get("HOME")  # no ~/.netrc
    old_wandb = {k: os.environ.pop(k) for k in ("WANDB_MODE", "WANDB_API_KEY") if k in os.environ}
    try:
        proc = _launch(
            run,
            model,
            data,
            "total_steps=4",
            "recover=auto",
            "checkpoint.save_every=2",
            "cluster.max_restarts=2",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "rollout.max_concurrent=1",
            "rollout.max_head_offpolicyness=4",
            "rollout.workflow=areal_mega.workflow.external_agent:ExternalAgent",
            f"rollout.workflow_kwargs={json.dumps(kwargs)}",
            f"dataplane.secret={SECRETS['dataplane.secret']}",
            f"rollout.api_key={SECRETS['rollout.api_key']}",
            "logging.trackers=[wandb,mlflow]",
            "logging.log_samples_every=1",
            "logging.log_samples_groups=1",
            f"eval.data=[{tmp / 'eval.jsonl'}]",
            "eval.every_steps=4",
            "logging.plot=false",
        )
        deadline = time.time() + 300
        while time.time() < deadline and len([r for r in _metrics(run) if r["step"]]) < 3:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]  # waits for prompt 9
        os.kill(_trainer_pid(run), signal.SIGKILL)
        (gate / "open").touch()  # the relaunched worker's agents go on
        rc, out = _finish(proc, timeout=400)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        os.environ.update(old_wandb)
        if old_home is not None:
            os.environ["HOME"] = old_home
    assert rc == 0, out[-4000:]
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    return run


def test_trackers_hold_every_step_once_with_the_reward_of_metrics_jsonl(run):
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    reward = {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}
    history = [h for h in wandb_history(run) if "reward/mean" in h]
    assert [h["_step"] for h in history] == [1, 2, 3, 4]  # step 3 not logged twice
    assert {h["_step"]: h["reward/mean"] for h in history} == pytest.approx(reward)
    client, run_id = mlflow_client(run)
    got = client.get_metric_history(run_id, "reward.mean")  # a file store: "/" -> "."
    assert sorted(m.step for m in got) == [1, 2, 3, 4]
    assert {m.step: m.value for m in got} == pytest.approx(reward)
    evals = {h["_step"] for h in wandb_history(run) if "eval/pass@1" in h}
    assert evals == {0, 4}
    assert {m.step for m in client.get_metric_history(run_id, "eval.pass_1")} == {0, 4}
    assert client.get_run(run_id).info.status == "FINISHED"
    # one W&B run id (two offline segments, one per trainer launch), said offline once each
    segments = sorted((run / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and len({s.name.rsplit("-", 1)[1] for s in segments}) == 1
    log = (run / "logs" / "trainer.log").read_text()
    assert log.count("W&B: no W&B API key") == 2


def test_no_secret_in_any_tracker_file(run):
    files = [f for d in ("wandb", "mlruns") for f in (run / d).rglob("*") if f.is_file()]
    files += [
        run / "wandb_run.json",
        run / "mlflow_run.json",
        run / "samples.jsonl",
        run / "metrics.jsonl",
    ]
    assert len(files) > 10
    leaked = [str(f) for f in files for s in SECRETS.values() if s.encode() in f.read_bytes()]
    assert leaked == []
    client, run_id = mlflow_client(run)
    params = client.get_run(run_id).data.params
    assert params["dataplane.secret"] == params["rollout.api_key"] == "<redacted>"
    assert params["rollout.batch_size"] == "2"


def test_agent_failures_by_reason_equal_the_workers_counts(run):
    rows = _metrics(run)
    sums: dict = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("rollout/") and k.split("/")[1] not in (
                "servers",
                "resumptions",
                "server",
            ):
                sums[k[len("rollout/") :]] = sums.get(k[len("rollout/") :], 0) + v
    worker = json.loads((run / "rollout_state.json").read_text())["counts"]
    assert sums == pytest.approx(worker)
    # prompts 0..8 (steps 1-3): 1, 4, 7 fail 3 times with 2 samples each and are dropped
    # (the default for an agent; a third of the tasks stays under the failure-rate ceiling);
    # 2, 5, 8 lose one sample to a missing reward
    first = {}
    for r in rows:
        if 1 <= r["step"] <= 3:
            for k in (
                "agent_failed/exit_code",
                "agent_failed/no_reward",
                "agent_ok",
                "dropped_prompts",
                "dropped/out_of_retries",
                "retries",
                "failed",
            ):
                first[k] = first.get(k, 0) + r.get(f"rollout/{k}", 0)
    assert first == {
        "agent_failed/exit_code": 18,
        "agent_failed/no_reward": 3,
        "agent_ok": 9,
        "dropped_prompts": 3,
        "dropped/out_of_retries": 3,
        "retries": 6,
        "failed": 9,
    }
    assert worker["gateway/sessions"] >= 30


def test_samples_jsonl_holds_decoded_groups(run, assets):
    model, data = assets
    tok = AutoTokenizer.from_pretrained(model)
    prompts = {json.loads(x)["prompt"] for x in (data / "train.jsonl").read_text().splitlines()}
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert sorted({r["step"] for r in train}) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # one group per step, redone step 3 once
        mine = [r for r in train if r["step"] == step]
        assert len({r["group_id"] for r in mine}) == 1 and 1 <= len(mine) <= 2
    for r in train:
        assert r["prompt"] in prompts
        assert len(tok.encode(r["completion"], add_special_tokens=False)) == r["response_len"]
        assert 0 <= r["version_min"] <= r["version_max"] <= r["step"] - 1
        assert r["finish_reason"] in ("stop", "length") and r["advantage"] is not None
    evals = [r for r in rows if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 4] and len(evals) == 2
    tables = [h for h in wandb_history(run) if h.get("samples/_type") == "table-file"]
    assert sorted(h["_step"] for h in tables) == [1, 2, 3, 4]
    client, run_id = mlflow_client(run)
    assert len(client.list_artifacts(run_id, "samples")) == 4
