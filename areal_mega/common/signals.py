"""SIGTERM handling that does not depend on what the main thread is doing.

A Python signal handler runs only in the main thread, between bytecodes. A process whose main
thread is stuck (a C call that does not return, a lock, a deadlock inside the handler itself:
``threading.Event.set`` takes the lock that ``Event.wait`` may hold at that moment) never runs
it, and its supervisor has to SIGKILL it after the grace period, flushing nothing.

:class:`TermWatchdog` hears the signal through :func:`signal.set_wakeup_fd`: the C-level handler
writes the signal number to a pipe from whichever thread the kernel picked, and a watchdog
thread reading that pipe acts at once. It calls ``on_term`` (set a stop event, from a normal
thread) and, when the process has not ended ``exit_after_s`` later, dumps every thread's stack to
stderr (so the next report says where it hung) and ends the process with ``os._exit``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
from typing import Callable, Optional


class TermWatchdog:
    """Install with :meth:`install` from the main thread, before the process starts its work.

    ``on_term()`` runs on the watchdog thread when SIGTERM (or SIGINT) arrives; ``exit_after_s``
    (settable later, e.g. once the config is read) bounds the time from the signal to the
    process's end, exit code ``128 + signum``. The Python-level handler installed here does
    nothing: the watchdog thread does the work, so no code runs inside the signal handler."""

    def __init__(
        self,
        on_term: Optional[Callable[[], None]] = None,
        exit_after_s: float = 9.0,
        signals=(signal.SIGTERM,),
    ):
        self.on_term = on_term
        self.exit_after_s = exit_after_s
        self.signals = tuple(signals)
        self.received: Optional[int] = None
        self._read_fd = self._write_fd = -1

    def install(self) -> "TermWatchdog":
        """Route ``signals`` to the watchdog thread; call once, from the main thread."""
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in self.signals:
            signal.signal(sig, _ignore_in_main_thread)
        # At shutdown CPython puts a Python-level handler back to SIG_DFL, so a second SIGTERM
        # (a launcher signals the process group and the pid) arriving while a cleanly stopping
        # process finalizes would kill it (exit -15, read as a failure). SIG_IGN is kept.
        atexit.register(_ignore_during_shutdown, self.signals)
        threading.Thread(target=self._watch, name="term-watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            data = os.read(self._read_fd, 64)
            hits = [b for b in data if b in self.signals]
            if hits:
                break
        self.received = hits[0]
        if self.on_term is not None:
            try:
                self.on_term()
            except Exception as e:  # noqa: BLE001 - the hard exit below still comes
                print(f"term-watchdog: on_term failed: {e!r}", file=sys.stderr, flush=True)
        threading.Event().wait(self.exit_after_s)
        print(
            f"term-watchdog: the process did not stop {self.exit_after_s:.1f}s after signal "
            f"{self.received}; its threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(128 + self.received)


def _ignore_in_main_thread(signum, frame) -> None:
    """The watchdog thread acts on the signal (it read it from the wakeup pipe)."""


def _ignore_during_shutdown(signals) -> None:
    """The watched signals ignored from the first exit handler on (main thread, at exit)."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
