"""Import megatron-core without the optional imports it does not need from us.

``megatron.core.timers`` tries ``import wandb`` at import time, for a W&B writer of its timers
that areal-mega never hands it; with wandb installed (our trackers' extra) that import costs
1.5-2 s in every process that imports megatron-core (the trainer, each conversion). It is
skipped here: wandb is hidden while megatron-core is first imported, then visible again, so
our own tracker (``areal_mega.tracking``) still imports it when a run asks for W&B.
"""

from __future__ import annotations

import sys

#: what megatron-core imports only for features we do not use
SKIPPED_OPTIONAL = ("wandb",)


def import_megatron_core():
    """``megatron.core``, imported now (once) with :data:`SKIPPED_OPTIONAL` hidden from it."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    hidden = [name for name in SKIPPED_OPTIONAL if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError, megatron falls back
    try:
        import megatron.core
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return megatron.core
