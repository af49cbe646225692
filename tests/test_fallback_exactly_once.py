"""A real CPU run (launch.local) whose newest checkpoint is corrupted on disk before the trainer
is SIGKILLed: the relaunched trainer falls back to the previous checkpoint, and the samples
accepted between the two (journal segments a kept checkpoint still needs) are trained again,
every sample of the run exactly once."""

import os
import signal
import time

import psutil
import pytest

from areal_mega.run_dir import find_latest
from tests.helpers.bit_flips import flip
from tests.helpers.local_runs import (
    _accepted_ids,
    _finish,
    _launch,
    _snapshot_live_run,
    _trained,
    _trainer_pid,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_corrupt_newest_checkpoint_falls_back_and_trains_every_sample_once(assets, tmp_path):
    model, data = assets
    run, total = tmp_path / "run", 8
    ckpts = run / "checkpoints"
    proc = _launch(
        run,
        model,
        data,
        f"total_steps={total}",
        "recover=auto",
        "checkpoint.save_every=2",
        "checkpoint.keep_last=2",
        "cluster.max_restarts=2",
        "logging.plot=false",
    )
    deadline = time.time() + 300
    latest = ckpts / "latest"
    while not (latest.is_file() and latest.read_text().strip() >= "iter_0000004"):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.2)
    trainer = psutil.Process(_trainer_pid(run))
    trainer.suspend()  # no save can complete while we pick the victim
    # the save a resume takes: the newest complete one (one ahead of ``latest`` when the
    # trainer stopped between a save's rename and its pointer's move)
    newest = find_latest(ckpts)
    step = int(newest.name.split("_")[1])
    previous = ckpts / f"iter_{step - 2:07d}"
    assert step < total and previous.is_dir(), sorted(p.name for p in ckpts.iterdir())
    flip(sorted(newest.glob("*.distcp"))[0])
    snap = _snapshot_live_run(run, tmp_path / "before_kill")
    os.kill(trainer.pid, signal.SIGKILL)
    rc, out = _finish(proc, timeout=480)
    assert rc == 0, out[-4000:]

    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert f"not resuming from {newest}" in trainer_log
    assert f"resumed from {previous} at step {step - 2}" in trainer_log
    assert (ckpts / f"{newest.name}.corrupt").is_dir()
    trained = _trained(run)
    assert [r["step"] for r in trained] == list(range(1, total + 1))
    ids = [s for r in trained for s in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == total * 4 * 4, "a sample trained twice or missing"
    # the steps the fallback rolled back trained samples accepted after the previous
    # checkpoint; each of them is trained again in the surviving lineage
    rolled_back = {s for r in _trained(snap) if r["step"] > step - 2 for s in r["sample_ids"]}
    assert len(rolled_back) >= 2 * 16
    assert rolled_back <= set(ids), f"{len(rolled_back - set(ids))} rolled-back samples lost"
    lost = _accepted_ids(snap) - _accepted_ids(run)
    assert not lost, f"{len(lost)} accepted samples lost, e.g. {sorted(lost)[:3]}"
    print(
        f"fallback iter_{step} -> iter_{step - 2}: {len(set(ids))} of {total * 16} samples "
        f"trained exactly once, {len(rolled_back)} rolled-back samples trained again"
    )
