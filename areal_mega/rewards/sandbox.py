"""Run untrusted Python against test cases in a sandboxed subprocess (for code rewards).

    result = default_sandbox().run(code, {"inputs": [...], "outputs": [...]}, timeout_s=4)
    result.passed, result.total, result.isolation

Each evaluation gets a private temporary working directory and one
``python -I -S sandbox_runner.py`` process (standard library only, no site-packages; see
:mod:`areal_mega.rewards.sandbox_runner` for what happens inside: namespaces, read-only
mounts, resource limits, one forked child per test). Out here: at most ``max_parallel``
evaluations run at once (callers beyond that wait for a slot, in their own thread — reward
functions run off the event loop); each slot has its own unprivileged uid when this process is
root, so one slot's fork bomb cannot use up another slot's process budget; the whole process
group is killed at the wall deadline (``timeout_s`` per test plus a start-up allowance), and
the tests passed before it still count. Nothing here raises on bad code: a crash, a timeout or
a missing result is a failed test.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_mega.common import counters

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("sandbox_runner.py")
STARTUP_ALLOWANCE_S = 2.0  # interpreter start + namespace setup, added to the wall deadline
SLOT_UID_BASE = 61000  # slot k runs as uid/gid SLOT_UID_BASE + k when we are root


@dataclass
class SandboxResult:
    """What one evaluation did: tests passed of total, and how it was isolated."""

    passed: int
    total: int
    timed_out: bool = False
    error: Optional[str] = None
    isolation: dict = field(default_factory=dict)
    test_seconds: list = field(default_factory=list)  # per finished test: fork to reaping

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class CodeSandbox:
    """Bounded-concurrency sandboxed test runner (thread-safe; one per process is enough)."""

    def __init__(
        self, max_parallel: int = 4, tmp_root: Optional[str] = None, namespaces: bool = True
    ):
        """``namespaces=False`` skips the namespaces and read-only mounts (resource limits
        and the slot uid only), e.g. where a kernel's namespaces misbehave; it is logged."""
        if max_parallel < 1:
            raise ValueError(f"max_parallel={max_parallel}: must be >= 1")
        self.max_parallel = max_parallel
        self.tmp_root = tmp_root
        self.namespaces = namespaces
        self._slots: "queue.Queue[int]" = queue.Queue()
        for k in range(max_parallel):
            self._slots.put(k)
        self._warned = False
        self._lock = threading.Lock()
        self.running = 0
        self.peak_running = 0

    def _note_isolation(self, info: dict) -> None:
        missing = [k for k in ("netns", "pidns", "readonly") if not info.get(k)]
        if missing and not self._warned:
            self._warned = True
            log.warning(
                "code sandbox: running without %s (%s); the code still runs under "
                "resource limits%s",
                ", ".join(missing),
                "; ".join(info.get("why", [])),
                ", but network access is NOT blocked" if "netns" in missing else "",
            )

    def run(
        self,
        code: str,
        tests: dict,
        *,
        timeout_s: float = 4.0,
        memory_mb: int = 1024,
        max_procs: int = 32,
        max_file_mb: int = 32,
        stop_at_first_failure: bool = False,
    ) -> SandboxResult:
        """Run ``code`` on ``tests`` (``inputs``, ``outputs``, optional ``fn_name``).

        ``timeout_s``: wall and CPU limit per test; ``memory_mb``: address-space limit;
        ``max_procs``: process-count limit; ``max_file_mb``: largest file it may write."""
        inputs, outputs = tests["inputs"], tests["outputs"]
        total = len(inputs)
        slot = self._slots.get()
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        workdir = tempfile.mkdtemp(prefix="areal-sandbox-", dir=self.tmp_root)
        try:
            job = {
                "inputs": inputs,
                "outputs": outputs,
                "fn_name": tests.get("fn_name"),
                "timeout_s": float(timeout_s),
                "memory_mb": int(memory_mb),
                "max_procs": int(max_procs),
                "max_file_mb": int(max_file_mb),
                "uid": SLOT_UID_BASE + slot,
                "stop_at_first_failure": stop_at_first_failure,
                "namespaces": self.namespaces,
            }
            Path(workdir, "job.json").write_text(json.dumps(job))
            Path(workdir, "solution.py").write_text(code)
            if os.geteuid() == 0:
                for p in (workdir, *(os.path.join(workdir, n) for n in os.listdir(workdir))):
                    os.chown(p, job["uid"], job["uid"])
            return self._execute(workdir, job, total)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            with self._lock:
                self.running -= 1
            self._slots.put(slot)

    def _execute(self, workdir: str, job: dict, total: int) -> SandboxResult:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        # -S: the standard library only (no site-packages); halves the start-up time
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(RUNNER), workdir],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=job["timeout_s"] * total + STARTUP_ALLOWANCE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            counters.bump("sandbox/timeouts")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                counters.bump("sandbox/kills")
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
        result = SandboxResult(0, total, timed_out=timed_out)
        passed = set()
        for line in out.decode("utf-8", "replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if "isolation" in rec:
                result.isolation = rec["isolation"]
                self._note_isolation(result.isolation)
            elif "error" in rec:
                result.error = str(rec["error"])
            elif isinstance(rec.get("i"), int):
                result.test_seconds.append(float(rec.get("s", 0.0)))
                if rec.get("t"):
                    counters.bump("sandbox/test_timeouts")  # reach the metrics rows
                if rec.get("k"):
                    counters.bump("sandbox/test_kills")
                if rec.get("ok") is True:
                    passed.add(rec["i"])
        result.passed = len(passed & set(range(total)))
        return result


_DEFAULT: Optional[CodeSandbox] = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> CodeSandbox:
    """The process-wide sandbox; ``AREAL_SANDBOX_PARALLEL`` sets its slots (default: the CPU
    count, at most 8)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            n = int(os.environ.get("AREAL_SANDBOX_PARALLEL", min(8, os.cpu_count() or 1)))
            _DEFAULT = CodeSandbox(max_parallel=max(1, n))
        return _DEFAULT
