"""Every configuration leaf is read by the code: a key that nothing reads is a lie to the user.

Static check: for each leaf ``section.key`` of :class:`ExperimentConfig`, some Python file of
the package, the launchers or the tools (other than the section dataclasses of
``areal_mega/config/``, which only declare it) must access an attribute of that name. Generic
names (``path``, ``name``) can be satisfied by an unrelated attribute; the check exists to
catch keys that nothing reads at all.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from areal_mega.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]


def _leaves(cls, prefix=""):
    for f in dataclasses.fields(cls):
        t = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _leaves(type(default), prefix + f.name + ".")
        elif t is not None and dataclasses.is_dataclass(t):
            yield from _leaves(t, prefix + f.name + ".")
        else:
            yield prefix + f.name


def _without_declarations(src: str) -> str:
    """``src`` less its decorated classes (the section dataclasses, whose docs name keys)."""
    lines = src.splitlines()
    for node in reversed(ast.parse(src).body):
        if isinstance(node, ast.ClassDef) and node.decorator_list:
            del lines[node.decorator_list[0].lineno - 1 : node.end_lineno]
    return "\n".join(lines)


def _code_outside_config() -> str:
    files = [p for d in ("areal_mega", "tools", "launch") for p in (ROOT / d).rglob("*.py")]
    config = ROOT / "areal_mega" / "config"
    return "\n".join(
        _without_declarations(p.read_text()) if p.parent == config else p.read_text() for p in files
    )


def test_every_config_leaf_is_read_somewhere():
    code = _code_outside_config()
    leaves = list(_leaves(ExperimentConfig))
    assert len(leaves) > 80  # the walk really saw the sections
    unread = [
        leaf
        for leaf in leaves
        if not re.search(r"\.%s\b|['\"]%s['\"]" % ((re.escape(leaf.rsplit(".", 1)[-1]),) * 2), code)
    ]
    assert unread == [], f"config keys that no code reads: {unread}"
