"""An environment switch: a variable that takes one of a fixed set of names.

Used by the CPU speed switches (``AREAL_MEGA_CPU_GEMM``, ``AREAL_MEGA_MALLOC``), which let a
user A/B one choice against another without a config change, and by the kernels' backend
(``AREAL_MEGA_OPS_BACKEND``).
"""

from __future__ import annotations

import os

__all__ = ["env_choice"]


def env_choice(name: str, choices: tuple, default: str) -> str:
    """The value of environment variable ``name``, stripped and lower-cased; ``default`` when
    it is unset or empty. Any value outside ``choices`` raises ``ValueError`` naming the
    variable, the value as given and the choices."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value
