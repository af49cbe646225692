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

A linear layer's bf16 weight gradient need not be a bf16 tensor at all: on a GPU megatron's
``gradient_accumulation_fusion`` has the weight-gradient GEMM accumulate into the fp32 main
gradient. :func:`weight_grad` does the same on a CPU with bf16 GEMMs (AVX-512 BF16 or AMX)
when the C++ kernels are built (``_ops_cpu.accumulate_weight_grad_bf16``: a bf16 x bf16 ->
fp32 GEMM with ``C += A.B``, :func:`fused_bf16_gemm` says whose): the product is summed in
fp32 straight into ``main_grad``, with no bf16 product (rounded to 8 bits of mantissa before
it was added), no fp32 cast of it and no second pass; the largest difference from the fp64
product 3e-5 where it was 0.25. On a 2-core Intel Xeon with AMX (1 thread), MKL's GEMM: a
GRPO step of the 8-layer 135M shape 1.17x at answers of 1-16 tokens, 1.09x at 1-128
(``bench/cpu_step_ab.py --change wgrad_fp32``, the former path restored in the same
process). On a CPU that computes bf16 products in fp32 (no bf16 GEMMs,
:mod:`areal_mega.common.cpu_bf16`) the product is an fp32 GEMM of the widened operands, summed
into ``main_grad`` piece by piece, never rounded to bf16. Elsewhere (fp32, kernels not built,
``AREAL_MEGA_OPS_BACKEND=torch``) the former path stays.
"""

from __future__ import annotations

import torch

from areal_mega.common import native
from areal_mega.common.cpu_bf16 import bf16_in_fp32, has_bf16_gemm
from areal_mega.common.env_switch import env_choice
from areal_mega.compat import cpu_gemm

__all__ = [
    "accumulate",
    "accumulate_weight_grad",
    "fused_bf16_available",
    "fused_bf16_gemm",
    "weight_grad",
    "PIECE",
    "MIN_SPLIT",
]

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
    and a contiguous ``[N, K]`` ``main_grad``. bf16 into fp32 where :func:`fused_bf16_available`:
    one GEMM summing in fp32 into ``main_grad``. bf16 on a CPU without bf16 GEMMs: fp32
    GEMMs of the widened operands summing into ``main_grad``, :data:`PIECE` elements of rows
    at a time (as an fp32 ``main_grad.addmm_``: on a 2-core AVX2 EPYC, 1 thread, the output
    layer's ``[49,152, 576]`` of 1,471 tokens 59 GFLOP/s, oneDNN's product and an add 50).
    Otherwise, of another dtype than
    ``main_grad``: the product in that dtype, :data:`PIECE` elements of rows at a time, each
    added in ``main_grad``'s."""
    if grad_output.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    rows = max(1, PIECE // main_grad.shape[1])
    if _widened(main_grad, grad_output, total_input):
        total_input = total_input.float()
        for start in range(0, main_grad.shape[0], rows):
            piece = grad_output[:, start : start + rows].float()
            main_grad[start : start + rows].addmm_(piece.t(), total_input)
        return
    if _fusable(main_grad, grad_output, total_input):
        native.load("_ops_cpu").accumulate_weight_grad_bf16(
            main_grad, grad_output, total_input, gemm=fused_bf16_gemm()
        )
        return
    for start in range(0, main_grad.shape[0], rows):
        piece = cpu_gemm.grad_weight(grad_output[:, start : start + rows], total_input)
        main_grad[start : start + rows].add_(piece)


def weight_grad(
    grad_output: torch.Tensor, total_input: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor | None:
    """The weight gradient of a linear layer's backward (``grad_output.t() @ total_input``).
    For a weight with a contiguous ``main_grad`` of at least :data:`MIN_SPLIT` elements, or of
    any size when the bf16 product can be summed in fp32 (:func:`fused_bf16_available`, or a
    CPU without bf16 GEMMs, which computes it in fp32), it is
    added there instead (:func:`accumulate_weight_grad`) and ``None`` is returned: autograd
    then hands DDP's hook no ``param.grad`` to add (megatron allows that while
    ``overlap_grad_reduce`` is off, as the engine keeps it). Else the product is returned."""
    main_grad = getattr(weight, "main_grad", None)
    if (
        main_grad is None
        or grad_output.dim() != 2
        or total_input.dim() != 2
        or main_grad.shape != (grad_output.shape[1], total_input.shape[1])
        or not main_grad.is_contiguous()
        or (
            main_grad.numel() < MIN_SPLIT
            and not _fusable(main_grad, grad_output, total_input)
            and not _widened(main_grad, grad_output, total_input)
        )
    ):
        return cpu_gemm.grad_weight(grad_output, total_input)
    accumulate_weight_grad(main_grad, grad_output, total_input)
    return None


def fused_bf16_available() -> bool:
    """Whether bf16 weight gradients can be summed in fp32 straight into their main gradient
    here: the C++ CPU kernels are built (and not set aside by ``AREAL_MEGA_OPS_BACKEND=torch``)
    and oneDNN has bf16 GEMMs on this CPU (AVX-512 BF16 or AMX; elsewhere torch's fallback GEMM
    for this call is a slow loop)."""
    global _FUSED
    if _FUSED is None:
        _FUSED = (
            has_bf16_gemm()
            and native.load("_ops_cpu") is not None
            and hasattr(native.load("_ops_cpu"), "accumulate_weight_grad_bf16")
        )
    return _FUSED and env_choice(native.OPS_BACKEND_ENV, native.OPS_BACKENDS, "auto") != "torch"


_FUSED = None


def fused_bf16_gemm() -> str:
    """The GEMM that sums bf16 weight gradients in fp32 (:func:`fused_bf16_available`):
    ``mkl`` (MKL's ``cblas_gemm_bf16bf16f32``, which reads the output gradient transposed in
    place) on a CPU with AMX whose torch carries it, else ``onednn`` (a transposed copy of the
    output gradient, then oneDNN's GEMM). MKL only where measured: on the AMX Xeon it is
    1.2-1.8x the oneDNN path (a layer's ``[3,072, 576]`` of 503 tokens 1.5 ms against 2.4;
    the output layer's ``[49,152, 576]`` of 439 tokens 61 against 92); on AMD CPUs MKL is
    known to skip its AVX-512 code."""
    global _GEMM
    if _GEMM is None:
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        ops = native.load("_ops_cpu")
        mkl = ops is not None and getattr(ops, "has_mkl_gemm_bf16", lambda: False)()
        _GEMM = "mkl" if amx and mkl else "onednn"
    return _GEMM


_GEMM = None


def _widened(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> bool:
    """Whether a bf16 weight gradient is computed in fp32 and summed into an fp32
    ``main_grad`` (a CPU without bf16 GEMMs, :func:`~areal_mega.common.cpu_bf16.bf16_in_fp32`)."""
    return main_grad.dtype == torch.float32 and bf16_in_fp32(grad_output, total_input)


def _fusable(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> bool:
    return (
        main_grad.dtype == torch.float32
        and grad_output.dtype == torch.bfloat16
        and total_input.dtype == torch.bfloat16
        and main_grad.device.type == "cpu"
        and fused_bf16_available()
    )
