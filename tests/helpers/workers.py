"""Start a helper program of this package as its own process: ``python -m
tests.helpers.<name>`` from the repository root, with the root also first on ``PYTHONPATH``, so
the program imports this checkout's ``areal_mega`` and ``tests.helpers`` whatever directory the
spawner runs it in (no program patches ``sys.path`` itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the least environment a child needs to import this checkout: no CUDA, the system's PATH, the
#: repository root on PYTHONPATH (nothing of this process's environment)
BARE_ENV = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def worker_cmd(name: str, *args, python: str | None = None) -> list:
    """The argv that runs ``tests.helpers.<name>`` as ``__main__`` with ``args`` (as strings),
    under ``python`` (default: this interpreter)."""
    return [python or sys.executable, "-m", f"tests.helpers.{name}", *map(str, args)]


def worker_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with the repository root first on
    ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_code(code: str, *args, env: dict, timeout: float) -> dict:
    """Run ``python -c code`` with ``args`` (as strings) from the repository root in exactly
    ``env`` and return the JSON object its last stdout line holds; a non-zero exit fails the
    calling test with the tail of its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_worker(name: str, *args, out: Path, timeout: float, env: dict | None = None) -> dict:
    """Run ``tests.helpers.<name>`` with ``args`` as one process from the repository root
    (:func:`worker_cmd`, ``env`` through :func:`worker_env`) and return the JSON it wrote to
    ``out``; a non-zero exit fails the calling test with the tail of its stderr."""
    proc = subprocess.run(
        worker_cmd(name, *args),
        cwd=ROOT,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
