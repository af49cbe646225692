"""The run directory's layout and questions (areal_mega.run_dir): one answer for every process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from areal_mega.config import load_config
from areal_mega.dataplane.journal import TrajectoryJournal
from areal_mega.run_dir import (
    META_NAME,
    RunDir,
    checkpoint_iteration,
    complete_checkpoints,
    find_latest,
    iter_dir_name,
)
from tests.helpers.trajectories import make_traj


def _complete(root, it, accepted=0):
    d = root / iter_dir_name(it)
    d.mkdir(parents=True)
    (d / META_NAME).write_text(
        json.dumps({"complete": True, "extra": {"accepted_samples": accepted}})
    )
    return d


def test_layout_defaults_and_overrides(tmp_path):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}/run"])
    rd = RunDir.from_config(cfg)
    assert rd.root == (tmp_path / "run").resolve()
    assert rd.checkpoint_root == rd.root / "checkpoints"
    assert rd.data_endpoint == f"ipc://{rd.root}/trajectories.sock"
    assert rd.control_endpoint == f"ipc://{rd.root}/control.sock"
    assert rd.journal == rd.root / "journal" and rd.config_file == rd.root / "config.yaml"
    cfg = load_config(
        None,
        [
            f"logging.run_dir={tmp_path}/run",
            f"checkpoint.dir={tmp_path}/ck",
            "dataplane.endpoint=tcp://127.0.0.1:5555",
        ],
    )
    rd = RunDir.from_config(cfg)
    assert rd.checkpoint_root == (tmp_path / "ck").resolve()
    assert rd.data_endpoint == "tcp://127.0.0.1:5555"


def test_sockets_of_a_deep_run_directory_lie_in_the_temporary_directory(tmp_path):
    """A run directory too deep for a Unix socket address: its sockets get short paths of
    their own, the same from every process's config, apart for other runs, and usable."""
    import zmq

    from areal_mega.dataplane.transport import check_endpoint

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    cfg = load_config(None, [f"logging.run_dir={deep}"])
    rd = RunDir.from_config(cfg)
    ends = [rd.data_endpoint, rd.control_endpoint, rd.launcher_endpoint]
    assert len(set(ends)) == 3
    for e in ends:
        assert check_endpoint(e) == e and str(deep) not in e
        assert len(e.removeprefix("ipc://")) <= 100
    assert RunDir.from_config(load_config(None, [f"logging.run_dir={deep}"])).data_endpoint == (
        rd.data_endpoint
    )
    other = RunDir.from_config(load_config(None, [f"logging.run_dir={deep}2"]))
    assert other.data_endpoint != rd.data_endpoint
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind(rd.data_endpoint)
        b.connect(rd.data_endpoint)
        b.send(b"frame")
        assert a.recv() == b"frame"
        a.close(linger=0)
        b.close(linger=0)
    finally:
        ctx.term()
        Path(rd.data_endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def test_latest_complete_checkpoint_skips_incomplete_and_bad_pointer(tmp_path):
    root = tmp_path / "checkpoints"
    assert find_latest(root) is None
    a = _complete(root, 2)
    b = _complete(root, 10)
    (root / iter_dir_name(12)).mkdir()  # a save cut short: no meta
    assert complete_checkpoints(root) == [a, b]
    assert find_latest(root) == b
    (root / "latest").write_text(iter_dir_name(12))  # pointer at an incomplete one
    assert find_latest(root) == b
    # a save cut between its rename and the pointer's move: the newest complete one wins,
    # so the resumed run does not train step 10 again and then fail to save iter_10
    (root / "latest").write_text(a.name)
    assert find_latest(root) == b


def test_accepted_samples_counts_checkpoint_and_journal(tmp_path):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}"])
    rd = RunDir.from_config(cfg)
    assert rd.accepted_samples(None) == 0
    ckpt = _complete(rd.checkpoint_root, 3, accepted=8)
    assert checkpoint_iteration(ckpt) == 3
    j = TrajectoryJournal(rd.journal)
    j.append([make_traj(0, i) for i in range(4)])
    j.close()
    assert rd.accepted_samples(ckpt) == 12
    assert rd.accepted_samples(None) == 4  # recover=off: no checkpoint lineage


def test_run_dir_imports_neither_torch_nor_megatron():
    code = (
        "import sys, areal_mega.run_dir, areal_mega.dataplane.journal; "
        "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_disk_full_needs_errno_or_a_failed_write_on_a_full_filesystem(tmp_path):
    """megatron-core 0.19's DCP writer drops the errno ("Worker failure: ... error: <class
    'RuntimeError'>"): such a write failure counts as disk-full only where the filesystem is
    (nearly) full; tmp_path is not."""
    import errno as errno_mod

    from areal_mega.run_dir import is_disk_full_error

    assert is_disk_full_error(OSError(errno_mod.ENOSPC, "No space left on device"), tmp_path)
    try:
        try:
            raise RuntimeError(
                "An error is caught while starting worker 0, error: <class 'RuntimeError'>"
            )
        except RuntimeError as inner:
            raise RuntimeError(f"Worker failure: {inner}") from inner
    except RuntimeError as outer:
        assert not is_disk_full_error(outer, tmp_path)
    assert not is_disk_full_error(ValueError("bad value"), tmp_path)
