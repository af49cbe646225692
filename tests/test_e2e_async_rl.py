"""End to end on CPU: launch.local (CPU rollout server, rollout worker, ZMQ data plane, trainer
under torchrun) — a fresh run's first PPO step is exactly on-policy, and a trainer killed with
SIGKILL mid-run is relaunched from its latest checkpoint without losing or repeating samples."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_mega.data.synthetic import write_task_files
from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.models.tiny import make_tiny_model
from areal_mega.train.intake import TrajectoryJournal

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(d / "model", arch="llama", charset="digits", hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    write_task_files(d / "data", task="reverse", n_train=512, n_test=32)
    return model, d / "data"


def _launch(run_dir, model, data, *extra):
    args = [sys.executable, "-m", "areal_mega.launch.local", "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"), f"model.path={model}",
            f"data.train_path={data / 'train.jsonl'}", f"data.test_path={data / 'test.jsonl'}",
            f"logging.run_dir={run_dir}", "logging.progress_bar=false",
            "logging.tensorboard=false", "rollout.batch_size=4", "rollout.n_samples=4",
            "cluster.kill_grace_s=5", *extra]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("launch.local did not finish:\n" + out.decode()[-3000:])
    return proc.returncode, out.decode()


def _metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _trained(run_dir):
    path = Path(run_dir) / "trained.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _trainer_pid():
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "areal_mega.trainer" in cmd and "torch.distributed.run" not in cmd:
            return p.pid
    return None


def _accepted_ids(run_dir):
    """Sample ids the trainer has accepted: trained, pending in checkpointed buffers, or in
    the journal segments."""
    run_dir = Path(run_dir)
    ids = {s for rec in _trained(run_dir) for s in rec["sample_ids"]}
    for f in (run_dir / "checkpoints").glob("buffer_iter_*.bin"):
        ids |= {t.sample_id for t in TrajectoryBuffer.load(str(f)).pending()}
    ids |= {t.sample_id for t in TrajectoryJournal.replay(run_dir / "journal")}
    return ids


def test_fresh_run_is_on_policy_at_step_one(assets, tmp_path):
    model, data = assets
    rc, out = _finish(_launch(tmp_path / "run", model, data, "total_steps=2", "recover=off"),
                      timeout=300)
    assert rc == 0, out[-3000:]
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    assert first["ppo_kl/first_minibatch"] == 0.0
    assert first["mismatch_tokens"] > 0
    assert first["mismatch"] <= 1e-5, first["mismatch"]
    assert first["staleness/max"] == 0


def test_sigkill_trainer_then_recover(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    total = 8
    proc = _launch(run, model, data, f"total_steps={total}", "recover=auto",
                   "checkpoint.save_every=1", "cluster.max_restarts=2")
    deadline = time.time() + 240
    while time.time() < deadline and len(_metrics(run)) < 3:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.5)
    assert len(_metrics(run)) >= 3, "the run did not reach step 3"
    pid = _trainer_pid()
    assert pid is not None
    snap = tmp_path / "before_kill"          # what was accepted before the crash
    shutil.copytree(run, snap, ignore=shutil.ignore_patterns("*.sock", "iter_*", "weights",
                                                             "init_mcore", "tensorboard"))
    os.kill(pid, signal.SIGKILL)
    steps_before = len(_metrics(snap))
    rc, out = _finish(proc, timeout=420)
    assert rc == 0, out[-4000:]

    # the step count continues: every step exactly once in the surviving lineage
    assert [r["step"] for r in _metrics(run)] == list(range(1, total + 1))
    trained = _trained(run)
    assert [r["step"] for r in trained] == list(range(1, total + 1))
    # no sample id is trained twice
    ids = [s for r in trained for s in r["sample_ids"]]
    assert len(ids) == len(set(ids))
    # none accepted before the crash is lost: trained, or still pending at the end
    lost = _accepted_ids(snap) - _accepted_ids(run)
    assert not lost, f"{len(lost)} accepted samples lost, e.g. {sorted(lost)[:3]}"
    supervisor = (run / "logs" / "supervisor.log").read_text()
    assert "relaunch 1/" in supervisor and "restarting with it: rollout_worker" in supervisor
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log
    assert steps_before >= 3
