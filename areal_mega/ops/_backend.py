"""Locating the compiled kernels and choosing a backend per call.

The extension modules are ``areal_mega._ops_cpu`` (C++ kernels, always built by ``setup.py``)
and ``areal_mega._ops_cuda`` (CUDA kernels, built when torch has CUDA and nvcc exists).
The environment variable ``AREAL_MEGA_OPS_BACKEND`` selects:

* ``auto`` (default): the native kernel for the tensor's device when it is built, else the
  pure-torch backend (with one warning naming the build command);
* ``native``: the native kernel, or a ``RuntimeError`` saying how to build it;
* ``torch``: always the pure-torch backend.
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType
from typing import Optional

import torch

BUILD_HINT = ("build them from the repository root with `python setup.py build_ext --inplace` "
              "(or `pip install --no-build-isolation -e .`, which `make test` runs); the CUDA "
              "kernels are built only when torch has CUDA and nvcc is on PATH")

_modules: dict = {}
_errors: dict = {}
_warned: set = set()


def _load(name: str) -> Optional[ModuleType]:
    if name not in _modules:
        try:
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
    """The value of ``AREAL_MEGA_OPS_BACKEND`` (``auto`` | ``native`` | ``torch``)."""
    mode = os.environ.get("AREAL_MEGA_OPS_BACKEND", "auto").strip().lower()
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"AREAL_MEGA_OPS_BACKEND={mode!r}: expected auto, native or torch")
    return mode


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
        raise RuntimeError(f"areal_mega.ops: the native {device.type} kernels "
                           f"(areal_mega.{name}) are not built ({reason}); {BUILD_HINT}")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"areal_mega.ops: native {device.type} kernels not built ({reason}); "
                      f"using the slower pure-torch backend. To get them, {BUILD_HINT}",
                      RuntimeWarning, stacklevel=3)
    return None
