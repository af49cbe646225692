"""End to end with vLLM rollouts: ``launch.local`` with ``rollout.backend=vllm`` starts a real
vLLM server (its own environment), the rollout worker, the trainer; 10 GRPO steps on the
reverse task's prompts learn a fixed answer, no sample is trained twice, and the gloo
broadcast through our worker extension keeps the server on the trainer's weights."""

import json

import pytest

from areal_mega.data.synthetic import write_task_files
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.local_runs import _finish, _launch, _metrics, _trained
from tests.helpers.vllm_env import vllm_python
from tests.helpers.vllm_servers import TINY_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e_vllm")
    model = make_tiny_model(d / "model", **dict(TINY_VLLM, charset="digits"))
    write_task_files(d / "data", task="reverse", n_train=512, n_test=32)
    # the same prompts, one answer for all: a random tiny model learns it within 10 steps
    # (the reversal itself takes the demo's 200)
    for name in ("train.jsonl", "test.jsonl"):
        rows = [
            dict(json.loads(x), answer="0000")
            for x in (d / "data" / name).read_text().splitlines()
            if x.strip()
        ]
        (d / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, d / "data"


def _run(run_dir, model, data, *extra, timeout=600):
    """``launch.local`` on the tiny-cpu recipe (tests/helpers/local_runs.py) with vLLM
    serving the rollouts: (return code, output)."""
    return _finish(
        _launch(
            run_dir,
            model,
            data,
            "model_hparams=null",
            "rollout.backend=vllm",
            "allocation=vllm:d1+megatron:d1",
            f"rollout.vllm.python={vllm_python()}",
            "cluster.server_ready_timeout_s=400",
            "recover=off",
            *extra,
        ),
        timeout,
    )


def test_grpo_with_vllm_rollouts_learns_with_broadcast_weights(assets, tmp_path):
    """10 steps, eta 0, weights broadcast over gloo each step (our worker extension on
    vLLM's stateless group): the reward goes up, every step trains new samples, and on every
    step the tokens vLLM generated with the weights the trainer evaluates have the trainer's
    logprobs (mismatch <= 1e-5), so each broadcast reached the server whole. (vLLM's disk
    reload is checked against the broadcast in test_vllm_backend.py.)"""
    model, data = assets
    run = tmp_path / "run"
    rc, out = _run(
        run,
        model,
        data,
        "total_steps=10",
        "rollout.batch_size=8",
        "rollout.n_samples=8",
        "optimizer.lr=5e-3",
        "optimizer.warmup_steps=0",
        "rollout.weight_update=distributed",
        "rollout.weight_bucket_mb=1",
        "rollout.max_head_offpolicyness=0",
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    )
    assert rc == 0, out[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    rewards = [r["reward/mean"] for r in rows]
    print("reward per step:", [round(x, 3) for x in rewards])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert any(r.get("grad_norm", 0) > 0 for r in rows[:-1])  # the weights moved
    checked = [r for r in rows if r.get("mismatch_tokens", 0) > 0]
    print("tokens of the evaluated version per step:", [r.get("mismatch_tokens") for r in rows])
    assert checked == rows, [r.get("mismatch_tokens") for r in rows]
    for r in checked:
        assert r["mismatch"] <= 1e-5, (r["step"], r["mismatch"])
    ids = [s for rec in _trained(run) for s in rec["sample_ids"]]
    assert len(ids) == len(set(ids)) == 10 * 8 * 8
    assert max(r["staleness/max"] for r in rows) == 0
    log = (run / "logs" / "rollout0.log").read_text()
    assert (
        "vllm" in log.lower()
        and "Traceback" not in (run / "logs" / "rollout_worker.log").read_text()
    )
