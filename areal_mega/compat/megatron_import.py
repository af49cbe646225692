"""megatron-core's first import in a process, without what it does not need from us.

- ``megatron.core.timers`` tries ``import wandb`` at import time, for a W&B writer of its timers
  that areal-mega never hands it; with wandb installed (our trackers' extra) that import costs
  1.5-2 s in every process that imports megatron-core (the trainer, each conversion). It is
  skipped on every device: wandb is hidden while megatron-core is first imported, then
  visible again, so our own tracker (``areal_mega.tracking``) still imports it when a run asks
  for W&B.
- Without CUDA, megatron-core's ``jit_fuser`` (``torch.compile``, bound in
  ``megatron.core.jit``) leaves the functions it decorates plain, as megatron's own
  ``disable_jit_fuser`` (its ``--disable-jit-fuser``) does. On a GPU it fuses elementwise ops
  into one kernel; on a CPU the first decoration imports dynamo and inductor (about 2 s in
  every such process, 40% of megatron-core's import), and the first call of each decorated
  function (squared ReLU, the MoE router's expert-bias update, the gated attention's output
  gate, ...) compiles it with inductor's C++ backend: seconds per function and process, again
  for new packed lengths, for elementwise work that takes microseconds eagerly. Only that first
  import sees ``torch.compile`` replaced: a user's own ``torch.compile`` still compiles.

``import areal_mega`` installs a :class:`~areal_mega.compat.scoped_import.ScopedImportFinder`
(:func:`install`), so that whichever of our modules imports megatron-core first (the engine, a
model family's layers, a conversion) imports it this way; :func:`import_megatron_core` does it
explicitly.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from .scoped_import import ScopedImportFinder

#: what megatron-core imports only for features we do not use
SKIPPED_OPTIONAL = ("wandb",)


def _plain(fn=None, **_):
    """``torch.compile``'s stand-in while megatron-core is first imported on a CPU: the function
    as it is (as a decorator with or without arguments)."""
    return fn if fn is not None else (lambda f: f)


@contextmanager
def _first_import():
    """The context of megatron-core's first import (see the module docstring)."""
    import torch

    hidden = [name for name in SKIPPED_OPTIONAL if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError, megatron falls back
    cpu = not torch.cuda.is_available()
    compile_ = torch.compile
    if cpu:  # megatron.core.jit binds ``jit_fuser = torch.compile`` when it is first imported
        torch.compile = _plain
    try:
        yield
    finally:
        torch.compile = compile_
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    if cpu:  # what megatron modules imported from now on take: megatron's own no-op
        from megatron.core.jit import disable_jit_fuser

        disable_jit_fuser()


def jit_fuser_is_plain() -> bool:
    """Whether megatron-core's ``jit_fuser`` leaves the functions it decorates plain in this
    process."""
    import megatron.core.jit as jit

    return jit.jit_fuser in (jit.noop_decorator, _plain)


#: ``megatron.core`` found as the path finder finds it, its body run in :func:`_first_import`
FINDER = ScopedImportFinder(("megatron.core",), _first_import)


def install() -> None:
    """Puts :data:`FINDER` first on ``sys.meta_path`` (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)


def import_megatron_core():
    """``megatron.core``, imported now (once) as the module docstring describes."""
    if "megatron.core" not in sys.modules:
        with _first_import():
            import megatron.core  # noqa: F401
    return sys.modules["megatron.core"]
