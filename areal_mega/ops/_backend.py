"""Locating the compiled kernels and choosing a backend per call.

The extension modules are ``areal_mega._ops_cpu`` (C++ kernels, always built by ``setup.py``)
and ``areal_mega._ops_cuda`` (CUDA kernels, built when torch has CUDA and nvcc exists).
The environment variable ``AREAL_MEGA_OPS_BACKEND`` selects:

* ``auto`` (default): the native kernel for the tensor's device when it is built, else the
  pure-torch backend, announced once per process and device type by a banner on stderr and a
  :class:`KernelFallbackWarning`, both naming the build command;
* ``native``: the native kernel, or a ``RuntimeError`` saying how to build it;
* ``torch``: always the pure-torch backend (a deliberate choice: no notice).

Why ``auto`` falls back instead of failing: the pure-torch backend computes the same values
(the tests compare them), so a checkout without a compiler, or the CPU demo, still works; what
it costs is speed (several times slower; ``bench/kernels.py`` measures it), which is why the
notice is a banner that warning filters cannot hide. Runs that must have the kernels (GPU
jobs, benchmarks, ``tools/gpu_check.py``) set ``AREAL_MEGA_OPS_BACKEND=native``.

``AREAL_MEGA_KERNEL_ISA`` (``avx512``, ``avx2`` or ``generic``) caps the vector ISA the C++
CPU kernels run (they pick the best the CPU has); any other value is refused when the CPU
module is loaded, naming the variable.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
import sys
import warnings
from types import ModuleType
from typing import Optional

import torch

from areal_mega.common.env_switch import env_choice

BUILD_HINT = (
    "build them from the repository root with `python setup.py build_ext --inplace` "
    "(or `pip install --no-build-isolation -e .`, which `make test` runs); the CUDA "
    "kernels are built only when torch has CUDA and nvcc is on PATH"
)


class KernelFallbackWarning(RuntimeWarning):
    """The native kernels are not built and the slower pure-torch backend is used."""


_modules: dict = {}
_errors: dict = {}
_warned: set = set()


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


def _load(name: str) -> Optional[ModuleType]:
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


def native_module(device: torch.device) -> Optional[ModuleType]:
    """The compiled kernel module for ``device`` or ``None`` when it is not built."""
    return _load("_ops_cuda" if device.type == "cuda" else "_ops_cpu")


def cpu_available() -> bool:
    """Whether the C++ CPU kernels are built and importable."""
    return _load("_ops_cpu") is not None


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and importable."""
    return _load("_ops_cuda") is not None


def requested_backend() -> str:
    """The value of ``AREAL_MEGA_OPS_BACKEND`` (:data:`OPS_BACKENDS`; ``auto`` when unset or
    empty), read at each call; another value raises ``ValueError`` naming the variable."""
    return env_choice(OPS_BACKEND_ENV, OPS_BACKENDS, "auto")


def select(device: torch.device) -> Optional[ModuleType]:
    """The native module to use for ``device``, or ``None`` for the pure-torch backend."""
    mode = requested_backend()
    if mode == "torch":
        return None
    mod = native_module(device)
    if mod is not None:
        return mod
    name = "_ops_cuda" if device.type == "cuda" else "_ops_cpu"
    reason = _errors.get(name)
    if mode == "native":
        raise RuntimeError(
            f"areal_mega.ops: the native {device.type} kernels "
            f"(areal_mega.{name}) are not built ({reason}); {BUILD_HINT}"
        )
    if name not in _warned:
        _warned.add(name)
        msg = (
            f"areal_mega.ops: the native {device.type} kernels (areal_mega.{name}) are not "
            f"built ({reason}); using the pure-torch fallback, which is several times "
            f"slower. To get them, {BUILD_HINT}. Set AREAL_MEGA_OPS_BACKEND=torch to choose "
            "the fallback deliberately (no notice) or =native to make this an error."
        )
        bar = "!" * 78
        print(f"{bar}\n{msg}\n{bar}", file=sys.stderr, flush=True)
        warnings.warn(msg, KernelFallbackWarning, stacklevel=3)
    return None
