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


_SCOPE_PROBE = """
import importlib.util, sys, json, torch
from areal_mega.compat import megatron_cpu
megatron_cpu.apply(force=True)
import megatron.bridge
from megatron.bridge.peft import lora_layers
from megatron.core.extensions import transformer_engine as mte
from megatron.core.utils import get_te_version
from areal_mega.models.backend import probe_te
te = lora_layers.te
holders = sorted(n for n, m in list(sys.modules.items()) if m is not None and
                 n not in ("__main__", "__mp_main__") and
                 any(v is te for v in list(vars(m).values())))
try:
    te.Linear(4, 4)
    made = True
except ImportError:
    made = False
print("SCOPE " + json.dumps(dict(
    in_sys_modules=[n for n in sys.modules if n.split(".")[0] == "transformer_engine"],
    find_spec=importlib.util.find_spec("transformer_engine") is not None,
    mcore_have_te=mte.HAVE_TE, te_version=str(get_te_version()), probe=probe_te().state,
    holders=holders, instantiable=made,
    isinstance_linear=isinstance(torch.nn.Linear(2, 2), (te.Linear, te.LayerNormLinear)),
    nested=te.ops.Sequential.__qualname__)))
"""


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformer_engine") is not None,
    reason="TransformerEngine installed: no placeholder",
)
def test_te_placeholder_is_seen_only_by_its_importer():
    """``import megatron.bridge`` works without TE, and nothing but the one importer sees the
    placeholder: megatron-core, our backend probe and ``sys.modules`` still say TE is absent."""
    out = subprocess.run(
        [sys.executable, "-c", _SCOPE_PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore"),
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("SCOPE ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    res = json.loads(line[0][6:])
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
def test_upstream_still_needs_each_patch_and_patch_fixes_it():
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
    res = json.loads(line[0][6:])
    now_works = [k for k, ok in res["unpatched"].items() if ok]
    assert not now_works, f"upstream works on CPU without these patches now: {now_works}"
    broken = [k for k, ok in res["patched"].items() if not ok]
    assert not broken, f"patched code still fails on CPU: {broken}"
