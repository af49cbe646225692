"""A bf16 gradient added into its fp32 main gradient in cache-sized pieces.

megatron-core's DDP adds each parameter's gradient into its main gradient after the backward
pass (``param.main_grad.add_(param.grad.data)``). With bf16 parameters the gradient is bf16
and the main gradient fp32, so torch first casts the whole gradient into a new fp32 tensor.
For the tied embedding of the 135M model (``[49,152, 576]``) that temporary is 113 MiB. That
is above glibc's 32 MiB mmap ceiling, so it is a mapping of its own whose pages fault in every
time (:mod:`areal_mega.common.malloc`), and it misses every cache.

On a 2-core AMD EPYC (AVX-512, 1 thread, the trainer's malloc policy) the add takes 68 ms this
way and 11 ms in pieces of 2^20 elements, whose 4 MiB temporary stays in cache.

:func:`accumulate` is that add. Tensors of the same dtype, and small ones, go through
``add_`` in one call. :mod:`areal_mega.compat.megatron_cpu` makes megatron's hook call it on
CPU.
"""

from __future__ import annotations

import torch

__all__ = ["accumulate", "PIECE", "MIN_SPLIT"]

#: Elements per piece of a split add (4 MiB of fp32).
PIECE = 1 << 20
#: Tensors of fewer elements are added in one call.
MIN_SPLIT = 4 * PIECE


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad.add_(grad)``, in pieces of :data:`PIECE` elements when the dtypes differ,
    both are contiguous and of the same shape, and there are at least :data:`MIN_SPLIT`
    elements (the same values either way)."""
    if (
        grad.dtype == main_grad.dtype
        or main_grad.numel() < MIN_SPLIT
        or grad.shape != main_grad.shape
        or not (main_grad.is_contiguous() and grad.is_contiguous())
    ):
        main_grad.add_(grad)
        return
    dst, src = main_grad.view(-1), grad.view(-1)
    for start in range(0, dst.numel(), PIECE):
        dst[start : start + PIECE].add_(src[start : start + PIECE])
