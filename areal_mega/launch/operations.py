"""Mutating scale commands as operations: run one at a time on a thread of their own, each
with its own deadline, while their state can be read at any moment.

``launch.local``'s control socket answers one request at a time; an ``add`` that waits for a
server to boot, or a ``remove --drain`` that waits for requests to finish, must not hold it.
:class:`OperationQueue` takes such a command, answers at once with an operation id, and runs
the commands in the order they came (serialised); ``launch.scale`` polls the id until the
operation ends. :meth:`OperationQueue.active` lists the queued and running ones with how long
they have taken, for ``--list``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger(__name__)


class OperationTimeout(RuntimeError):
    """An operation ran past its own deadline."""


@dataclass
class Operation:
    """One mutating command. ``state``: ``queued``, then what it waits for (``starting
    rollout3``, ``joining rollout3``, ``draining rollout1``, ...), then ``done`` / ``failed``."""

    op: str
    cmd: str
    target: str
    timeout_s: float
    state: str = "queued"
    submitted: float = field(default_factory=time.monotonic)
    started: Optional[float] = None
    ended: Optional[float] = None
    result: Optional[dict] = None
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        """Whether it ended (done or failed)."""
        return self.ended is not None

    def remaining(self) -> float:
        """Seconds left before its deadline (counted from its start; the full timeout while
        queued)."""
        if self.started is None:
            return self.timeout_s
        return self.timeout_s - (time.monotonic() - self.started)

    def check(self, what: str) -> float:
        """The seconds left; :class:`OperationTimeout` naming ``what`` once none are."""
        left = self.remaining()
        if left <= 0:
            raise OperationTimeout(
                f"{what} did not finish within the operation's "
                f"{self.timeout_s:.0f} s (launch.scale --timeout)"
            )
        return left

    def view(self) -> dict:
        """What ``launch.scale`` shows: id, command, target, state, seconds so far (or in
        all), and the result or error once ended."""
        now = self.ended or time.monotonic()
        out = {
            "op": self.op,
            "cmd": self.cmd,
            "target": self.target,
            "state": self.state,
            "seconds": round(now - self.submitted, 2),
        }
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


class OperationQueue:
    """Runs submitted operations one at a time on a daemon thread, oldest first; keeps the
    last ``keep`` finished ones to answer late polls."""

    def __init__(self, keep: int = 64):
        self._queue: queue.Queue = queue.Queue()
        self._ops: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _ops, held for dict updates only
        self._keep = keep
        self._count = 0
        self._thread = threading.Thread(target=self._work, name="scale-operations", daemon=True)
        self._thread.start()

    def submit(
        self, cmd: str, target: str, fn: Callable[[Operation], dict], timeout_s: float
    ) -> Operation:
        """Queue ``fn(op)`` (it returns the result dict; an exception fails the operation
        with its message) and return the operation at once."""
        with self._lock:
            self._count += 1
            op = Operation(f"op{self._count}", cmd, target, float(timeout_s))
            self._ops[op.op] = op
        self._queue.put((op, fn))
        return op

    def get(self, op_id: str) -> Optional[Operation]:
        """The operation ``op_id``, or None when unknown (or long forgotten)."""
        with self._lock:
            return self._ops.get(op_id)

    def active(self) -> list:
        """Views of the queued and running operations, oldest first."""
        with self._lock:
            return [op.view() for op in self._ops.values() if not op.finished]

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, fn = item
            op.started, op.state = time.monotonic(), "running"
            try:
                op.result = fn(op) or {}
                op.state = "done"
            except Exception as e:  # noqa: BLE001 - reported to whoever polls the operation
                op.error = (
                    str(e)
                    if isinstance(e, (ValueError, OperationTimeout))
                    else f"{type(e).__name__}: {e}"
                )
                op.state = "failed"
                log.warning("%s %s failed: %s", op.cmd, op.target, op.error)
            op.ended = time.monotonic()
            with self._lock:
                done = [k for k, o in self._ops.items() if o.finished]
                for k in done[: max(0, len(done) - self._keep)]:
                    del self._ops[k]

    def close(self) -> None:
        """Stop taking operations (the running one, if any, is left to finish)."""
        self._queue.put(None)
