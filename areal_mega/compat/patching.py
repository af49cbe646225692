"""One patch of megatron-core's source, described and checked before it is applied.

A :class:`Patch` names the module (and function) it changes, the source text it expects to
find there, and how it is applied:

- ``torch_view``: the module's name ``torch`` is rebound to a view of torch whose
  ``torch.cuda`` is a CPU stand-in (:mod:`areal_mega.compat.cuda_shim`);
- ``rewrite``: one function is recompiled from its own source with textual replacements;
- ``custom``: a function of the patch list's own changes the module;
- ``te_placeholder``: the module's import of ``transformer_engine`` is served a placeholder
  (:mod:`areal_mega.compat.te_placeholder`).

:mod:`areal_mega.compat.megatron_cpu` holds the list of patches and applies them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

from areal_mega.compat import te_placeholder
from areal_mega.compat.cuda_shim import torch_view

__all__ = ["Patch", "rewrite_function"]


@dataclass
class Patch:
    """One patch: ``module`` (dotted), what source it expects (``expect``: snippets that must
    appear in the module, or in ``function`` when given), and how it is applied (``kind``:
    ``"torch_view"``, ``"rewrite"`` with ``replace`` pairs, or ``"custom"`` with ``fn``)."""

    name: str
    module: str
    kind: str
    expect: tuple = ()
    function: Optional[str] = None  # qualname inside module, e.g. "Class.method"
    replace: tuple = ()  # (old, new) pairs for "rewrite"
    fn: Optional[Callable[[types.ModuleType], None]] = None
    why: str = ""
    extra: dict = field(default_factory=dict)

    def target_source(self) -> str:
        if self.kind == "te_placeholder":  # importing it is what fails: read it from disk
            src = te_placeholder.importer_source(self.module)
            if src is None:
                raise ModuleNotFoundError(self.module)
            return src
        mod = importlib.import_module(self.module)
        if self.function is None:
            return inspect.getsource(mod)
        fn = _resolve(mod, self.function)
        fn = getattr(fn, "__func__", fn)
        # after a rewrite, read the source of the original function that was replaced
        return inspect.getsource(getattr(fn, "__wrapped_original__", fn))

    def check(self) -> list[str]:
        """Return the problems found (empty when the expected source is all there; a TE
        placeholder whose importer is not installed has nothing to check)."""
        if self.kind == "te_placeholder" and te_placeholder.importer_source(self.module) is None:
            return []
        try:
            src = self.target_source()
        except Exception as exc:  # module or function gone
            return [f"{self.name}: cannot read {self.module}:{self.function}: {exc!r}"]
        probs = [
            f"{self.name}: {self.module}{':' + self.function if self.function else ''} "
            f"no longer contains {s!r}"
            for s in self.expect
            if s not in src
        ]
        for old, _ in self.replace:
            if old not in src:
                probs.append(
                    f"{self.name}: {self.module}:{self.function} no longer contains {old!r}"
                )
        return probs

    def apply(self) -> None:
        mod = None if self.kind == "te_placeholder" else importlib.import_module(self.module)
        if self.kind == "torch_view":
            mod.torch = torch_view()
        elif self.kind == "rewrite":
            rewrite_function(mod, self.function, self.replace)
        elif self.kind == "custom":
            self.fn(mod)
        elif self.kind == "te_placeholder":
            te_placeholder.install()
        else:  # pragma: no cover
            raise ValueError(self.kind)


def _resolve(mod, qualname: str):
    obj = mod
    for part in qualname.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
    return obj


def rewrite_function(mod, qualname: str, replace: tuple) -> None:
    """Recompile ``mod.qualname`` from its source with ``replace`` applied, in the module's
    globals. Methods get a ``__class__`` cell so zero-argument ``super()`` keeps working."""
    parts = qualname.split(".")
    owner = mod if len(parts) == 1 else _resolve(mod, ".".join(parts[:-1]))
    orig = owner.__dict__[parts[-1]] if isinstance(owner, type) else getattr(owner, parts[-1])
    wrapper = None
    if isinstance(orig, (staticmethod, classmethod)):
        wrapper, orig = type(orig), orig.__func__
    src = textwrap.dedent(inspect.getsource(orig))
    for old, new in replace:
        src = src.replace(old, new)
    factory_src = (
        "def __areal_factory(__class__):\n"
        + textwrap.indent(src, "    ")
        + f"\n    return {parts[-1]}\n"
    )
    code = compile(factory_src, inspect.getsourcefile(orig) or "<rewrite>", "exec")
    ns: dict = {}
    exec(code, mod.__dict__, ns)
    cls = owner if isinstance(owner, type) else None
    new_fn = ns["__areal_factory"](cls)
    new_fn.__wrapped_original__ = orig
    if wrapper is not None:
        new_fn = wrapper(new_fn)
    setattr(owner, parts[-1], new_fn)
    if cls is None:  # module-level function: rebind copies imported by name elsewhere
        for name, other in list(sys.modules.items()):
            if name.startswith("megatron.") and other is not None and other is not mod:
                if other.__dict__.get(parts[-1]) is orig:
                    setattr(other, parts[-1], new_fn)
