"""The megatron-core CPU patches: pinned version, every patched source still present, and
upstream still broken on CPU without them (so a release that fixes or moves the code is
noticed: drop or update the patch)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megatron_core_pinned_exactly():
    from areal_mega.compat import megatron_cpu
    req = open(os.path.join(ROOT, "requirements.txt")).read()
    assert re.search(r"^megatron-core==" + re.escape(megatron_cpu.MEGATRON_CORE_VERSION) + "$",
                     req, re.M)
    from megatron.core import package_info
    assert package_info.__version__ == megatron_cpu.MEGATRON_CORE_VERSION


def test_every_patch_target_still_matches():
    from areal_mega.compat import megatron_cpu
    assert megatron_cpu.check_targets() == []
    assert len(megatron_cpu.PATCHES) >= 15


def test_check_reports_moved_code():
    from areal_mega.compat.megatron_cpu import Patch, check_targets
    bogus = Patch("bogus", "megatron.core.transformer.utils", "torch_view",
                  expect=("this text is not in megatron",))
    probs = check_targets([bogus])
    assert len(probs) == 1 and "bogus" in probs[0] and "no longer contains" in probs[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only behaviour")
def test_upstream_still_needs_each_patch_and_patch_fixes_it():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "compat_probe.py")],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(line[0][6:])
    now_works = [k for k, ok in res["unpatched"].items() if ok]
    assert not now_works, f"upstream works on CPU without these patches now: {now_works}"
    broken = [k for k, ok in res["patched"].items() if not ok]
    assert not broken, f"patched code still fails on CPU: {broken}"
