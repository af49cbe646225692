"""Named modules whose bodies run inside a context of ours when they are first imported.

:class:`ScopedImportFinder` finds each named module as the regular path finder does and wraps
its loader, so that the module's body runs inside ``scope()`` (a context manager factory); the
module keeps its own loader as ``__loader__``. The standard library only: ``import areal_mega``
installs one (:mod:`areal_mega.compat.megatron_import`), and vLLM's processes import that.
Used for megatron-core's first import (:mod:`~areal_mega.compat.megatron_import`) and for the
TransformerEngine placeholder seen by one Megatron-Bridge module
(:mod:`~areal_mega.compat.te_placeholder`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
from typing import Callable, ContextManager, Iterable


class _ScopedLoader(importlib.abc.Loader):
    """A module's own loader, its body executed inside ``scope()``."""

    def __init__(self, loader, scope: Callable[[], ContextManager]):
        self.loader = loader
        self.scope = scope

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        with self.scope():
            self.loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class ScopedImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules ``names`` as the path finder does; each one's body runs inside
    ``scope()``. Put it on ``sys.meta_path`` before those modules are imported."""

    def __init__(self, names: Iterable[str], scope: Callable[[], ContextManager]):
        self.names = frozenset(names)
        self.scope = scope

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ScopedLoader(spec.loader, self.scope)
        return spec
