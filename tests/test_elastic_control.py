"""Issue 35 part 1: launch.local's control plane answers reads at once, whatever is in
progress. A real supervisor and real processes: an add whose server never becomes ready runs
out of its own timeout (a clear error, the process stopped, the members unchanged) while
``list`` answers in well under a second and shows the operation; then the sequence of the
issue through launch.local (add 2, SIGKILL the newest server, remove --drain both added, list),
listing all along."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from areal_mega.config import load_config
from areal_mega.dataplane.control import ControlError, ControlServer, RolloutLink
from areal_mega.launch.elastic import ScaleService
from areal_mega.launch.scale import run_command
from areal_mega.launch.supervisor import ProcessSpec, Supervisor
from areal_mega.run_dir import RunDir
from tests.helpers.local_runs import (
    _finish,
    _launch,
    _metrics,
    _server_proc,
    _trained,
    _trainer_pid,
    _wait,
)

ROOT = Path(__file__).resolve().parents[1]
SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


class _Lister(threading.Thread):
    """Sends ``list`` every ``every_s`` and records (latency, reply) until stopped."""

    def __init__(self, endpoint, every_s=0.2):
        super().__init__(daemon=True)
        self.endpoint, self.every_s = endpoint, every_s
        self.seen: list = []
        self.stop = threading.Event()

    def run(self):
        link = RolloutLink(self.endpoint, timeout_s=30, peer="launcher")
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                reply = link.request({"cmd": "list"})
                self.seen.append((time.monotonic() - t0, reply))
                self.stop.wait(self.every_s)
        finally:
            link.close()

    def slowest(self) -> float:
        return max(lat for lat, _ in self.seen)

    def ops(self) -> list:
        return [op for _, r in self.seen for op in r["operations"]]


def test_add_that_never_gets_ready_times_out_while_list_answers(tmp_path):
    cfg = load_config(ROOT / "recipes/tiny-cpu.yaml", [f"logging.run_dir={tmp_path / 'run'}"])
    paths = RunDir.from_config(cfg)
    paths.root.mkdir(parents=True)
    sup = Supervisor(
        [ProcessSpec("main", SLEEP, kind="main")], paths.logs, grace_s=2, echo=lambda msg: None
    )
    runner = threading.Thread(target=sup.run, daemon=True)
    runner.start()

    def never_ready(slot):
        return ProcessSpec(
            f"rollout{slot.index}",
            SLEEP,  # noqa: E731
            ready=lambda: False,
            ready_timeout_s=600,
        )

    svc = ScaleService(
        cfg,
        sup,
        paths,
        never_ready,
        {"rollout0": {"addr": "127.0.0.1:9", "owned": False, "gpus": []}},
    )
    lister = _Lister(paths.launcher_endpoint)
    link = RolloutLink(paths.launcher_endpoint, timeout_s=30, peer="launcher")
    try:
        lister.start()
        t0 = time.monotonic()
        with pytest.raises(ControlError, match=r"rollout1 not ready after 3s .*--timeout=3"):
            run_command(link, {"cmd": "add", "n": 1}, timeout_s=3)
        assert time.monotonic() - t0 < 15
        lister.stop.set()
        lister.join(30)
        assert "rollout1" not in sup.running  # stopped, not left behind
        sleepers = [
            p
            for p in psutil.Process().children(recursive=True)
            if "time.sleep(300)" in " ".join(p.cmdline())
        ]
        assert [p.pid for p in sleepers] == [sup.running["main"].proc.pid]
        final = run_command(link, {"cmd": "list"}, timeout_s=3)
        assert [m["id"] for m in final["members"]] == ["rollout0"]
        assert final["operations"] == []
        assert json.loads(paths.rollout_servers_file.read_text())["ids"] == ["rollout0"]
        # every list answered in time, and showed the add while it waited
        assert len(lister.seen) >= 5 and lister.slowest() < 1.0, lister.slowest()
        assert any(
            op["cmd"] == "add" and op["state"] == "starting rollout1" for op in lister.ops()
        ), lister.ops()
    finally:
        lister.stop.set()
        link.close()
        svc.close()
        sup._on_signal(signal.SIGTERM, None)
        runner.join(30)


def _scale(run, *args, wait=True):
    """``launch.scale`` as an operator runs it: (exit code, JSON reply or stderr, seconds), or
    the running process with ``wait=False``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_mega.launch.scale", "--run-dir", str(run), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if not wait:
        return proc
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=600)
    return (
        proc.returncode,
        (json.loads(out) if proc.returncode == 0 else err),
        time.monotonic() - t0,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_poll_the_launcher_leaves_unanswered_is_asked_again_until_the_deadline(tmp_path):
    """launch.scale polls an operation; a launcher that leaves one poll unanswered (starved of
    CPU) costs that poll, not the command: the operation's result still comes back. A launcher
    that answers no poll before the operation's deadline fails the command, naming it."""
    polls = []

    def handler(msg):
        if msg["cmd"] == "add":
            return {"op": "op1", "state": "queued"}
        polls.append(time.monotonic())
        if len(polls) == 2:
            time.sleep(1.5)  # the second poll goes unanswered past its 0.5 s
        done = len(polls) >= 4
        return {
            "op": "op1",
            "state": "done" if done else "starting rollout1",
            **({"result": {"added": ["rollout1"]}} if done else {}),
        }

    server = ControlServer(f"ipc://{tmp_path}/launcher.sock", handler).start()
    link = RolloutLink(f"ipc://{tmp_path}/launcher.sock", timeout_s=5, peer="launcher")
    try:
        result = run_command(
            link, {"cmd": "add", "n": 1}, timeout_s=10, poll_s=0.05, answer_timeout_s=0.5
        )
        assert result == {"added": ["rollout1"]} and len(polls) >= 4
    finally:
        link.close()
        server.close()

    def silent(msg):
        if msg["cmd"] == "add":
            return {"op": "op1", "state": "queued"}
        time.sleep(5)
        return {"op": "op1", "state": "done"}

    server = ControlServer(f"ipc://{tmp_path}/silent.sock", silent).start()
    link = RolloutLink(f"ipc://{tmp_path}/silent.sock", timeout_s=5, peer="launcher")
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="did not answer 'op'"):
            run_command(
                link, {"cmd": "add", "n": 1}, timeout_s=1, poll_s=0.05, answer_timeout_s=0.5
            )
        assert time.monotonic() - t0 < 4  # bounded by the operation's deadline
    finally:
        link.close()
        server.close()


def test_list_answers_through_add_kill_and_drains(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    total = 40
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=off",
        "checkpoint.save_every=0",
        "cluster.max_restarts=3",
        "logging.plot=false",
        "rollout.max_new_tokens=48",
    )
    _wait(lambda: (run / "launcher.sock").exists(), proc, "the launcher socket")
    lister = _Lister(RunDir(run, run, "", "").launcher_endpoint)
    trainer = None
    try:
        _wait(lambda: len(_metrics(run)) >= 2, proc, "step 2")
        lister.start()
        trainer = psutil.Process(_trainer_pid(run))
        trainer.suspend()  # servers boot for as long as ~20 steps take: keep the run going
        adding = _scale(run, "--add", "2", wait=False)
        _wait(lambda: any(op["cmd"] == "add" for op in lister.ops()), proc, "the add listed")
        rc, during, cli_s = _scale(run, "--list")  # the operator's CLI, meanwhile
        assert rc == 0 and [op["cmd"] for op in during["operations"]] == ["add"], during
        out, err = adding.communicate(timeout=600)
        trainer.resume()
        assert adding.returncode == 0, err
        added = [a["id"] for a in json.loads(out)["added"]]
        assert added == ["rollout1", "rollout2"]

        newest = _server_proc(json.loads(out)["added"][-1]["addr"].rsplit(":", 1)[1])
        newest.kill()
        _wait(
            lambda: any(
                op["cmd"] == "relaunch" and op["target"] == "rollout2" for op in lister.ops()
            ),
            proc,
            "the relaunch of rollout2 listed",
        )
        assert len(_metrics(run)) <= total - 5, "too late for the removals"
        removing = [_scale(run, "--remove", sid, "--drain", wait=False) for sid in added[::-1]]
        for p in removing:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err
            assert json.loads(out)["id"] in added
        rc, final, _ = _scale(run, "--list")
        assert rc == 0 and [m["id"] for m in final["members"]] == ["rollout0"], final
        assert final["operations"] == [] and final["members"][0]["state"] == "serving"
    finally:
        lister.stop.set()
        if trainer is not None and trainer.is_running():
            trainer.resume()
    lister.join(30)
    rc, out = _finish(proc, timeout=600)
    assert rc == 0, out[-4000:]
    assert [r["step"] for r in _metrics(run)] == list(range(1, total + 1))
    ids = [s for r in _trained(run) for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == total * 4 * 4, "a sample trained twice or missing"
    seen = {(op["cmd"], op["target"]) for op in lister.ops()}
    assert ("relaunch", "rollout2") in seen and ("add", "2 server(s)") in seen, seen
    slowest = lister.slowest()
    print(
        f"{len(lister.seen)} lists, slowest {slowest:.3f} s; CLI --list during the add "
        f"{cli_s:.2f} s (interpreter start included); operations seen {sorted(seen)}"
    )
    assert slowest < 2.0, slowest
