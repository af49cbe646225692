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
import json
import logging
import multiprocessing as mp
import queue
import re
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


_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> Optional[str]:
    """The last fenced python block of ``completion`` (```python / ```py / ```python3, else
    the last unlabelled ``` block), or None."""
    blocks = _FENCE.findall(completion or "")
    labelled = [code for lang, code in blocks if lang]
    pool = labelled or [code for lang, code in blocks]
    return pool[-1] if pool else None


def parse_code_tests(answer) -> dict:
    """APPS/TACO tests from a dict or its JSON string: ``inputs``, ``outputs`` (equal-length
    lists), optional ``fn_name``; raises ``ValueError`` naming the problem."""
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"code tests: answer is not valid JSON ({e.msg})") from None
    if not isinstance(answer, dict):
        raise ValueError(f"code tests: expected a mapping, got {type(answer).__name__}")
    for key in ("inputs", "outputs"):
        if not isinstance(answer.get(key), list):
            raise ValueError(f"code tests: {key!r} must be a list")
    if len(answer["inputs"]) != len(answer["outputs"]) or not answer["inputs"]:
        raise ValueError(f"code tests: {len(answer['inputs'])} inputs but "
                         f"{len(answer['outputs'])} outputs (need equal, non-zero counts)")
    fn_name = answer.get("fn_name")
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError("code tests: 'fn_name' must be a string")
    return {"inputs": answer["inputs"], "outputs": answer["outputs"], "fn_name": fn_name}


def code_reward(prompt: str, completion: str, answer, *, timeout_s: float = 4.0,
                all_or_nothing: bool = False, memory_mb: int = 1024, max_procs: int = 32,
                max_file_mb: int = 32, **kw) -> float:
    """Run the completion's last fenced python block on the tests in ``answer`` (APPS/TACO
    convention, see :func:`parse_code_tests`) in the sandbox (:mod:`areal_mega.rollout.sandbox`).

    Returns the fraction of tests passed, or 1.0/0.0 with ``all_or_nothing`` (the run stops
    at the first failure). No code block, bad tests or a sandbox failure give 0.0, never an
    exception. ``timeout_s`` is the wall and CPU limit per test."""
    from areal_mega.rollout.sandbox import default_sandbox

    code = extract_code(completion)
    if code is None:
        return 0.0
    try:
        tests = parse_code_tests(answer)
        res = default_sandbox().run(code, tests, timeout_s=timeout_s, memory_mb=memory_mb,
                                    max_procs=max_procs, max_file_mb=max_file_mb,
                                    stop_at_first_failure=all_or_nothing)
    except (ValueError, TypeError, OSError) as e:   # bad tests or no process: score 0
        log.warning("code_reward: %s", e)
        return 0.0
    if all_or_nothing:
        return 1.0 if res.passed == res.total else 0.0
    return res.fraction


_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_LAST_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_gsm8k_answer(text: str) -> Optional[str]:
    """The number after the last ``####`` (GSM8K's answer marker), commas removed; when there
    is no marker, the last number in the text. None when there is no number."""
    found = _GSM8K_ANSWER.findall(text or "")
    if not found:
        found = _LAST_NUMBER.findall(text or "")
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value.rstrip(".") or None


def gsm8k_reward(prompt: str, completion: str, answer, **kw) -> float:
    """1.0 when the completion's final number (:func:`extract_gsm8k_answer`) equals the
    reference's (a GSM8K solution ending in ``#### 42``, or a bare number), else 0.0."""
    got = extract_gsm8k_answer(completion)
    want = extract_gsm8k_answer(str(answer))
    if got is None or want is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(want) else 0.0
    except ValueError:
        return 1.0 if got == want else 0.0
