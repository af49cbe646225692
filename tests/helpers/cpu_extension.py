"""Shared helpers for the ops tests: make sure the C++ CPU kernels are built (in place)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ensure_cpu_extension():
    """Import ``areal_mega._ops_cpu``, building it in place first when it is missing.

    ``make test`` builds it through ``pip install -e .``; a bare ``pytest`` in a fresh checkout
    builds it here (about a minute) so the native tests run instead of being skipped.
    """
    try:
        return importlib.import_module("areal_mega._ops_cpu")
    except ImportError:
        pass
    env = dict(os.environ, AREAL_MEGA_NO_CUDA="1", MAX_JOBS="2")
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(
            "building the CPU kernels failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        )
    from areal_mega.ops import _backend

    _backend._modules.pop("_ops_cpu", None)
    return importlib.import_module("areal_mega._ops_cpu")
