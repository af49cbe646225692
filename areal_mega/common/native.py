"""Loading the compiled kernel modules (``areal_mega._ops_cpu``, ``areal_mega._ops_cuda``).

One loader for every layer that calls native code: :mod:`areal_mega.ops` (its backend
choice, :mod:`areal_mega.ops._backend`) and the CPU compatibility of megatron-core
(:mod:`areal_mega.compat.main_grad`). A module is imported once per process; a missing or
broken build is remembered with its reason, never retried.

``AREAL_MEGA_KERNEL_ISA`` (``avx512``, ``avx2`` or ``generic``) caps the vector ISA the C++
CPU kernels run (they pick the best the CPU has); any other value is refused when the CPU
module is loaded, naming the variable.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
from types import ModuleType
from typing import Optional

_modules: dict = {}
_errors: dict = {}


OPS_BACKEND_ENV = "AREAL_MEGA_OPS_BACKEND"
OPS_BACKENDS = ("auto", "native", "torch")
KERNEL_ISA_ENV = "AREAL_MEGA_KERNEL_ISA"
KERNEL_ISAS = ("avx512", "avx2", "generic")


def _check_kernel_isa_env() -> None:
    """Refuse a value of ``AREAL_MEGA_KERNEL_ISA`` the C++ dispatch would not understand
    (it would otherwise run the best ISA without a word)."""
    value = os.environ.get(KERNEL_ISA_ENV, "")
    if value and value not in KERNEL_ISAS:
        raise ValueError(
            f"{KERNEL_ISA_ENV}={value!r}: expected one of "
            f"{', '.join(KERNEL_ISAS)} (or unset: the best the CPU has)"
        )


def elf_problem(path: str) -> Optional[str]:
    """Why the shared library ``path`` must not be loaded, or None: a file whose ELF headers
    point past its end (truncated by a failed copy or a full disk) makes the dynamic loader
    die with SIGBUS instead of raising an ImportError, so it is checked first."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None  # not a 64-bit little-endian ELF: the loader says
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            if shoff + shnum * shentsize > size or phoff + phnum * phentsize > size:
                return f"{path}: truncated ({size} bytes, its headers need more); rebuild it"
            f.seek(phoff)
            table = f.read(phnum * phentsize)
        for i in range(phnum):
            off, filesz = (
                struct.unpack_from("<Q", table, i * phentsize + 0x08)[0],
                struct.unpack_from("<Q", table, i * phentsize + 0x20)[0],
            )
            if off + filesz > size:
                return (
                    f"{path}: truncated ({size} bytes, a segment ends at {off + filesz}); "
                    "rebuild it"
                )
    except (OSError, struct.error) as e:
        return f"{path}: unreadable ({e})"
    return None


def load(name: str) -> Optional[ModuleType]:
    """The compiled module ``areal_mega.<name>`` (``_ops_cpu``, ``_ops_cuda``), imported once,
    or None when it is not built, is built for another torch or is truncated (the reason is
    kept in ``_errors[name]``). Loading ``_ops_cpu`` first checks ``AREAL_MEGA_KERNEL_ISA``."""
    if name == "_ops_cpu":
        _check_kernel_isa_env()
    if name not in _modules:
        try:
            spec = importlib.util.find_spec(f"areal_mega.{name}")
            problem = spec is not None and spec.origin and elf_problem(spec.origin)
            if problem:
                raise ImportError(problem)
            _modules[name] = importlib.import_module(f"areal_mega.{name}")
        except ImportError as exc:  # not built (or built for another torch)
            _modules[name] = None
            _errors[name] = exc
    return _modules[name]
