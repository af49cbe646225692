"""``launch.ray`` against a real Ray cluster on this machine: Ray's own multi-raylet
``ray.cluster_utils.Cluster`` (CPU only, one CPU declared per raylet, so the rollout server and
the trainer land on different "nodes").

* a cluster too small for the allocation: one message naming what it needs and what the
  cluster has, after the bounded wait; ``--dry-run`` places on the cluster's nodes;
* one training run of the tiny recipe through ``launch.ray`` (one run for all, the suite's time
  being capped) that checks what the ``launch.local`` end-to-end tests check of a run (step 1
  exactly on-policy, the servers at the trainer's exact weights after every update) while it
  survives, in turn, SIGKILL of the rollout server, of the rollout worker and of the trainer
  rank, the loss of a node (its raylet killed; its processes restarted on the node that
  joins), ``launch.scale --add``, and the cluster stopped mid-run (what ``ray stop`` does to
  it: the launcher ends with a clear message, no process of the run left) then the same
  command on a new cluster resuming; every step trained once, no sample twice and none
  accepted before a fault lost.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.local_runs import (
    _accepted_ids,
    _finish,
    _launch,
    _metrics,
    _server_ports,
    _server_proc,
    _snapshot_live_run,
    _trained,
    _trainer_pid,
    _wait,
)

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

ROOT = Path(__file__).resolve().parents[1]
ON_POLICY = (
    "rollout.max_head_offpolicyness=0",
    "rollout.weight_bucket_mb=1",
    "rollout.reward_fn=areal_mega.rewards:char_match_reward",
)


def _start_cluster():
    c = ray_cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    return c


def _ray_leftovers(session_dirs):
    """Live raylet / gcs_server processes of the clusters this module started."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("raylet" in cmd or "gcs_server" in cmd) and any(d in cmd for d in session_dirs):
            out.append(cmd[:200])
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``{"c": Cluster, "sessions": [session dirs]}``; a test may replace ``c`` (a cluster
    stopped and started again). Every raylet and GCS of them is gone after the module."""
    state = {"c": _start_cluster(), "sessions": []}
    state["sessions"].append(state["c"].head_node.get_session_dir_path())
    yield state
    try:
        state["c"].shutdown()
    except Exception:  # noqa: BLE001 - already stopped by the test
        pass
    deadline = time.time() + 30
    while time.time() < deadline and _ray_leftovers(state["sessions"]):
        time.sleep(0.5)
    assert not _ray_leftovers(state["sessions"]), _ray_leftovers(state["sessions"])


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    """The rollout API key as a 0600 file: the servers bind the node's (non-loopback) address."""
    f = tmp_path_factory.mktemp("key") / "api_key"
    f.write_text("ray-test-key-0123456789abcdef")
    f.chmod(0o600)
    return f


def _ray_launch(cluster, key_file, run, model, data, *extra, timeout_flag="60"):
    env = {
        "RAY_ADDRESS": cluster["c"].address,
        "AREAL_ROLLOUT_API_KEY_FILE": str(key_file),
        "PYTHONPATH": str(ROOT),
    }
    return _launch(
        run,
        model,
        data,
        *extra,
        f"--placement-timeout={timeout_flag}",
        module="areal_mega.launch.ray",
        env=env,
    )


def _run_procs(run):
    """Live processes of THIS run (their command line names the run directory), but for the
    launcher itself when ``launcher`` (its Popen) is given."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(run) in cmd and p.pid != os.getpid() and "areal_mega.launch.ray" not in cmd:
            out.append(p)
    return out


def _worker_proc(run):
    for p in _run_procs(run):
        if "-m areal_mega.rollout.worker" in " ".join(p.cmdline()):
            return p
    return None


def test_shortage_message_and_dry_run_on_the_cluster(assets, tmp_path, cluster, key_file):
    """Two servers + a trainer need 3 CPUs; the cluster has 2: after the bounded wait, one
    message naming both sides, exit 2, nothing left reserved. ``--dry-run`` places the tiny
    recipe on the cluster's two nodes."""
    model, data = assets
    t = time.monotonic()
    rc, out = _finish(
        _ray_launch(
            cluster,
            key_file,
            tmp_path / "run",
            model,
            data,
            "allocation=local:d2+megatron:d1",
            timeout_flag="3",
        ),
        timeout=120,
    )
    assert rc == 2, out[-3000:]
    assert "placement groups not placed within 3s" in out, out[-3000:]
    assert "it needs CPU 3 in 3 bundle(s)" in out and "the cluster has CPU 2 on 2 node(s)" in out
    assert "Traceback" not in out
    assert time.monotonic() - t < 90
    env = dict(os.environ, RAY_ADDRESS=cluster["c"].address, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.ray",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            f"model.path={model}",
            "--dry-run",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("free resources" in x for x in lines), r.stdout
    server = next(x for x in lines if x.strip().startswith("rollout0: tiny-cpu-"))
    trainer = next(x for x in lines if x.strip().startswith("trainer: tiny-cpu-"))
    assert server.rsplit(" on ", 1)[1] != trainer.rsplit(" on ", 1)[1]  # one CPU per node
    # launch/slurm/ray.sbatch waits for the cluster's nodes this way
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.ray",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            "--wait-nodes",
            "2",
            "--placement-timeout",
            "60",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0 and "the Ray cluster has 2 node(s)" in r.stderr, r.stderr


def _started_on(sup_text, name):
    """The node ids (8 hex digits) ``name`` was started on, in order."""
    out = []
    for line in sup_text.splitlines():
        if f"] started {name} pid " in line and ", node " in line:
            out.append(line.split(", node ", 1)[1][:8])
    return out


@pytest.mark.slow
def test_training_survives_faults_a_lost_node_and_ray_stop(assets, tmp_path, cluster, key_file):
    """One run, in turn: SIGKILL of the rollout server, of the rollout worker, of the trainer
    rank; the node that is not the head lost (its processes started again on the node that
    joins); ``launch.scale --list`` and ``--add 1``; the whole cluster stopped (what ``ray
    stop`` does to it: the launcher ends with one message, no process of the run left); the
    same command on a new cluster resumes and finishes. Every step trained once, no sample
    twice, none accepted before a fault lost; step 1 exactly on-policy and the servers at the
    trainer's exact weights after every update (as the launch.local end-to-end tests check).

    A step of the tiny model takes 0.1 s on a quiet machine and seconds on a loaded one, while a
    fault's relaunch or a scale-up takes seconds either way: the run is given more steps than
    any machine trains before its faults are done (the faults wait on its progress, not on
    time), and the resume after the cluster stop ends it two steps later (``total_steps``
    set on the command that resumes, as a user shortens a run)."""
    model, data = assets
    run = tmp_path / "run"
    args = (
        "recover=auto",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=2",
        "cluster.max_restarts=8",
        *ON_POLICY,
    )
    proc = _ray_launch(cluster, key_file, run, model, data, "total_steps=100000", *args)
    sup_log = run / "logs" / "supervisor.log"
    accepted_before = set()
    progress = 0
    relaunches = 0

    def next_fault(what):
        nonlocal progress
        _wait(lambda: len(_metrics(run)) >= progress + 2, proc, f"2 steps before {what}")
        progress = len(_metrics(run))

    def relaunched(n):
        _wait(lambda: f"relaunch {n}/8" in sup_log.read_text(), proc, f"relaunch {n}")

    # 1. the rollout server
    next_fault("the server kill")
    (port,) = _server_ports(run)
    victim = _wait(lambda: _server_proc(port), proc, "the server")
    accepted_before |= _accepted_ids(run)
    os.kill(victim.pid, signal.SIGKILL)
    relaunches += 1
    relaunched(relaunches)
    # 2. the rollout worker
    next_fault("the worker kill")
    victim = _wait(lambda: _worker_proc(run), proc, "the worker")
    accepted_before |= _accepted_ids(run)
    os.kill(victim.pid, signal.SIGKILL)
    relaunches += 1
    relaunched(relaunches)
    _wait(
        lambda: (
            "relaunched: continuing at version" in (run / "logs" / "rollout_worker.log").read_text()
        ),
        proc,
        "the worker resumed",
    )
    # 3. the trainer rank (recover=auto: resumes from its checkpoint, the worker with it)
    next_fault("the trainer kill")
    pid = _wait(lambda: _trainer_pid(run), proc, "the trainer rank")
    snap = _snapshot_live_run(run, tmp_path / "before_trainer_kill")
    os.kill(pid, signal.SIGKILL)
    relaunches += 1
    relaunched(relaunches)
    accepted_before |= _accepted_ids(snap)
    # 4. the node that is not the head: its raylet and workers killed; a new node joins
    next_fault("the node loss")
    c = cluster["c"]
    (lost,) = list(c.worker_nodes)
    lost_id = lost.node_id[:8]
    sup = sup_log.read_text()
    on_lost = [
        n
        for n in ("rollout0", "trainer", "rollout_worker")
        if _started_on(sup, n) and _started_on(sup, n)[-1] == lost_id
    ]
    assert on_lost, f"nothing ran on node {lost_id}:\n{sup}"
    snap = _snapshot_live_run(run, tmp_path / "before_node_loss")
    c.remove_node(lost, allow_graceful=False)
    new = c.add_node(num_cpus=2)  # room for what was lost and for one more server
    new_id = new.node_id[:8]
    for name in on_lost:
        _wait(
            lambda name=name: new_id in _started_on(sup_log.read_text(), name),
            proc,
            f"{name} restarted on the new node",
        )
    accepted_before |= _accepted_ids(snap)
    # 5. launch.scale on the Ray run: one more server, in a placement group of its own
    listed = _scale(run, "--list")
    assert [m["id"] for m in listed["members"]] == ["rollout0"], listed
    added = _scale(run, "--add", "1", "--timeout", "180")
    assert [a["id"] for a in added["added"]] == ["rollout1"], added
    # 6. the cluster stopped mid-run: one message, nothing of the run left
    next_fault("the cluster stop")
    snap = _snapshot_live_run(run, tmp_path / "before_stop")
    c.shutdown()  # what `ray stop` does to this cluster: every raylet and the GCS
    rc, out = _finish(proc, timeout=180)
    assert rc != 0, out[-3000:]
    assert "the Ray cluster is gone" in out, out[-3000:]
    assert "every process of the run is stopped. Resume with the same command" in out
    accepted_before |= _accepted_ids(snap)
    deadline = time.time() + 30
    while time.time() < deadline and _run_procs(run):
        time.sleep(0.3)
    assert not _run_procs(run), [p.cmdline() for p in _run_procs(run)]
    supervisor = sup_log.read_text()
    assert "rollout0 failed (killed by signal 9); relaunch 1/8" in supervisor, supervisor
    assert "rollout_worker failed (killed by signal 9); relaunch 2/8" in supervisor
    assert "trainer failed (killed by signal 9); relaunch 3/8" in supervisor  # no torchrun
    assert "restarting with it: rollout_worker" in supervisor
    assert f", node {lost_id}) died (" in supervisor  # its actor, with the node
    assert "rollout1 (" in supervisor and "joined the rollout" in supervisor
    # 7. a new cluster, the same command: it resumes and finishes
    cluster["c"] = _start_cluster()
    cluster["sessions"].append(cluster["c"].head_node.get_session_dir_path())
    total = max(r["step"] for r in _metrics(run)) + 2
    rc, out = _finish(
        _ray_launch(cluster, key_file, run, model, data, f"total_steps={total}", *args),
        timeout=300,
    )
    assert rc == 0, out[-3000:]
    assert (run / "logs" / "trainer.log").read_text().count("resumed from") >= 2

    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    first = next(r for r in rows if "ppo_kl/first_minibatch" in r)
    assert first["ppo_kl/first_minibatch"] == 0.0
    assert any(r.get("grad_norm", 0) > 0 for r in rows[:-1])
    for r in rows:
        assert r["mismatch_tokens"] > 0 and r["mismatch"] <= 1e-5, (r["step"], r["mismatch"])
        assert r["staleness/max"] == 0, r["step"]
    # exactly once: every step once in the surviving lineage, no sample twice, none lost
    trained = _trained(run)
    assert [r["step"] for r in trained] == list(range(1, total + 1))
    ids = [s for r in trained for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    lost_ids = accepted_before - _accepted_ids(run)
    assert not lost_ids, f"{len(lost_ids)} accepted samples lost, e.g. {sorted(lost_ids)[:3]}"
    assert not _run_procs(run), "a process of the run outlived it"


def _scale(run, *args):
    r = subprocess.run(
        [sys.executable, "-m", "areal_mega.launch.scale", "--run-dir", str(run), *args],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    if r.returncode != 0:
        sup = run / "logs" / "supervisor.log"
        tail = sup.read_text()[-3000:] if sup.exists() else "(no supervisor.log)"
        pytest.fail(f"launch.scale {' '.join(args)}: {r.stdout}{r.stderr}\nsupervisor.log:\n{tail}")
    return json.loads(r.stdout)
