"""A real CPU run (launch.local) with distributed weight updates over gloo and two rollout
servers: one is SIGKILLed mid-run. launch.local relaunches it, the worker holds it pending
until the trainer's next update re-forms the weight-update group with it, and it then takes
requests again. The run finishes, every sample is trained exactly once, and every token
tagged with the trainer's version has the trainer's logprob (whichever server made it)."""

import json
import os
import signal
import time
import urllib.request

import psutil
import pytest

from tests.helpers.local_runs import (
    _accepted_ids,
    _finish,
    _launch,
    _metrics,
    _server_ports,
    _server_proc,
    _trained,
    _trainer_pid,
    _wait,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_killed_server_is_relaunched_into_the_distributed_group(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    total = 30
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=off",
        "allocation=local:d2+megatron:d1",
        "rollout.weight_update=distributed",
        "rollout.weight_bucket_mb=1",
        "cluster.max_restarts=2",
        "logging.plot=false",
        "rollout.max_new_tokens=12",
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    )
    sup_log = run / "logs" / "supervisor.log"
    worker_log = run / "logs" / "rollout_worker.log"
    _wait(lambda: len(_metrics(run)) >= 2, proc, "step 2")
    port0, port = _server_ports(run)
    accepted_before = _accepted_ids(run)
    killed_at = len(_metrics(run))
    # a server boots in about as long as 20 steps take: the trainer is paused (SIGSTOP) while
    # rollout1 is relaunched, so that the run outlasts its return
    # rollout1 dies between two broadcasts (one that dies during a broadcast is left out and
    # the version sent again: tests/test_broadcast_member_death.py)
    trainer = psutil.Process(_trainer_pid(run))
    victim = _wait(lambda: _server_proc(port), proc, "rollout1")
    _suspend_between_updates(trainer, [port0, port])
    os.kill(victim.pid, signal.SIGKILL)
    try:
        _wait(
            lambda: "rollout1 failed (killed by signal 9); relaunch 1/2" in sup_log.read_text(),
            proc,
            "the relaunch of rollout1",
        )
        _wait(
            lambda: "pending until the next weight broadcast" in worker_log.read_text(),
            proc,
            "rollout1 back, pending",
        )
    finally:
        trainer.resume()
    back_at = len(_metrics(run))
    assert back_at < total - 5, f"rollout1 came back too late (step {back_at})"

    rc, out = _finish(proc, timeout=400)
    assert rc == 0, out[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    ids = [s for r in _trained(run) for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == total * 4 * 4, "a sample trained twice or missing"
    assert not accepted_before - _accepted_ids(run), "accepted samples lost"
    # relaunched rollout1 took requests again after the group was re-formed with it
    key = f"rollout/server/127_0_0_1_{port}/requests"
    reqs = [r.get(key) for r in rows]
    assert reqs[-1] > max(x for x in reqs[:back_at] if x is not None), reqs
    servers = [r["rollout/servers"] for r in rows]
    assert servers[-1] == 2, servers
    checked = [r for r in rows if r["mismatch_tokens"] > 0]
    assert len([r for r in checked if r["step"] > back_at]) >= 3, checked
    assert max(r["mismatch"] for r in checked) <= 1e-5, [r["mismatch"] for r in checked]
    assert max(r["staleness/max"] for r in rows[1:]) <= 1
    log = worker_log.read_text()
    assert "Traceback" not in log
    print(
        f"killed at step {killed_at}, back (pending) at step {back_at}; servers per step "
        f"{servers}; requests on rollout1 {reqs}"
    )


def _paused(port) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info", timeout=10) as r:
        return json.loads(r.read())["paused"]


def _suspend_between_updates(trainer, ports) -> None:
    """SIGSTOP the trainer at a moment when no weight update is under way: the servers are
    paused from the start of an update to its end, so both not paused, with the trainer
    stopped, means no broadcast is in flight."""
    for _ in range(400):
        trainer.suspend()
        time.sleep(0.3)
        if not any(_paused(p) for p in ports):
            return
        trainer.resume()
        time.sleep(0.05)
    pytest.fail("the servers never left the paused state")
