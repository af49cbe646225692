"""Reward functions and the hook that loads one by dotted path.

Signature of every reward function: ``fn(prompt: str, completion: str, answer, **kw) -> float``.
``rollout.reward_fn`` names one as ``"package.module:function"`` (or ``package.module.function``).

:func:`math_reward` checks the last ``\\boxed{...}`` of the completion against the reference
answer with ``math-verify``. Parsing and verification run in a worker process with a hard
timeout: a pathological expression gets reward 0 and its worker is killed and replaced, so it can
never hang a rollout worker.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import queue
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)


def load_reward_fn(path: str) -> Callable:
    """Import ``"pkg.mod:fn"`` or ``"pkg.mod.fn"``; raises ``ValueError`` naming the problem."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"reward_fn={path!r}: expected 'package.module:function'")
    mod_name, _, fn_name = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not fn_name:
        raise ValueError(f"reward_fn={path!r}: expected 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward_fn={path!r}: cannot import {mod_name!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn={path!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def _verify_math(completion: str, answer: str, inner_timeout: int) -> float:
    """Runs in the worker process (main thread: math-verify's own signal timeouts work)."""
    from math_verify import parse, verify

    boxed = extract_boxed(completion)
    if boxed is None:
        return 0.0
    gold = parse(f"${answer}$" if "$" not in str(answer) else str(answer),
                 parsing_timeout=inner_timeout)
    pred = parse(f"$\\boxed{{{boxed}}}$", parsing_timeout=inner_timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=inner_timeout) else 0.0


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
            conn.send(("ok", load_reward_fn(fn_path)(*args)))
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
        p = self._ctx.Process(target=_worker_main, args=(child,), daemon=True,
                              name="reward-worker")
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


def _pool() -> TimeoutWorkerPool:
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


def math_reward(prompt: str, completion: str, answer, timeout_s: float = 10.0,
                **kw) -> float:
    """1.0 if the last ``\\boxed{}`` of ``completion`` equals ``answer`` (math-verify), else
    0.0; 0.0 on timeout (the worker is killed) or on any verifier error."""
    if completion is None or answer is None or "\\boxed" not in completion:
        return 0.0
    inner = max(1, int(timeout_s) - 1)
    try:
        return float(_pool().call("areal_mega.rollout.rewards:_verify_math",
                                  (completion, str(answer), inner), timeout_s))
    except (TimeoutError, RuntimeError) as e:
        log.warning("math_reward: %s", e)
        return 0.0


def exact_match_reward(prompt: str, completion: str, answer, **kw) -> float:
    """1.0 when the completion (trailing whitespace stripped) equals ``answer`` exactly and the
    sample ended with EOS (``finish_reason == "stop"`` when given), else 0.0."""
    if kw.get("finish_reason", "stop") != "stop":
        return 0.0
    return 1.0 if completion.rstrip() == str(answer).rstrip() else 0.0
