"""CPU stand-ins for ``torch.cuda`` used by :mod:`areal_mega.compat.megatron_cpu`.

* :class:`_TorchOnCpu` -- a view of ``torch`` for one megatron module: ``torch.cuda`` is a CPU
  stand-in (``current_device()`` is ``"cpu"``, ``synchronize`` / streams / events are no-ops,
  the RNG calls use the CPU generator) and tensor factories map ``device="cuda"`` to the CPU.
* :func:`torch_view` -- the process-wide instance of that view.

Code outside the patched modules, and ``torch`` itself, is untouched.
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch

__all__ = ["torch_view", "NullStream"]


class NullStream:
    """A CUDA stream/event stand-in: every operation is a no-op and waits complete at once."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return NullStream()

    def record(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, NullStream)

    def __hash__(self):
        return 0


def _cpu_device(*args, **kwargs):
    return torch.device("cpu")


def _noop(*args, **kwargs):
    return None


def _map_device(dev):
    if dev is None:
        return None
    if isinstance(dev, int):
        return torch.device("cpu")
    d = torch.device(dev) if isinstance(dev, str) else dev
    return torch.device("cpu") if d.type == "cuda" else dev


class _CudaOnCpu(types.SimpleNamespace):
    """What megatron sees as ``torch.cuda`` inside a patched module."""


def _make_cuda_shim() -> _CudaOnCpu:
    real = torch.cuda
    shim = _CudaOnCpu()
    # Fall back to the real torch.cuda for anything not overridden (constants, types...).
    for name in dir(real):
        if not name.startswith("__"):
            try:
                setattr(shim, name, getattr(real, name))
            except Exception:  # pragma: no cover - attribute that fails to resolve
                pass
    shim.is_available = lambda: False
    shim.current_device = _cpu_device
    shim.device_count = lambda: 0
    shim.synchronize = _noop
    shim.set_device = _noop
    shim.empty_cache = _noop
    shim.Stream = NullStream
    shim.Event = NullStream
    shim.current_stream = lambda *a, **k: NullStream()
    shim.default_stream = lambda *a, **k: NullStream()
    shim.stream = lambda *a, **k: contextlib.nullcontext()
    shim.get_rng_state = lambda *a, **k: torch.get_rng_state()
    shim.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    shim.manual_seed = lambda seed: torch.manual_seed(seed)
    shim.memory_allocated = lambda *a, **k: 0
    shim.max_memory_allocated = lambda *a, **k: 0
    shim.nvtx = types.SimpleNamespace(
        range_push=_noop, range_pop=_noop, range=lambda *a, **k: contextlib.nullcontext()
    )
    return shim


_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)


class _TorchOnCpu(types.ModuleType):
    """A view of ``torch`` for one megatron module: ``cuda`` is the CPU shim and tensor
    factories place ``device="cuda"`` tensors on the CPU. Everything else is the real torch."""

    def __init__(self, shim):
        super().__init__("torch")
        self.__dict__["cuda"] = shim
        for name in _FACTORIES:
            self.__dict__[name] = self._wrap_factory(getattr(torch, name))

    @staticmethod
    def _wrap_factory(fn):
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _map_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = fn.__name__
        factory.__doc__ = fn.__doc__
        return factory

    def device(self, *args, **kwargs):  # noqa: D102 - torch.device("cuda") -> cpu
        return _map_device(torch.device(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(torch, name)


_SHIM: Optional[_CudaOnCpu] = None
_TORCH_VIEW: Optional[_TorchOnCpu] = None


def torch_view() -> _TorchOnCpu:
    global _SHIM, _TORCH_VIEW
    if _TORCH_VIEW is None:
        _SHIM = _make_cuda_shim()
        _TORCH_VIEW = _TorchOnCpu(_SHIM)
    return _TORCH_VIEW
