"""Whether this CPU multiplies bf16 matrices at bf16 speed, and where it does not, that bf16
products are computed in fp32.

torch multiplies bf16 matrices on a CPU through oneDNN where oneDNN has bf16 GEMMs (AVX-512,
with AVX-512 BF16 or AMX where present; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``). On
other CPUs (AVX2 only: most laptops, AMD before Zen 4) it falls back to a scalar loop. On a
2-core AMD EPYC with AVX2 only (torch 2.13, 1 thread) a 1024^2 bf16 ``matmul`` ran at 0.8
GFLOP/s against fp32's 54, a ``[512, 576] x [576, 3,072]`` linear 8 against 66, and a GRPO
step of the 8-layer 135M shape took 100 s in bf16 against 5.8 in fp32.

There a bf16 product is computed the way a GPU's bf16 GEMM computes it, in fp32 from the bf16
operands, only by the fp32 GEMM: the operands are widened (exactly), multiplied in fp32, and
the result rounded once to bf16 (or summed into an fp32 main gradient). The model stays bf16
(parameters, activations, memory); only the products' arithmetic moves.

``AREAL_MEGA_CPU_BF16_GEMM`` (read at each call): ``auto`` (the default) computes bf16 products
in fp32 exactly where this CPU has no bf16 GEMMs; ``fp32`` does so on every CPU (a test of the
path on any machine); ``native`` never does (torch's bf16 product everywhere, to A/B the two).
"""

from __future__ import annotations

import torch

from .env_switch import env_choice

__all__ = [
    "BF16_GEMM_ENV",
    "BF16_GEMM_CHOICES",
    "has_bf16_gemm",
    "bf16_products_in_fp32",
    "bf16_in_fp32",
]

BF16_GEMM_ENV = "AREAL_MEGA_CPU_BF16_GEMM"
BF16_GEMM_CHOICES = ("auto", "fp32", "native")

_HAS: bool | None = None


def has_bf16_gemm() -> bool:
    """Whether torch's bf16 matrix products on this CPU go to oneDNN's bf16 GEMMs (probed
    once per process)."""
    global _HAS
    if _HAS is None:
        try:
            _HAS = bool(
                torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            )
        except (AttributeError, RuntimeError):
            _HAS = False
    return _HAS


def bf16_products_in_fp32() -> bool:
    """Whether bf16 matrix products on the CPU are computed in fp32 here (see the module
    docstring and ``AREAL_MEGA_CPU_BF16_GEMM``)."""
    choice = env_choice(BF16_GEMM_ENV, BF16_GEMM_CHOICES, "auto")
    if choice == "auto":
        return not has_bf16_gemm()
    return choice == "fp32"


def bf16_in_fp32(*ts: torch.Tensor) -> bool:
    """Whether the product of ``ts`` is a bf16 one on the CPU that is computed in fp32 here
    (:func:`bf16_products_in_fp32`)."""
    return (
        all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)
        and bf16_products_in_fp32()
    )
