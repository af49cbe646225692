"""Shared by the conversion/checkpoint tests: run tests/helpers/convert_worker.py once per session
and the 2-rank checkpoint worker (tests/helpers/mp_checkpoint_worker.py)."""

import fcntl
import json
import os
import subprocess
from pathlib import Path

from areal_mega.common.net import free_port
from tests.helpers.multirank import run_ranks
from tests.helpers.workers import ROOT, worker_cmd, worker_env


def session_dir(tmp_path_factory) -> Path:
    """The test session's temporary root: under pytest-xdist the parent of this worker's
    basetemp, which every worker of the session shares (without xdist: the basetemp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def run_jobs(base: Path) -> Path:
    """Convert every tiny-model variant HF -> megatron -> HF (once; cached under ``base``,
    :func:`session_dir`: a worker that needs them while another converts waits for it)."""
    work = base / "convert_jobs"
    with open(base / "convert_jobs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (work / "results.json").exists():
            p = subprocess.run(
                worker_cmd("convert_worker", work),
                cwd=ROOT,
                env=worker_env(),
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return work


def results(work: Path) -> dict:
    return json.loads((work / "results.json").read_text())


def launch_2ranks(scenario: str, work: Path, conv: Path, timeout: float = 300) -> list:
    """Run the 2-rank worker for ``scenario``; returns both ranks' result dicts."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    ranks = run_ranks(
        [worker_cmd("mp_checkpoint_worker", r, 2, port, work, scenario, conv) for r in range(2)],
        timeout=timeout,
        cwd=ROOT,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    return [json.loads((work / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]
