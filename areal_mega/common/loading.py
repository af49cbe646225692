"""Load an object that a config names: ``package.module:name`` or ``path/to/file.py:name``.

Config keys such as ``rollout.reward_fn`` and ``rollout.workflow`` hold such strings. Objects
that moved to another module keep working under their old name through :data:`MOVED` (one
alias each, with a ``FutureWarning`` that names the new spelling); see ``docs/design.md``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

# Old spelling -> new spelling, for names that user configs and recipes may still carry.
# A key without ':' renames a whole module; a key with ':' renames one object.
MOVED = {
    "areal_mega.rollout.rewards": "areal_mega.rewards",
    "areal_mega.rollout.workflows": "areal_mega.workflow.builtin",
    "areal_mega.rollout.agents": "areal_mega.workflow.external_agent",
    "areal_mega.rollout.workflow_api": "areal_mega.workflow.api",
    "areal_mega.data.synthetic:exact_match_reward": "areal_mega.rewards:exact_match_reward",
    "areal_mega.data.synthetic:char_match_reward": "areal_mega.rewards:char_match_reward",
}


def _split(spec: str, what: str, dotted_ok: bool) -> tuple[str, str]:
    if ":" in spec:
        mod_part, _, name = spec.rpartition(":")
    elif dotted_ok:
        mod_part, _, name = spec.rpartition(".")
    else:
        mod_part = name = ""
    if not mod_part or not name:
        raise ValueError(
            f"{what}={spec!r}: expected 'package.module:name' or 'path/to/file.py:name'"
        )
    return mod_part, name


def _renamed(mod_part: str, name: str, spec: str, what: str) -> tuple[str, str]:
    new = MOVED.get(f"{mod_part}:{name}")
    if new is not None:
        new_mod, _, new_name = new.partition(":")
    elif mod_part in MOVED:
        new_mod, new_name = MOVED[mod_part], name
    else:
        return mod_part, name
    warnings.warn(
        f"{what}={spec!r}: moved, write '{new_mod}:{new_name}'", FutureWarning, stacklevel=3
    )
    return new_mod, new_name


def _module_from_file(path: Path, spec: str, what: str):
    if not path.is_file():
        raise ValueError(f"{what}={spec!r}: file {str(path)!r} does not exist")
    mod_name = f"_areal_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
    module = sys.modules.get(mod_name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
    return module


def load_object(spec: str, what: str, *, dotted_ok: bool = False) -> Any:
    """The object ``spec`` names: ``package.module:name`` or ``path/to/file.py:name`` (and
    ``package.module.name`` when ``dotted_ok``). Errors are ``ValueError`` naming the config
    key ``what`` and the part of ``spec`` that is wrong."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"{what}={spec!r}: expected 'package.module:name' or 'path/to/file.py:name'"
        )
    mod_part, name = _split(spec, what, dotted_ok)
    if mod_part.endswith(".py"):
        module = _module_from_file(Path(mod_part).expanduser().resolve(), spec, what)
    else:
        mod_part, name = _renamed(mod_part, name, spec, what)
        try:
            module = importlib.import_module(mod_part)
        except ImportError as e:
            raise ValueError(f"{what}={spec!r}: cannot import {mod_part!r}: {e}") from e
    if not hasattr(module, name):
        raise ValueError(f"{what}={spec!r}: {mod_part!r} has no attribute {name!r}")
    return getattr(module, name)
