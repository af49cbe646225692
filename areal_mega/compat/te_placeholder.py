"""A placeholder for TransformerEngine, seen only by the modules that cannot import without it.

Megatron-Bridge imports ``transformer_engine.pytorch`` unconditionally in one module
(``megatron.bridge.peft.lora_layers``, reached from ``import megatron.bridge``), although it
uses TE's classes there only in ``isinstance`` checks and in the fused LoRA path, which runs on
TE modules alone. Without TE, ``import megatron.bridge`` therefore fails.

A ``transformer_engine`` module placed in ``sys.modules`` would make that import work, but
every other ``try: import transformer_engine`` (megatron-core's ``HAVE_TE``, the bridge's model
providers, :func:`areal_mega.models.backend.probe_te`) would then believe TE is present. So the
placeholder is scoped to the listed importers: a meta-path finder wraps the loader of each
importer, and while (and only while) that module's body runs, ``transformer_engine`` and
``transformer_engine.pytorch`` are placeholder modules in ``sys.modules``; they are removed as
soon as the body returns. The importer keeps its reference (``te``); nothing else sees one.

Placeholder attributes are classes (any attribute path, e.g. ``te.ops.Sequential``, is
another placeholder class), so ``isinstance(x, te.Linear)`` is False and annotations resolve;
instantiating one raises :class:`ImportError` naming it. Before the first placeholder goes in,
megatron-core's TE probes are run once so they cache "absent" (``HAVE_TE``,
``get_te_version()`` = 0.0.0).

:func:`install` does nothing when TransformerEngine is importable. Each importer's expected
source line is checked like every other patch (:mod:`areal_mega.compat.megatron_cpu`).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from .scoped_import import ScopedImportFinder

__all__ = [
    "IMPORTERS",
    "TE_MODULES",
    "install",
    "is_installed",
    "te_importable",
    "importer_source",
    "PlaceholderModule",
    "BRIDGE_PEFT_TE_FLAGS",
    "settle_bridge_peft_te_flags",
]

#: module -> the source text that needs the placeholder (checked before installing)
IMPORTERS = {
    "megatron.bridge.peft.lora_layers": "import transformer_engine.pytorch as te",
}
TE_MODULES = ("transformer_engine", "transformer_engine.pytorch")


class _PlaceholderClass(type):
    """Metaclass of the placeholder classes: attributes are further placeholder classes and
    creating an instance raises ImportError."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _PlaceholderClass(
            name, (), {"__qualname__": f"{cls.__qualname__}.{name}", "__module__": cls.__module__}
        )
        type.__setattr__(cls, name, sub)
        return sub

    def __call__(cls, *args, **kwargs):
        raise ImportError(
            f"{cls.__module__}.{cls.__qualname__}: TransformerEngine is not "
            "installed (areal_mega.compat.te_placeholder)"
        )


class PlaceholderModule(types.ModuleType):
    """A stand-in ``transformer_engine`` module: every attribute is a placeholder class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _PlaceholderClass(name, (), {"__qualname__": name, "__module__": self.__name__})
        setattr(self, name, cls)
        return cls


def te_importable() -> bool:
    """True when a real ``transformer_engine`` can be found (then nothing is installed)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def importer_source(module: str) -> Optional[str]:
    """The source of ``module`` read from disk without importing it or its package (the
    package's ``__init__`` is what fails); None when it is not installed."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = Path(base).joinpath(*rest[:-1], rest[-1] + ".py") if rest else None
        if path is not None and path.is_file():
            return path.read_text()
    return None


def _settle_megatron_te_probes() -> None:
    """Let megatron-core record "no TE" before any placeholder exists."""
    import megatron.core.extensions.transformer_engine  # noqa: F401  (HAVE_TE = False)
    from megatron.core.utils import get_te_version

    get_te_version()  # caches 0.0.0


@contextmanager
def _placeholder_te():
    """One importer's body runs with the placeholder TE modules in ``sys.modules``."""
    _settle_megatron_te_probes()
    te = PlaceholderModule("transformer_engine")
    te.__path__ = []
    te.pytorch = PlaceholderModule("transformer_engine.pytorch")
    added = {
        name: mod for name, mod in zip(TE_MODULES, (te, te.pytorch)) if name not in sys.modules
    }
    sys.modules.update(added)
    try:
        yield
    finally:
        for name, mod in added.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


_FINDER: Optional[ScopedImportFinder] = None


def is_installed() -> bool:
    """True when the scoped finder is on ``sys.meta_path``."""
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> bool:
    """Put the scoped finder first on ``sys.meta_path`` (once) when TransformerEngine is not
    importable; returns whether it is installed. Modules already imported are not affected,
    so call it before ``import megatron.bridge``."""
    global _FINDER
    if te_importable():
        return False
    if not is_installed():
        _FINDER = ScopedImportFinder(IMPORTERS, _placeholder_te)
        sys.meta_path.insert(0, _FINDER)
    return True


#: Megatron-Bridge PEFT modules whose ``HAVE_TE`` comes out True without TE: it is computed from
#: megatron-core's TE wrapper names, which megatron-core 0.19 defines (as placeholders) even
#: when TE is absent; ``isinstance`` against them then fails.
BRIDGE_PEFT_TE_FLAGS = ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")


def settle_bridge_peft_te_flags() -> list:
    """Set ``HAVE_TE = False`` in :data:`BRIDGE_PEFT_TE_FLAGS` when TransformerEngine is not
    importable (call after :func:`install`). Returns the modules changed (empty once upstream
    computes the flag right; ``tests/test_lora_units.py`` notices)."""
    if te_importable():
        return []
    import importlib

    changed = []
    for name in BRIDGE_PEFT_TE_FLAGS:
        mod = importlib.import_module(name)
        if getattr(mod, "HAVE_TE", False):
            mod.HAVE_TE = False
            changed.append(name)
    return changed
