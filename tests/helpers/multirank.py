"""Run a test's worker as N real processes (gloo ranks) and read what each rank wrote."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.workers import ROOT, worker_env


def run_ranks(argvs: list, *, timeout: float, env=None, cwd=None) -> list:
    """Start one process per argv, wait for each (``timeout`` seconds per rank) and return
    ``[(returncode, combined output)]`` in rank order; processes still running when a wait
    fails are killed, so no rank outlives the test. Each runs in ``cwd`` (default: the
    repository root) with the root first on ``PYTHONPATH`` (:func:`worker_env`)."""
    env, cwd = worker_env(env), cwd or ROOT
    procs = [
        subprocess.Popen(
            [str(a) for a in argv],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def rank_results(paths: list, ranks: list) -> list:
    """Each rank's JSON result (``paths[r]``); fails the test with the rank's log tail when it
    wrote none or reported an ``error``."""
    res = []
    for r, (path, (_, log)) in enumerate(zip(paths, ranks)):
        path = Path(path)
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result; log tail:\n{log[-4000:]}")
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "error" in data:
            pytest.fail(f"rank {r} failed:\n{data['error']}\nlog tail:\n{log[-2000:]}")
        res.append(data)
    return res
