"""Package layering, checked on the source: the lower layers never import the upper ones.

``rollout/`` and ``dataplane/`` run in the rollout worker and must not pull in the trainer
(``train/``, ``trainer``); ``run_dir`` and the pure planners are imported by every process and
must not import torch.distributed. The trainer (``train/``) takes the weight-update group from
``parallel/``, not from the launcher.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "areal_mega"


def _imports(path: Path) -> set:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("layer", ["rollout", "dataplane"])
def test_rollout_and_dataplane_import_nothing_from_the_trainer(layer):
    files = sorted((PKG / layer).rglob("*.py"))
    assert files
    bad = {f"{f.relative_to(PKG)}: {m}" for f in files for m in _imports(f)
           if m.startswith(("areal_mega.train", "areal_mega.trainer"))}
    assert not bad, sorted(bad)


def test_the_trainer_imports_nothing_from_the_launcher():
    files = sorted((PKG / "train").rglob("*.py"))
    assert files
    bad = {f"{f.relative_to(PKG)}: {m}" for f in files for m in _imports(f)
           if m.startswith("areal_mega.launch")}
    assert not bad, sorted(bad)


@pytest.mark.parametrize("module", ["run_dir.py", "parallel/allocation.py",
                                    "parallel/weight_group.py", "scheduler/planner.py",
                                    "launch/plan.py", "rollout/staleness.py"])
def test_pure_modules_do_not_import_torch_distributed(module):
    mods = _imports(PKG / module)
    assert not {m for m in mods if m.startswith("torch")}, mods


def test_only_the_client_touches_its_private_members():
    """Relaunch tolerance, elastic membership and the weight sender use the client's public
    methods and hooks (:mod:`areal_mega.rollout.hooks`), never its internals."""
    private = re.compile(r"\._(pick|call|check_one|broadcast|sticky|servers|find|mark_down)\b"
                         r"|\b_Server\b")
    bad = [f"{f.relative_to(PKG)}:{i}: {line.strip()}"
           for f in sorted(PKG.rglob("*.py")) if f != PKG / "rollout" / "client.py"
           for i, line in enumerate(f.read_text().splitlines(), 1) if private.search(line)]
    assert not bad, bad
