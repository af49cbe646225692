"""The three GEMMs of megatron's tensor-parallel linear layers on CPU, through oneDNN.

torch's fp32 ``matmul`` on CPU calls MKL's sgemm. On AMD CPUs MKL does not take its AVX-512
paths: on the 2-core EPYC these tests run on it reaches ~210 GFLOP/s on the 135M model's
shapes (M = 2,048 tokens), where oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``,
dense weights, no prepacking) reaches ~470 for the forward and the input gradient and ~350
for the weight gradient. With MKL the linear layers were over 80% of a forward+backward pass
(bench/engine.py; with the Adam update of a GRPO step, bench/grpo_step.py, about 40% after this), so
:mod:`areal_mega.compat.megatron_cpu` rewrites the three products in
``LinearWithGradAccumulationAndAsyncCommunication`` (and ``LinearWithFrozenWeight``) to call
these functions. Each computes exactly the expression it replaces (fp32 accumulation, a
different summation order) and falls back to that expression for other dtypes, empty inputs
or a torch without oneDNN. A bf16 product on a CPU without bf16 GEMMs is computed in fp32
from the widened operands and rounded to bf16 once (:mod:`areal_mega.common.cpu_bf16`: torch's
own bf16 product there is a scalar loop, 10-70x slower than the fp32 GEMM).

Environment switch ``AREAL_MEGA_CPU_GEMM`` (read once, at import): ``onednn`` (the default)
routes the products as above; ``torch`` keeps torch's own ``matmul`` (MKL) everywhere, e.g.
to A/B the two (``bench/grpo_step.py --gemm``). Any other value raises ``ValueError``.
"""

from __future__ import annotations

import torch

from areal_mega.common.cpu_bf16 import bf16_in_fp32
from areal_mega.common.env_switch import env_choice

GEMM_ENV = "AREAL_MEGA_CPU_GEMM"
GEMM_CHOICES = ("onednn", "torch")


def _onednn_ok(*ts: torch.Tensor) -> bool:
    return _AVAILABLE and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() > 0 for t in ts
    )


def _available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


_AVAILABLE = env_choice(GEMM_ENV, GEMM_CHOICES, "onednn") == "onednn" and _available()


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[..., K]`` and ``w`` ``[N, K]``; a 2-D ``x`` or ``w`` may be a
    transposed view (oneDNN reads either layout; copying the transpose costs more)."""
    if x.dim() == 2:
        if x.stride(-1) != 1 and x.stride(0) != 1:
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    # oneDNN returns a view for N-D inputs; megatron's cross entropy writes into the logits in
    # place, which autograd forbids on a custom Function's view output, so compute in 2-D and
    # reshape without creating a view (as torch.matmul does)
    y = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]).contiguous(), w, None, "none", [], ""
    )
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], w.shape[0]))


#: Products of more bytes than glibc's mmap ceiling (:mod:`areal_mega.common.malloc`) are
#: written into a reused buffer (:class:`ReusedOutput`).
REUSE_MIN_BYTES = 32 << 20


class ReusedOutput:
    """One buffer for the forward products too large for the heap (the output layer's logits:
    ``[tokens, vocab]``, 43 MB in bf16 at 439 tokens of the 135M model). A fresh tensor of
    that size is a new mapping whose pages all fault in as the product writes them: on a
    2-core Intel Xeon with AMX (1 thread) the tied output layer's bf16 forward at 439 tokens
    takes 43 ms into a new tensor, 22 ms into a written one. :meth:`take` hands the buffer out
    again only once no tensor uses its storage (a saved activation, a view, the logits still
    read by the loss all count), else a new tensor, so nothing is ever overwritten while in
    use; the buffer grows to the largest product asked for and stays for the process."""

    def __init__(self) -> None:
        self._base: torch.Tensor | None = None

    def _free(self) -> bool:
        use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: never reuse without
        # the base tensor's own reference and the temporary storage object's: nobody else
        return use_count is not None and use_count(self._base.untyped_storage()._cdata) <= 2

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` on the CPU, not a view: on the
        buffer's storage when no other tensor uses it, else newly allocated."""
        numel = 1
        for n in shape:
            numel *= n
        base = self._base
        if base is not None and base.dtype == dtype and base.numel() >= numel and self._free():
            out = torch.empty(0, dtype=dtype)
            return out.set_(base.untyped_storage(), 0, shape)
        out = torch.empty(shape, dtype=dtype)
        if base is None or self._free():
            # a tensor of its own on the same storage (the one handed out counts as a user)
            self._base = out.detach()
        return out


_REUSED = ReusedOutput()


#: The largest fp32 temporary (a block of the weight or of the product) of a bf16 product
#: computed in fp32 (:func:`areal_mega.common.cpu_bf16.bf16_in_fp32`): it comes from the heap
#: and stays in cache, where the output layer's whole widened weight (113 MiB in the 135M
#: model) or fp32 logits would be fresh mappings faulting in page by page.
WIDEN_BLOCK_BYTES = 8 << 20


def _block_rows(rows: int, width: int) -> int:
    """Rows of the weight per block of a widened product whose widest operand is ``width``."""
    return min(rows, max(1, WIDEN_BLOCK_BYTES // (4 * max(width, 1))))


def _widened_linear(total_input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear` of bf16 operands computed in fp32, by blocks of the weight's rows, each
    block's product rounded to bf16 once."""
    x = total_input.reshape(-1, total_input.shape[-1]).float()
    (m, k), n = x.shape, weight.shape[0]
    rows = _block_rows(n, max(m, k))
    if rows == n:
        out = linear(x, weight.float()).to(torch.bfloat16)
    else:
        out = (
            _REUSED.take((m, n), torch.bfloat16)
            if m * n * 2 >= REUSE_MIN_BYTES
            else torch.empty((m, n), dtype=torch.bfloat16)
        )
        for start in range(0, n, rows):
            out[:, start : start + rows] = linear(x, weight[start : start + rows].float())
    return torch.ops.aten._unsafe_view(out, (*total_input.shape[:-1], n))


def _widened_grad_input(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`grad_input` of bf16 operands computed in fp32, summed over blocks of the
    weight's rows, rounded to bf16 once."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    (m, n), k = g.shape, weight.shape[1]
    rows = _block_rows(n, max(m, k))
    acc = None
    for start in range(0, n, rows):
        part = grad_input(g[:, start : start + rows].float(), weight[start : start + rows].float())
        acc = part if acc is None else acc.add_(part)
    return torch.ops.aten._unsafe_view(acc.to(torch.bfloat16), (*grad_output.shape[:-1], k))


def linear(total_input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(total_input, weight.t())`` (the forward product). A bf16 product of at
    least :data:`REUSE_MIN_BYTES` is written into a reused buffer (:class:`ReusedOutput`)."""
    if _onednn_ok(total_input, weight):
        return _mm(total_input, weight)
    if bf16_in_fp32(total_input, weight):
        return _widened_linear(total_input, weight)
    if (
        total_input.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and total_input.device.type == "cpu"
        and total_input.numel() // max(total_input.shape[-1], 1) * weight.shape[0] * 2
        >= REUSE_MIN_BYTES
    ):
        x = total_input.reshape(-1, total_input.shape[-1])
        out = _REUSED.take((x.shape[0], weight.shape[0]), total_input.dtype)
        torch.mm(x, weight.t(), out=out)
        return torch.ops.aten._unsafe_view(out, (*total_input.shape[:-1], weight.shape[0]))
    return torch.matmul(total_input, weight.t())


def grad_input(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_output.matmul(weight)`` (the input gradient)."""
    if _onednn_ok(grad_output, weight):
        return _mm(grad_output, weight.t())
    if bf16_in_fp32(grad_output, weight):
        return _widened_grad_input(grad_output, weight)
    return grad_output.matmul(weight)


def grad_weight(grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    """``grad_output.t().matmul(total_input)`` for 2-D ``[tokens, N]`` / ``[tokens, K]``
    (the weight gradient)."""
    if grad_output.dim() == 2 and total_input.dim() == 2 and _onednn_ok(grad_output, total_input):
        return _mm(grad_output.t(), total_input.t())
    if bf16_in_fp32(grad_output, total_input):
        return grad_weight(grad_output.float(), total_input.float()).to(torch.bfloat16)
    return grad_output.t().matmul(total_input)
