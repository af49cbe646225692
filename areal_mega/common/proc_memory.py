"""Memory of this process from ``/proc/self/status``: a field (peak RSS, ``VmHWM``), and the peak
anonymous memory over a block (:class:`AnonPeak`).

The kernel's peak RSS (``VmHWM``) counts file-backed pages too. megatron-core 0.19 writes a
distributed checkpoint from threads of the saving process (0.16 wrote from child processes),
so saving tensors that are memory-mapped from files (the converter's staged tensors) makes
their clean page-cache pages resident in *this* process: RSS grows by the model size although
no memory is allocated. ``RssAnon`` (anonymous pages: heap and tensor buffers) is what a
conversion actually holds; the kernel keeps no peak of it, so a thread samples it.
"""

from __future__ import annotations

import threading
from typing import Optional

__all__ = ["proc_status_bytes", "anon_rss_bytes", "AnonPeak"]


def proc_status_bytes(field: str) -> Optional[int]:
    """A kB field of ``/proc/self/status`` (e.g. ``"RssAnon"``, ``"VmHWM"``) in bytes; None
    where /proc has no such field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def anon_rss_bytes() -> Optional[int]:
    """Current ``RssAnon`` of this process in bytes (None where /proc has no such field)."""
    return proc_status_bytes("RssAnon")


class AnonPeak:
    """``with AnonPeak() as p: ...`` then ``p.baseline`` / ``p.peak`` (bytes; None without
    ``RssAnon``). Sampled every ``interval`` seconds: an allocation shorter than that can be
    missed, one held across tensors cannot."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.baseline: Optional[int] = None
        self.peak: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        v = anon_rss_bytes()
        if v is not None:
            self.peak = v if self.peak is None else max(self.peak, v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "AnonPeak":
        self.baseline = anon_rss_bytes()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="anon-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
