"""Elastic rollout on a real CPU run (launch.local + launch.scale): 1 -> 3 -> 1 servers while
the job trains, with one added server SIGKILLed mid-generation (relaunched and re-synced by
launch.local), one removed without draining right as the trainer publishes new weights, and
one removed with --drain. Every sample is trained exactly once, none accepted is lost, the
tokens tagged with the trainer's version are exactly its weights' tokens, the staleness bound
holds, bad scale requests change nothing, and the run finishes with its servers stopped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from areal_mega.common.net import free_port
from areal_mega.dataplane.control import RolloutLink
from areal_mega.launch.scale import run_command
from areal_mega.run_dir import RunDir
from areal_mega.tracking.metrics import plot_metrics
from tests.helpers.local_runs import (
    _accepted_ids,
    _finish,
    _launch,
    _metrics,
    _trained,
    _trainer_pid,
    _wait,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _scale(run, *args):
    """``launch.scale`` as a user runs it: (exit code, parsed reply or stderr)."""
    r = subprocess.run(
        [sys.executable, "-m", "areal_mega.launch.scale", "--run-dir", str(run), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else r.stderr)


def _listing(link):
    """The launcher's ``list`` answer: {id: member with the worker's counters}."""
    reply = link.request({"cmd": "list"}, timeout_s=30)
    pool = {s["addr"]: s for s in reply["pool"].get("servers", [])}
    return {m["id"]: {**m, **pool.get(f"http://{m['addr']}", {})} for m in reply["members"]}, reply[
        "pool"
    ]


def _server_alive(port):
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "areal_mega.inference.server" in " ".join(cmd) and str(port) in cmd:
            return p
    return None


def test_one_to_three_to_one_servers_with_a_kill_and_removals(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    # a server boots in about as long as 20 steps take on a loaded machine: the trainer is
    # paused (SIGSTOP) while servers boot, so that the run outlasts the changes
    total = 60
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=off",
        "checkpoint.save_every=4",
        "cluster.max_restarts=3",
        "logging.plot=false",
        "rollout.max_new_tokens=48",  # requests long enough to be caught in flight
        # a dense reward: the weights move, so the version checks below mean something
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    )
    sup_log = run / "logs" / "supervisor.log"
    _wait(lambda: (run / "launcher.sock").exists(), proc, "the launcher socket")
    link = RolloutLink(RunDir(run, run, "", "").launcher_endpoint, timeout_s=300, peer="launcher")
    trainer = None
    try:
        _wait(lambda: len(_metrics(run)) >= 2, proc, "step 2")
        accepted_before = _accepted_ids(run)
        trainer = psutil.Process(_trainer_pid(run))

        # 1 -> 3
        trainer.suspend()
        rc, reply = _scale(run, "--add", "2")
        trainer.resume()
        assert rc == 0, reply
        assert [a["id"] for a in reply["added"]] == ["rollout1", "rollout2"]
        members, pool = _listing(link)
        assert sorted(members) == ["rollout0", "rollout1", "rollout2"]
        assert pool["live_servers"] == 3
        # the new servers get work at once
        _wait(
            lambda: all(m.get("requests", 0) > 0 for m in _listing(link)[0].values()),
            proc,
            "requests on every server",
        )

        # SIGKILL rollout1 while it generates: its requests resume elsewhere; launch.local
        # relaunches it and the worker re-syncs it before it gets work again
        port1 = members["rollout1"]["addr"].rsplit(":", 1)[1]
        victim = _server_alive(port1)
        accepted_before |= _accepted_ids(run)
        # killed the moment a request is seen in flight there (requests take milliseconds)
        _wait(
            lambda: (
                _listing(link)[0]["rollout1"].get("inflight", 0) > 0 and (victim.kill() or True)
            ),
            proc,
            "a request in flight on rollout1",
        )
        trainer.suspend()
        _wait(
            lambda: "rollout1 failed (killed by signal 9); relaunch 1/3" in sup_log.read_text(),
            proc,
            "the relaunch of rollout1",
        )
        worker_log = run / "logs" / "rollout_worker.log"
        _wait(
            lambda: "is back; it serves version" in worker_log.read_text(),
            proc,
            "rollout1 re-synced",
        )
        trainer.resume()

        # remove rollout2 (no drain) the moment the trainer publishes new weights
        progress = len(_metrics(run))
        assert progress <= total - 10, f"too late for the removals (step {progress})"
        seen = {p.name for p in (run / "weights").glob("v*")}
        _wait(
            lambda: {p.name for p in (run / "weights").glob("v*")} - seen,
            proc,
            "new weights",
            timeout=120,
        )
        accepted_before |= _accepted_ids(run)
        out = run_command(link, {"cmd": "remove", "id": "rollout2", "drain": False}, 300)
        assert out["id"] == "rollout2"
        members, pool = _listing(link)
        assert sorted(members) == ["rollout0", "rollout1"]

        # 2 -> 1 with --drain: the relaunched rollout1 stays; the trainer waits meanwhile (the
        # drain only needs the worker), and through the bad requests below: nothing changes
        trainer.suspend()
        rc, reply = _scale(run, "--remove", "rollout0", "--drain")
        assert rc == 0, reply
        assert reply["drained"] is True and reply["aborted"] == 0

        # bad requests: a clear error, nothing changes
        for args, words in [
            (("--remove", "nope"), "unknown server id 'nope'"),
            (("--add-addr", f"127.0.0.1:{free_port()}"), "unreachable"),
            (("--remove", "rollout1"), "last server"),
        ]:
            rc, err = _scale(run, *args)
            assert rc == 1 and words in err, (args, rc, err)
        members, pool = _listing(link)
        assert sorted(members) == ["rollout1"] and pool["live_servers"] == 1
        trainer.resume()
        assert pool["resumptions"] >= 1 and pool["joins"] == 2 and pool["removals"] == 2
        assert len(_metrics(run)) < total, "the run ended before every change was made"
    finally:
        link.close()
        if trainer is not None and trainer.is_running():
            trainer.resume()

    rc, out = _finish(proc, timeout=600)
    assert rc == 0, out[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    trained = _trained(run)
    ids = [s for r in trained for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    assert len(ids) == total * 4 * 4
    lost = accepted_before - _accepted_ids(run)
    assert not lost, f"{len(lost)} accepted samples lost, e.g. {sorted(lost)[:3]}"
    assert max(r["staleness/max"] for r in rows[1:]) <= 1, [r["staleness/max"] for r in rows]
    # tokens tagged with the trainer's version came from exactly its weights, whichever
    # server (joined, relaunched, resumed) made them
    assert sum(r["grad_norm"] > 0 for r in rows[:-1]) >= total // 2
    checked = [r for r in rows if r["mismatch_tokens"] > 0]
    assert len(checked) >= 3  # how many steps are on-policy depends on the servers' speed
    assert max(r["mismatch"] for r in checked) <= 1e-5, [r["mismatch"] for r in checked]
    # the worker's server metrics reach the metrics rows and the plot: 1 -> 3 -> 1
    servers = [r["rollout/servers"] for r in rows if "rollout/servers" in r]
    assert servers[0] == 1 and max(servers) == 3 and servers[-1] == 1, servers
    assert rows[-1]["rollout/resumptions"] >= 1
    assert plot_metrics(run / "metrics.jsonl", run / "plot.png").stat().st_size > 0
    supervisor = sup_log.read_text()
    assert "rollout2 retired" in supervisor and "rollout0 retired" in supervisor
    for m in members.values():
        assert _server_alive(m["addr"].rsplit(":", 1)[1]) is None
    assert "Traceback" not in worker_log.read_text()
