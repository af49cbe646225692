"""Faults of a real run (issue 21, items 15 and 16), with real processes and real disks:

* a checkpoint save that fills its (tiny tmpfs) filesystem ends the run with one clear message,
  no relaunch, the previous checkpoint intact; a supervisor whose own log disk is full keeps
  going and stops its processes cleanly;
* a rollout worker killed with SIGKILL, a rollout server killed with SIGKILL and a worker sent
  SIGTERM are each relaunched by ``launch.local``; the run finishes every step and trains every
  sample exactly once; the worker answers SIGTERM itself (exit 143, not the grace SIGKILL).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
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
    _trained,
    _wait,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_fs(tmp_path):
    """Mount a real tmpfs of the requested size (root and mount(2) needed; else skip)."""
    mounted = []

    def make(size: str) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill a real disk: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d: Path) -> None:
    """Fill the filesystem at ``d`` to the last byte."""
    with open(d / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_supervisor_survives_a_full_log_disk(tiny_fs, tmp_path):
    """supervisor.log and the child logs sit on a full filesystem: the supervisor reports it
    once on stderr, runs its main to completion and stops everything, without a traceback."""
    logs = tiny_fs("64k")
    _fill(logs)
    script = textwrap.dedent(f"""
        import sys
        from areal_mega.launch.supervisor import ProcessSpec, Supervisor
        specs = [ProcessSpec("svc", [sys.executable, "-c", "import time; time.sleep(600)"]),
                 ProcessSpec("job", [sys.executable, "-c", "pass"],
                             kind="main")]
        sys.exit(Supervisor(specs, {str(logs)!r}, grace_s=5).run())
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("cannot write") == 1, r.stderr
    assert "No space left on device" in r.stderr
    assert "run complete" in r.stderr and "all processes stopped" in r.stderr


def test_full_disk_while_checkpointing_ends_the_run_clearly(assets, tmp_path, tiny_fs):
    """checkpoint.dir on a tmpfs with room for one checkpoint (~1.1 MB each): iter 2 does not
    fit. One clear message, no relaunch (though recover=auto allows two), iter 1 intact and
    loadable-complete, the partial save removed, a non-zero exit without a traceback."""
    from areal_mega.checkpoint.dist_ckpt import verify_checkpoint
    from areal_mega.run_dir import find_latest

    model, data = assets
    ckpt = tiny_fs("1600k")
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run,
            model,
            data,
            "total_steps=4",
            "recover=auto",
            "checkpoint.save_every=1",
            "checkpoint.keep_last=2",
            f"checkpoint.dir={ckpt}",
            "cluster.max_restarts=2",
            "logging.plot=false",
        ),
        timeout=300,
    )
    assert rc != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    msg = f"no space left on device while saving iter_0000002 to {ckpt}"
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert trainer_log.count(f"[areal-mega] error: {msg}\n") == 1, trainer_log[-3000:]
    supervisor = (run / "logs" / "supervisor.log").read_text()
    assert "not relaunching" in supervisor and msg in supervisor, supervisor
    assert "relaunch 1/" not in supervisor
    assert find_latest(ckpt) == ckpt / "iter_0000001"
    assert verify_checkpoint(ckpt / "iter_0000001")["iteration"] == 1
    assert not list(ckpt.glob("*.tmp")), list(ckpt.iterdir())
    assert [r["step"] for r in _metrics(run)] == [1, 2]


def _proc(run_dir, module):
    """The live process of THIS run running ``module`` (its command line names the run)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"-m {module}" in cmd and str(run_dir) in cmd:
            return p
    return None


@pytest.mark.slow
def test_rollout_worker_and_server_are_relaunched(assets, tmp_path):
    """One run, three faults, each after the run made progress: SIGTERM to the worker (it
    exits 143 by itself, well before the grace SIGKILL), SIGKILL to the worker, SIGKILL to the
    rollout server. All relaunched (recover=off: the trainer itself is never relaunched);
    every step runs, no sample is trained twice, none accepted before a fault is lost."""
    model, data = assets
    run = tmp_path / "run"
    # each fault waits for 2 more steps, and the trainer goes on while a relaunch is awaited
    # (the third fault came at step 15 in a loaded run); the run must keep going long enough
    # that the relaunched server has to generate (else a fast run ends before it is back)
    total = 30
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=off",
        "checkpoint.save_every=3",
        "cluster.max_restarts=3",
        "cluster.kill_grace_s=30",
        "logging.plot=false",
    )
    sup_log = run / "logs" / "supervisor.log"
    accepted_before = set()
    faults = [("SIGTERM", "rollout_worker"), ("SIGKILL", "rollout_worker"), ("SIGKILL", "rollout0")]
    progress = 0
    for k, (sig, name) in enumerate(faults):  # each fault after 2 more steps
        _wait(lambda: len(_metrics(run)) >= progress + 2, proc, f"step {progress + 2}")  # noqa: B023
        progress = len(_metrics(run))
        assert progress <= total - 8, f"fault {k + 1} came too late (step {progress})"
        if name == "rollout_worker":
            victim = _wait(lambda: _proc(run, "areal_mega.rollout.worker"), proc, "the worker")
        else:
            (port,) = _server_ports(run)
            victim = _wait(lambda: _server_proc(port), proc, "the server")  # noqa: B023
        accepted_before |= _accepted_ids(run)
        os.kill(victim.pid, getattr(signal, sig))
        _wait(lambda: f"relaunch {k + 1}/3" in sup_log.read_text(), proc, f"relaunch {k + 1}")  # noqa: B023
        if name == "rollout_worker":  # the next fault hits a worker that has resumed
            n = sum(1 for _, who in faults[: k + 1] if who == "rollout_worker")
            _wait(
                lambda: (
                    (run / "logs" / "rollout_worker.log")
                    .read_text()
                    .count("relaunched: continuing at version")
                    >= n  # noqa: B023
                ),
                proc,
                f"worker relaunch {n} resumed",
            )
    rc, out = _finish(proc, timeout=420)
    assert rc == 0, out[-4000:]
    supervisor = sup_log.read_text()
    # SIGTERM was handled by the worker itself (143), not ended by the 30 s grace SIGKILL
    assert "rollout_worker failed (exit code 143); relaunch 1/3" in supervisor, supervisor
    assert "rollout_worker failed (killed by signal 9); relaunch 2/3" in supervisor
    assert "rollout0 failed (killed by signal 9); relaunch 3/3" in supervisor
    assert "ignored SIGTERM" not in supervisor
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    # the relaunched worker and server continued at the trainer's weights: tokens carry the
    # version that made them, within the staleness bound (rollout.max_head_offpolicyness=1)
    assert max(r["staleness/max"] for r in rows[1:]) <= 1, [r["staleness/max"] for r in rows]
    trained = _trained(run)
    assert [r["step"] for r in trained] == list(range(1, total + 1))
    ids = [s for r in trained for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    lost = accepted_before - _accepted_ids(run)
    assert not lost, f"{len(lost)} accepted samples lost, e.g. {sorted(lost)[:3]}"
    worker_log = (run / "logs" / "rollout_worker.log").read_text()
    assert worker_log.count("relaunched: continuing at version") == 2, worker_log[-3000:]
    assert "is back; it serves version" in worker_log, worker_log[-3000:]


_CONTROL_PEER = """
import sys, time
from areal_mega.dataplane.control import ControlServer
def handle(msg):
    if sys.argv[2] == "hang":
        print("got", msg["cmd"], flush=True)
        time.sleep(600)          # dies (SIGKILL) before it answers
    return {"by": "successor", "cmd": msg["cmd"]}
ControlServer(sys.argv[1], handle).start()
print("bound", flush=True)
time.sleep(600)
"""


def test_rollout_link_resends_to_a_relaunched_worker(tmp_path):
    """The trainer's REQ socket outlives a worker killed mid-command: the request goes again,
    on a fresh socket, to the relaunched worker, and its answer comes back."""
    import threading

    from areal_mega.dataplane.control import RolloutLink

    endpoint = f"ipc://{tmp_path}/control.sock"
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def peer(mode):
        p = subprocess.Popen(
            [sys.executable, "-c", _CONTROL_PEER, endpoint, mode],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "bound"
        return p

    first = peer("hang")
    link = RolloutLink(endpoint, timeout_s=120)
    result = {}
    t = threading.Thread(target=lambda: result.update(link.update_weights(version=3, path="x")))
    second = None
    try:
        t.start()
        assert first.stdout.readline().strip() == "got update_weights"  # it holds it
        first.kill()
        first.wait(timeout=30)
        second = peer("answer")
        t.join(timeout=90)
        assert not t.is_alive(), "the request was not resent to the relaunched worker"
        assert result == {"ok": True, "by": "successor", "cmd": "update_weights"}
    finally:
        link.close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_worker_answers_sigterm_while_a_delivery_is_blocked(assets, tmp_path):
    """No trainer takes trajectories: the sender's window (4 = one group) fills and the next
    delivery blocks. SIGTERM then still ends the worker by itself (exit 143) within
    cluster.kill_grace_s, where the supervisor would SIGKILL it; before the fix the blocked
    delivery thread held the exit forever."""
    from areal_mega.common.net import free_port

    model, data = assets
    run = tmp_path / "run"
    port = free_port("127.0.0.1")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_mega.inference.server",
            "--model-path",
            str(model),
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    grace = 5
    worker = None
    try:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_mega.rollout.worker",
                "--config",
                str(ROOT / "recipes" / "tiny-cpu.yaml"),
                f"model.path={model}",
                f"data.train_path={data / 'train.jsonl'}",
                f"data.test_path={data / 'test.jsonl'}",
                f"logging.run_dir={run}",
                "recover=off",
                "rollout.batch_size=4",
                "rollout.n_samples=4",
                "dataplane.sender_window=4",
                f'rollout.server_addrs=["127.0.0.1:{port}"]',
                f"cluster.kill_grace_s={grace}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 240
        # one group went out (rollout_state.json written): the window is full from here on
        while time.time() < deadline and not (run / "rollout_state.json").exists():
            assert worker.poll() is None, worker.stdout.read().decode()[-3000:]
            time.sleep(0.2)
        assert (run / "rollout_state.json").exists(), "the worker delivered nothing"
        worker.send_signal(signal.SIGTERM)
        try:
            rc = worker.wait(timeout=grace)  # what the supervisor grants before SIGKILL
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker ignored SIGTERM for the {grace} s grace period")
        assert rc == 128 + signal.SIGTERM, worker.stdout.read().decode()[-3000:]
        assert json.loads((run / "rollout_state.json").read_text())["next_prompt"] >= 1
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
