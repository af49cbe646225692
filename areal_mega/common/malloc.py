"""glibc's malloc policy for large tensor buffers: returned to the system, or kept for reuse.

torch's CPU allocator takes every tensor buffer from ``malloc``. glibc serves a request above
its mmap threshold with a mapping of its own and unmaps it on ``free``. That threshold is
dynamic: it rises after the first large free, but never above 32 MiB on 64-bit systems. Every
larger buffer is then a fresh mapping whose pages fault in on first touch.

Two processes want opposite things:

- **release** (:func:`release_large_buffers`): a checkpoint conversion streams tensors one after
  another and wants each freed buffer back in the system, or its peak memory would be the sum
  of them. Every buffer of 1 MiB or more is a mapping of its own.
- **keep** (:func:`keep_freed_buffers`): a CPU training step allocates and frees the same large
  buffers every step. The tied embedding's gradient and the output layer's weight gradient are
  ``[vocab, hidden]``, 113 MiB in fp32 for the 135M model, and there are casts and optimizer
  temporaries of every parameter's size. Faulting their pages in again each step cost 13% of a
  bf16 GRPO step of the 135M shape with 8 layers on a 2-core AMD EPYC (AVX-512, 1 thread: 1.61
  s -> 1.40 s; peak RSS +0.2 GiB). No buffer is ever a mapping of its own. Freed memory at the
  heap's top goes back only beyond ``trim_threshold``.

The trainer sets its policy with :func:`set_training_policy` once its initial conversion is
done. It does so only on CPU: on a GPU the large buffers live in CUDA's caching allocator.
Environment switch ``AREAL_MEGA_MALLOC``: ``keep`` (the default), ``release`` or ``default``
(glibc's own behaviour), e.g. to A/B them. Another value raises ``ValueError``.

The policy covers the whole process. It is a no-op, returning False, where the C library is not
glibc.
"""

from __future__ import annotations

import ctypes
import os

__all__ = [
    "POLICY_ENV",
    "POLICIES",
    "keep_freed_buffers",
    "release_large_buffers",
    "glibc_defaults",
    "set_policy",
    "training_policy",
    "set_training_policy",
]

POLICY_ENV = "AREAL_MEGA_MALLOC"
POLICIES = ("keep", "release", "default")

# mallopt's parameter numbers (malloc.h) and glibc's defaults on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_MAX = 65536


def _mallopt(*settings: tuple) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) == 1 for param, value in settings)
    except (OSError, AttributeError):  # not glibc
        return False


def keep_freed_buffers(trim_threshold: int = 1 << 30) -> bool:
    """Serve every allocation from the heap (no mapping of its own), so a freed buffer is
    reused by the next request without faulting its pages in again. Free memory at the heap's
    top is returned only beyond ``trim_threshold`` bytes. Returns whether glibc took it."""
    return _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, trim_threshold))


def release_large_buffers(threshold: int = 1 << 20) -> bool:
    """Give every allocation of ``threshold`` bytes or more a mapping of its own, returned to
    the system when freed (glibc's dynamic threshold stays pinned there). Undoes
    :func:`keep_freed_buffers`. Returns whether glibc took it."""
    return _mallopt(
        (_M_MMAP_MAX, _DEFAULT_MMAP_MAX),
        (_M_MMAP_THRESHOLD, threshold),
        (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD),
    )


def glibc_defaults() -> bool:
    """glibc's own thresholds, as at start-up. Setting them explicitly turns off its dynamic
    mmap threshold, which a fresh process has. Returns whether glibc took them."""
    return _mallopt(
        (_M_MMAP_MAX, _DEFAULT_MMAP_MAX),
        (_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD),
    )


def set_policy(policy: str) -> bool:
    """Apply one of :data:`POLICIES` by name. Returns whether glibc took it."""
    actions = {
        "keep": keep_freed_buffers,
        "release": release_large_buffers,
        "default": glibc_defaults,
    }
    if policy not in actions:
        raise ValueError(f"malloc policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return actions[policy]()


def training_policy() -> str:
    """The policy a CPU trainer runs under: ``$AREAL_MEGA_MALLOC``, ``keep`` when unset."""
    value = os.environ.get(POLICY_ENV, "").strip().lower() or "keep"
    if value not in POLICIES:
        raise ValueError(
            f"{POLICY_ENV}={os.environ[POLICY_ENV]!r}: expected one of {', '.join(POLICIES)}"
        )
    return value


def set_training_policy() -> str:
    """Apply :func:`training_policy` to this process; returns its name."""
    policy = training_policy()
    set_policy(policy)
    return policy
