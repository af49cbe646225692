"""The megatron-core CPU patches: pinned version, every patched source still present, and
upstream still broken on CPU without them (so a release that fixes or moves the code is
noticed: drop or update the patch)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.workers import worker_cmd, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megatron_core_pinned_exactly():
    from areal_mega.compat import megatron_cpu

    req = open(os.path.join(ROOT, "requirements.txt")).read()
    assert re.search(
        r"^megatron-core==" + re.escape(megatron_cpu.MEGATRON_CORE_VERSION) + "$", req, re.M
    )
    from importlib.metadata import version

    assert version("megatron-core") == megatron_cpu.MEGATRON_CORE_VERSION
    from megatron.core import package_info  # 0.19 may append "+<hash of an enclosing repo>"

    assert package_info.__shortversion__ == megatron_cpu.MEGATRON_CORE_VERSION


def test_megatron_bridge_pinned_exactly():
    from importlib.metadata import version

    req = open(os.path.join(ROOT, "requirements-nodeps.txt")).read()
    pin = re.search(r"^megatron-bridge==(\S+)$", req, re.M)
    assert pin and version("megatron-bridge") == pin.group(1)


@pytest.fixture(scope="module")
def compat_probe():
    """tests/helpers/compat_probe_worker.py's answer: each probe unpatched and patched, and
    what sees the TE placeholder in the fresh process of the patched ``import
    megatron.bridge`` (``scope``; none when TransformerEngine is installed)."""
    out = subprocess.run(
        worker_cmd("compat_probe_worker"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(dict(os.environ, PYTHONWARNINGS="ignore")),
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line[0][6:])


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformer_engine") is not None,
    reason="TransformerEngine installed: no placeholder",
)
def test_te_placeholder_is_seen_only_by_its_importer(compat_probe):
    """``import megatron.bridge`` works without TE, and nothing but the one importer sees the
    placeholder: megatron-core, our backend probe and ``sys.modules`` still say TE is absent
    (read in the process of the worker's patched bridge import)."""
    assert compat_probe["patched"]["import_megatron_bridge"], compat_probe
    res = compat_probe["scope"]
    assert res == dict(
        in_sys_modules=[],
        find_spec=False,
        mcore_have_te=False,
        te_version="0.0.0",
        probe="missing",
        holders=["megatron.bridge.peft.lora_layers"],
        instantiable=False,
        isinstance_linear=False,
        nested="ops.Sequential",
    )


def test_te_placeholder_check_reads_the_importer_without_importing_it():
    from areal_mega.compat import megatron_cpu, te_placeholder

    (patch,) = [p for p in megatron_cpu.PATCHES if p.kind == "te_placeholder"]
    imported_before = patch.module in sys.modules  # an earlier test may have imported it
    assert patch.check() == []
    assert (patch.module in sys.modules) == imported_before or megatron_cpu.is_applied()
    moved = megatron_cpu.Patch(
        "moved",
        patch.module,
        "te_placeholder",
        expect=("import transformer_engine.pytorch as te_renamed",),
    )
    assert "no longer contains" in megatron_cpu.check_targets([moved])[0]
    assert te_placeholder.importer_source("megatron.bridge.no_such_module") is None


def test_every_patch_target_still_matches():
    from areal_mega.compat import megatron_cpu

    assert megatron_cpu.check_targets() == []
    assert len(megatron_cpu.PATCHES) >= 15


def test_check_reports_moved_code():
    from areal_mega.compat.megatron_cpu import Patch, check_targets

    bogus = Patch(
        "bogus",
        "megatron.core.transformer.utils",
        "torch_view",
        expect=("this text is not in megatron",),
    )
    probs = check_targets([bogus])
    assert len(probs) == 1 and "bogus" in probs[0] and "no longer contains" in probs[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only behaviour")
def test_upstream_still_needs_each_patch_and_patch_fixes_it(compat_probe):
    res = compat_probe
    now_works = [k for k, ok in res["unpatched"].items() if ok]
    assert not now_works, f"upstream works on CPU without these patches now: {now_works}"
    broken = [k for k, ok in res["patched"].items() if not ok]
    assert not broken, f"patched code still fails on CPU: {broken}"
