"""metrics.jsonl crash safety and truncation on resume, tensorboard scalars, plot, progress."""

import json
import os
import signal
import subprocess
import sys
import textwrap

from areal_mega.tracking.metrics import (
    MetricsLogger,
    ProgressBar,
    moving_average,
    plot_metrics,
    read_metrics,
    truncate_metrics,
)

CRASHER = textwrap.dedent("""
    import os, signal, sys
    from areal_mega.tracking.metrics import MetricsLogger
    lg = MetricsLogger(sys.argv[1], tensorboard=False)
    for step in range(1, 8):
        lg.log(step, {"reward/mean": step / 10, "loss": 1.0 / step})
    os.kill(os.getpid(), signal.SIGKILL)   # no close(), no atexit, no flush by the runtime
""")


def test_crash_loses_nothing(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", CRASHER, str(tmp_path)],
        timeout=60,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert r.returncode == -signal.SIGKILL
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert recs[2]["reward/mean"] == 0.3


def test_resume_truncates_later_steps_and_torn_line(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as lg:
        for s in range(1, 6):
            lg.log(s, {"reward/mean": s})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # torn by a crash
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as lg:
        lg.log(4, {"reward/mean": 40})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    assert json.loads(lines[-1])["reward/mean"] == 40
    # reopening without resume keeps everything but a torn tail
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5')
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert truncate_metrics(tmp_path / "metrics.jsonl", 2) == 2


def test_tensorboard_and_plot(tmp_path):
    import numpy as np

    with MetricsLogger(tmp_path, tensorboard=True) as lg:
        for s in range(1, 31):
            rec = lg.log(
                s,
                {
                    "step": 999,
                    "version": s - 1,
                    "reward/mean": np.float32(s / 30),
                    "loss": 0.5,
                    "ppo_kl": 1e-3,
                    "mismatch": 0.0,
                    "staleness/max": 1,
                    "time/step": 0.2,
                    "tokens/s": 1000.0,
                    "flag": True,
                },
            )
            assert rec["step"] == s and isinstance(rec["reward/mean"], float)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert len(acc.Scalars("reward/mean")) == 30
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_disabled_rank_writes_nothing(tmp_path):
    lg = MetricsLogger(tmp_path / "r1", enabled=False)
    assert lg.log(1, {"loss": 1.0}) == {}
    lg.close()
    assert not (tmp_path / "r1").exists()


def test_moving_average_and_progress(capsys):
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    pb = ProgressBar(10, initial_step=2, file=sys.stderr)
    pb.update(3, {"reward/mean": 0.25, "tokens/s": 1234.5, "version": 3})
    pb.close()
    err = capsys.readouterr().err
    assert "3/10" in err and "reward=0.250" in err and "tok/s=1234" in err
    ProgressBar(10, enabled=False).update(1, {})
