"""Reward functions that may hang run in a few long-lived worker processes with a hard
timeout: :class:`TimeoutWorkerPool` (a worker that overruns is killed and replaced) and the
process-wide pool that :func:`~areal_mega.rewards.math_answer.math_reward` uses."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from typing import Optional

from areal_mega.common.loading import load_object


def _worker_main(conn) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn_path, args = msg
        try:
            conn.send(("ok", load_object(fn_path, "reward worker function")(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            conn.send(("error", f"{type(e).__name__}: {e}"))


class TimeoutWorkerPool:
    """A few long-lived ``spawn`` worker processes that run module-level functions (by dotted
    path) with a hard timeout; a worker that overruns is killed and replaced. Thread-safe."""

    def __init__(self, n_workers: int = 2):
        self.n_workers = n_workers
        self._ctx = mp.get_context("spawn")
        self._free: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self.timeouts = 0

    def _spawn(self):
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-worker")
        p.start()
        child.close()
        return p, parent

    def _acquire(self):
        with self._lock:
            if self._free.empty() and self._started < self.n_workers:
                self._started += 1
                return self._spawn()
        return self._free.get()

    def call(self, fn_path: str, args: tuple, timeout_s: float):
        """Run ``fn(*args)`` in a worker; raises ``TimeoutError`` or ``RuntimeError``."""
        proc, conn = self._acquire()
        timed_out, died = False, None
        try:
            conn.send((fn_path, args))
            if conn.poll(timeout_s):
                status, value = conn.recv()
            else:
                timed_out = True
        except (EOFError, OSError) as e:
            died = e
        if timed_out or died is not None:
            proc.kill()
            proc.join(5)
            conn.close()
            proc, conn = self._spawn()
        self._free.put((proc, conn))
        if timed_out:
            self.timeouts += 1
            raise TimeoutError(f"{fn_path} timed out after {timeout_s}s")
        if died is not None:
            raise RuntimeError(f"{fn_path}: worker died: {died}")
        if status != "ok":
            raise RuntimeError(f"{fn_path}: {value}")
        return value

    def close(self) -> None:
        """Stop every worker."""
        while not self._free.empty():
            proc, conn = self._free.get()
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self._started = 0


_POOL: Optional[TimeoutWorkerPool] = None
_POOL_LOCK = threading.Lock()


def shared_pool() -> TimeoutWorkerPool:
    """The process-wide pool (two workers, started on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = TimeoutWorkerPool(n_workers=2)
        return _POOL


def shutdown_reward_workers() -> None:
    """Stop the shared math-verify worker processes (they also die with this process)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None
