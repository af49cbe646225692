"""Process-wide event counters of the rollout side that no object owns: sandbox kills and
timeouts (reward functions), OpenAI gateway sessions. ``bump`` from any thread;
:class:`areal_mega.rollout.counts.CountCarrier` reads :func:`snapshot` when the rollout worker
delivers a group, so the counts reach the trainer's metrics rows."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter = Counter()


def bump(name: str, n: int = 1) -> None:
    """Add ``n`` to the counter ``name`` (e.g. ``sandbox/timeouts``)."""
    with _lock:
        _counts[name] += n


def snapshot() -> dict:
    """Every counter's value so far in this process."""
    with _lock:
        return dict(_counts)
