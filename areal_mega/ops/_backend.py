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

The modules are loaded by :mod:`areal_mega.common.native` (with its check of
``AREAL_MEGA_KERNEL_ISA``, the cap on the C++ kernels' vector ISA).
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType
from typing import Optional

import torch

from areal_mega.common.env_switch import env_choice
from areal_mega.common.native import (  # noqa: F401  (the loader's state, read by doctor and tests)
    KERNEL_ISA_ENV,
    OPS_BACKEND_ENV,
    OPS_BACKENDS,
    _errors,
    _modules,
    load,
)

BUILD_HINT = (
    "build them from the repository root with `python setup.py build_ext --inplace` "
    "(or `pip install --no-build-isolation -e .`, which `make test` runs); the CUDA "
    "kernels are built only when torch has CUDA and nvcc is on PATH"
)


class KernelFallbackWarning(RuntimeWarning):
    """The native kernels are not built and the slower pure-torch backend is used."""


_warned: set = set()


def native_module(device: torch.device) -> Optional[ModuleType]:
    """The compiled kernel module for ``device`` or ``None`` when it is not built."""
    return load("_ops_cuda" if device.type == "cuda" else "_ops_cpu")


def cpu_available() -> bool:
    """Whether the C++ CPU kernels are built and importable."""
    return load("_ops_cpu") is not None


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and importable."""
    return load("_ops_cuda") is not None


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
