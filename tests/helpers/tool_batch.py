"""Run several ``tools/`` scripts one after the other in one interpreter, each as ``python
tools/X.py ARGS`` runs it: the script executes as ``__main__`` (its ``if __name__ ==
"__main__"`` block included) with ``sys.argv`` set and its own folder first on ``sys.path``.

A conversion's own work on a tiny model takes a fraction of a second; the interpreter's imports
(torch, megatron-core) take ~5 s. A test that converts a dozen models pays those imports once
here instead of a dozen times. Each script still runs in a process other than pytest's; tests
that start a tool in a fresh interpreter of its own (``test_convert_roundtrip``,
``test_convert_bad_input``) keep that path covered.

    python -m tests.helpers.tool_batch < jobs.json    # [[script, arg, ...], ...]

Exits at the first script that exits non-zero, with that exit code, naming the script.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

from tests.helpers.workers import ROOT, worker_cmd, worker_env


def run_tools(jobs: list, timeout: float = 600.0, env: dict | None = None) -> None:
    """Run each ``[script, *args]`` of ``jobs`` (paths relative to the repository root or
    absolute) in one child interpreter, in order; fails the test with the output of the
    script that failed."""
    p = subprocess.run(
        worker_cmd("tool_batch"),
        input=json.dumps([[str(a) for a in job] for job in jobs]),
        cwd=ROOT,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def main() -> int:
    jobs = json.load(sys.stdin)
    for argv in jobs:
        script = str(Path(argv[0]).resolve())
        sys.argv = [script, *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                print(f"tool_batch: {' '.join(argv)} exited {e.code}", file=sys.stderr)
                return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
