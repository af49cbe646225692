"""The supervisor and launch.local with real child processes: clean exits, a killed child
stops everything, SIGINT leaves no process and no bound port, SIGTERM-ignorers get SIGKILL,
bounded relaunch, and a full launch.local run (fake server + fake trainer under torchrun) that
relaunches the trainer from the latest complete checkpoint."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from areal_mega.common.net import free_port, tcp_ready
from areal_mega.launch import local, server_commands
from areal_mega.launch.supervisor import ProcessSpec, Supervisor
from areal_mega.run_dir import find_latest

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures_launch"
CHILD = [sys.executable, str(FIX / "children.py")]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(pred, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _port_free(port: int) -> bool:
    """Nothing listens on ``port``: a new server (SO_REUSEADDR, as HTTP servers set) can bind
    it; closed connections lingering in TIME_WAIT do not count as a leak."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def cleanup():
    """Kill anything a failed test left behind (pids registered by the test)."""
    pids: list = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _run_in_thread(sup):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", sup.run()), daemon=True)
    t.start()
    return t, box


def test_main_done_stops_services(tmp_path):
    sup = Supervisor(
        [
            ProcessSpec("svc", CHILD + ["sleep"]),
            ProcessSpec("main", CHILD + ["exit", "0"], kind="main"),
        ],
        tmp_path / "logs",
        grace_s=5,
        echo=lambda m: None,
    )
    assert sup.run() == 0
    assert all(r.proc.returncode is not None for r in sup.running.values())
    assert (tmp_path / "logs" / "svc.log").exists()
    assert "run complete" in (tmp_path / "logs" / "supervisor.log").read_text()


def test_kill9_of_a_child_stops_all(tmp_path, cleanup):
    port = free_port()
    sup = Supervisor(
        [
            ProcessSpec(
                "server",
                CHILD + ["listen", str(port)],
                ready=tcp_ready("127.0.0.1", port),
                ready_timeout_s=30,
            ),
            ProcessSpec("victim", CHILD + ["sleep"]),
            ProcessSpec("main", CHILD + ["sleep"], kind="main", restart=True),
        ],
        tmp_path / "logs",
        grace_s=5,
        max_restarts=3,
        echo=lambda m: None,
    )
    t, box = _run_in_thread(sup)
    assert _wait_for(lambda: len(sup.running) == 3)
    pids = [r.proc.pid for r in sup.running.values()]
    cleanup.extend(pids)
    os.kill(sup.running["victim"].proc.pid, signal.SIGKILL)  # a service dies: no relaunch
    t.join(30)
    assert not t.is_alive() and box["rc"] == 128 + signal.SIGKILL
    assert all(_gone(p) for p in pids) and _port_free(port)
    assert "victim died (killed by signal 9)" in (tmp_path / "logs/supervisor.log").read_text()


def test_stubborn_child_gets_sigkill(tmp_path, cleanup):
    sup = Supervisor(
        [
            ProcessSpec("stubborn", CHILD + ["stubborn"]),
            ProcessSpec("main", CHILD + ["exit", "0"], kind="main"),
        ],
        tmp_path / "logs",
        grace_s=1,
        echo=lambda m: None,
    )
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 15
    assert sup.running["stubborn"].proc.returncode == -signal.SIGKILL


def test_failed_main_relaunch_is_bounded(tmp_path):
    marker = tmp_path / "flaky"
    sup = Supervisor(
        [ProcessSpec("main", CHILD + ["flaky", str(marker)], kind="main", restart=True)],
        tmp_path / "logs",
        max_restarts=2,
        echo=lambda m: None,
    )
    assert sup.run() == 0 and sup.restarts == 1
    assert (tmp_path / "logs/main.log").read_text().count("===== ") == 2
    calls = []
    sup = Supervisor(
        [
            ProcessSpec(
                "main",
                CHILD + ["exit", "4"],
                kind="main",
                restart=True,
                on_restart=lambda spec, k: calls.append(k) or None,
            )
        ],
        tmp_path / "logs2",
        max_restarts=2,
        echo=lambda m: None,
    )
    assert sup.run() == 4 and sup.restarts == 2 and calls == [1, 2]


def test_a_failed_gang_member_relaunches_the_whole_gang(tmp_path):
    """Two mains of one gang (a trainer's torchrun agents on two nodes): the first fails,
    the second would wait for it forever. Both are stopped and started again in one relaunch
    (one of the budget), with the companion service; the second run of each ends the run."""
    said = []
    sup = Supervisor(
        [
            ProcessSpec("worker", CHILD + ["sleep"], restart_with_main=True),
            ProcessSpec(
                "trainer0",
                CHILD + ["flaky_after", str(tmp_path / "f0"), str(tmp_path / "f1")],
                kind="main",
                restart=True,
                gang="trainer",
            ),
            ProcessSpec(
                "trainer1",
                CHILD + ["hang_once", str(tmp_path / "f1")],
                kind="main",
                restart=True,
                gang="trainer",
            ),
        ],
        tmp_path / "logs",
        max_restarts=3,
        echo=said.append,
    )
    t, box = _run_in_thread(sup)
    t.join(60)
    assert box.get("rc") == 0 and sup.restarts == 1, said
    assert any("trainer0 failed (exit code 1); relaunch 1/3" in m for m in said), said
    assert any("restarting its gang (trainer) with it: trainer1" in m for m in said), said
    assert any("restarting with it: worker" in m for m in said), said
    for name in ("trainer0", "trainer1", "worker"):
        assert (tmp_path / f"logs/{name}.log").read_text().count("===== ") == 2, name


@pytest.mark.parametrize(
    "mode, marker",
    [
        # a main killed by SIGKILL leaves a child in its process group (as a trainer leaves
        # megatron's multiprocessing manager): the supervisor stops it before the relaunch
        ("orphan", "orphan"),
        # torchrun starts its worker in a new session; a process the worker forks just before it
        # is SIGKILLed (e.g. a checkpoint writer) is reparented to init, no longer a descendant
        # of anything the supervisor started, but still in the worker's process group: the
        # supervisor stops that group when the main fails
        ("worker", "forked"),
    ],
)
def test_killed_process_leaves_no_orphan_behind(tmp_path, cleanup, mode, marker):
    sup = Supervisor(
        [ProcessSpec("main", CHILD + [mode, str(tmp_path)], kind="main", restart=True)],
        tmp_path / "logs",
        grace_s=5,
        max_restarts=1,
        echo=lambda m: None,
    )
    assert sup.run() == 0 and sup.restarts == 1
    left = int((tmp_path / marker).read_text())
    cleanup.append(left)
    assert _wait_for(lambda: _gone(left), timeout=10), f"the {mode} case's child survived"


def test_server_dying_before_ready_is_an_error(tmp_path):
    sup = Supervisor(
        [
            ProcessSpec("server", CHILD + ["exit", "2"], ready=lambda: False),
            ProcessSpec("main", CHILD + ["sleep"], kind="main"),
        ],
        tmp_path / "logs",
        echo=lambda m: None,
    )
    assert sup.run() == 1 and "main" not in sup.running
    assert "before it was ready" in (tmp_path / "logs/supervisor.log").read_text()


def test_a_death_notice_quotes_the_last_error_of_the_log(tmp_path):
    """torchrun's wrapper error is skipped: the rank's own error is the one quoted."""
    fail = (
        "import sys; print('[rank0]: ValueError: bad key algorithm.x', flush=True); "
        "sys.exit('torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ')"
    )
    sup = Supervisor(
        [ProcessSpec("main", [sys.executable, "-c", fail], kind="main")],
        tmp_path / "logs",
        echo=lambda m: None,
    )
    assert sup.run() == 1
    text = (tmp_path / "logs/supervisor.log").read_text()
    assert "main died (exit code 1)" in text
    assert "last error: [rank0]: ValueError: bad key algorithm.x" in text
    sup = Supervisor(
        [
            ProcessSpec(
                "server", [sys.executable, "-c", "import no_such_module_x"], ready=lambda: False
            ),
            ProcessSpec("main", CHILD + ["sleep"], kind="main"),
        ],
        tmp_path / "logs2",
        echo=lambda m: None,
    )
    assert sup.run() == 1
    text = (tmp_path / "logs2/supervisor.log").read_text()
    assert "last error: ModuleNotFoundError: No module named 'no_such_module_x'" in text


DRIVER = textwrap.dedent("""
    import sys
    from areal_mega.common.net import tcp_ready
    from areal_mega.launch.supervisor import ProcessSpec, Supervisor
    child, logs, port, d = sys.argv[1:5]
    cmd = [sys.executable, child]
    sup = Supervisor([ProcessSpec("server", cmd + ["listen", port],
                                  ready=tcp_ready("127.0.0.1", int(port))),
                      ProcessSpec("spawner", cmd + ["spawn", d]),
                      ProcessSpec("stubborn", cmd + ["stubborn"]),
                      ProcessSpec("main", cmd + ["sleep"], kind="main")], logs, grace_s=2)
    sys.exit(sup.run())
""")


def test_sigint_to_supervisor_leaves_nothing(tmp_path, cleanup):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(FIX / "children.py"),
            str(tmp_path / "logs"),
            str(port),
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    cleanup.append(proc.pid)
    try:
        assert _wait_for(
            lambda: (tmp_path / "pids").exists() and len(psutil.Process(proc.pid).children()) == 4,
            60,
        )
        kids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        spawner, grandchild = map(int, (tmp_path / "pids").read_text().split())
        cleanup.extend(kids + [grandchild])
        assert grandchild in kids and not _port_free(port)
        time.sleep(2.5)  # let a periodic descendant scan happen too
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert all(_gone(p) for p in kids + [grandchild]), err
    assert _port_free(port)
    assert "all processes stopped" in err


def test_launch_local_end_to_end_with_recover(tmp_path, monkeypatch, cleanup):
    """launch.local: fake rollout server + fake trainer under torchrun (2 ranks); the trainer
    crashes after a checkpoint and is relaunched with checkpoint.load=<latest complete>."""
    monkeypatch.setattr(local, "TRAINER_MODULE", "fake_trainer")
    monkeypatch.setattr(server_commands, "ROLLOUT_SERVER_MODULE", "fake_rollout_server")
    monkeypatch.setattr(local, "ROLLOUT_WORKER_MODULE", "fake_rollout_worker")
    monkeypatch.syspath_prepend(str(FIX))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FIX), str(ROOT)]))
    monkeypatch.setenv("FAKE_PID_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    rc = local.main(
        [
            "--config",
            str(ROOT / "recipes/tiny-cpu.yaml"),
            f"logging.run_dir={run_dir}",
            "allocation=local:d2+megatron:d2",
            "model.path=/unused",
            "cluster.kill_grace_s=3",
        ]
    )
    logs = run_dir / "logs"
    sup_log = (logs / "supervisor.log").read_text()
    assert rc == 0, sup_log + (logs / "trainer.log").read_text()
    trainer_log = (logs / "trainer.log").read_text()
    assert "resumed OK from iter_0000003" in trainer_log and "relaunch 1/2" in sup_log
    assert (logs / "rollout0.log").exists() and (logs / "rollout1.log").exists()
    assert "worker serving" in (logs / "rollout_worker.log").read_text()
    pids = [int(p.read_text()) for p in tmp_path.glob("server-*.pid")]
    ports = [int(p.stem.split("-")[1]) for p in tmp_path.glob("server-*.pid")]
    pids.append(int((tmp_path / "worker.pid").read_text()))
    cleanup.extend(pids)
    assert len(pids) == 3 and all(_gone(p) for p in pids)
    assert all(_port_free(p) for p in ports)
    cfg_text = (run_dir / "config.yaml").read_text()
    assert all(f"127.0.0.1:{p}" in cfg_text for p in ports)
    assert find_latest(run_dir / "checkpoints").name == "iter_0000003"
    assert local.resume_point(local.load_config(run_dir / "config.yaml")).name == "iter_0000003"
