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

from areal_mega.compat import cpu_gemm

__all__ = ["accumulate", "accumulate_weight_grad", "weight_grad", "PIECE", "MIN_SPLIT"]

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


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> None:
    """``main_grad += grad_output.t() @ total_input`` for 2-D ``[tokens, N]`` / ``[tokens, K]``
    and a contiguous ``[N, K]`` ``main_grad``. Of another dtype than ``main_grad``: the product
    in that dtype, :data:`PIECE` elements of rows at a time, each added in ``main_grad``'s."""
    if grad_output.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    rows = max(1, PIECE // main_grad.shape[1])
    for start in range(0, main_grad.shape[0], rows):
        piece = cpu_gemm.grad_weight(grad_output[:, start : start + rows], total_input)
        main_grad[start : start + rows].add_(piece)


def weight_grad(
    grad_output: torch.Tensor, total_input: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor | None:
    """The weight gradient of a linear layer's backward (``grad_output.t() @ total_input``).
    For a weight with a contiguous ``main_grad`` of at least :data:`MIN_SPLIT` elements it is
    added there instead (:func:`accumulate_weight_grad`) and ``None`` is returned: autograd
    then hands DDP's hook no ``param.grad`` to add (megatron allows that while
    ``overlap_grad_reduce`` is off, as the engine keeps it). Else the product is returned."""
    main_grad = getattr(weight, "main_grad", None)
    if (
        main_grad is None
        or main_grad.numel() < MIN_SPLIT
        or grad_output.dim() != 2
        or total_input.dim() != 2
        or main_grad.shape != (grad_output.shape[1], total_input.shape[1])
        or not main_grad.is_contiguous()
    ):
        return cpu_gemm.grad_weight(grad_output, total_input)
    accumulate_weight_grad(main_grad, grad_output, total_input)
    return None
