"""Packed-sequence kernels: label log-probabilities (vocab-parallel) and GAE.

Public API (see ``docs/design.md``, "Kernel API"):

* :func:`packed_logprobs` -- ``log_softmax(logits / T)[label]`` (+ entropy) without a float32
  ``[T, V]`` copy; under tensor parallelism only per-token statistics are all-reduced.
* :func:`packed_gae` -- GAE over packed sequences with bootstrap values and loss masks.
* :func:`packed_logprobs_from_hidden` -- forward-only fused LM-head + logprobs, chunked over
  tokens and vocabulary (reference / proximal-policy passes).

Each dispatches to the CUDA kernels, the C++ CPU kernels or the pure-torch reference backend;
see :mod:`areal_mega.ops._backend` for the ``AREAL_MEGA_OPS_BACKEND`` switch. When a native
module is missing, the first call on that device prints a banner on stderr and issues a
:class:`KernelFallbackWarning` naming the build command (once per process).

Modules: :mod:`.logprob` (``packed_logprobs``), :mod:`.gae` (``packed_gae``), :mod:`.fused`
(``packed_logprobs_from_hidden``), :mod:`.decode` (the CPU rollout server's decode-step
kernels), :mod:`.reference` (the pure-torch references), :mod:`._backend` (locating the
compiled kernels, choosing a backend per call).
"""

from ._backend import KernelFallbackWarning, cpu_available, cuda_available
from .fused import packed_logprobs_from_hidden
from .gae import packed_gae
from .logprob import logits_read_by_loss_only, packed_logprobs

__all__ = [
    "packed_logprobs",
    "logits_read_by_loss_only",
    "packed_gae",
    "packed_logprobs_from_hidden",
    "cpu_available",
    "cuda_available",
    "KernelFallbackWarning",
]
