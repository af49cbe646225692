"""Start CPU rollout servers (``areal_mega.inference.server``) as subprocesses.

:func:`launch_local_servers` starts CPU servers and returns handles that kill their process
(and only it) on :meth:`LocalServerProcess.stop`. SGLang's command line (GPU) is
:func:`areal_mega.backends.sglang.build_sglang_command`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

from areal_mega.common.log_tail import last_error
from areal_mega.common.net import free_port, http_ready
from areal_mega.security import API_KEY_ENV, check_bind


class LocalServerProcess:
    """A running ``areal_mega.inference.server`` subprocess."""

    def __init__(
        self,
        model_path: str,
        port: Optional[int] = None,
        host: str = "127.0.0.1",
        api_key: Optional[str] = None,
        num_threads: int = 1,
        max_running: int = 64,
        log_path: Optional[str] = None,
        extra_args: Optional[list] = None,
    ):
        """``extra_args``: more command-line flags of the server (e.g. ``--idle-timeout``).
        A ``host`` other than loopback needs ``api_key`` (ConfigError)."""
        check_bind(
            host,
            authenticated=bool(api_key),
            what=f"local rollout server host {host}",
            fix="pass api_key",
        )
        self.host, self.api_key, self._auto_port = host, api_key, port is None
        self._args = [str(model_path), num_threads, max_running, [str(a) for a in extra_args or ()]]
        # without a log file the output still goes somewhere: the error of a failed start
        self._log_path = log_path
        self._log = open(log_path, "ab") if log_path else tempfile.TemporaryFile()
        self._start(port or free_port(host))

    def _start(self, port: int) -> None:
        model_path, num_threads, max_running, extra_args = self._args
        self.port, self.addr = port, f"{self.host}:{port}"
        cmd = [
            sys.executable,
            "-m",
            "areal_mega.inference.server",
            "--model-path",
            model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--num-threads",
            str(num_threads),
            "--max-running-requests",
            str(max_running),
            *extra_args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(num_threads), TOKENIZERS_PARALLELISM="false")
        if self.api_key:
            env[API_KEY_ENV] = self.api_key  # not on the command line (ps)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=self._log)
        self._healthy = http_ready(
            f"http://{self.addr}/health", timeout=2, api_key=self.api_key, healthy=True
        )

    def wait_ready(self, timeout: float = 120.0) -> "LocalServerProcess":
        """Block until ``GET /health`` answers 200; raise if the process died (with the last
        error of its output) or timed out. A port this handle chose that another process took
        in the meantime is replaced by a fresh one (up to 3 times)."""
        deadline = time.monotonic() + timeout
        retries = 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                error = last_error(self._log_path or self._log)
                if self._auto_port and retries and "address already in use" in error.lower():
                    retries -= 1
                    self._start(free_port(self.host))
                    continue
                raise RuntimeError(
                    f"local rollout server on {self.addr} exited with code "
                    f"{self.proc.returncode}{error}"
                )
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"local rollout server on {self.addr} not ready after {timeout}s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()


def launch_local_servers(
    model_path: str, n: int = 1, api_key: Optional[str] = None, timeout: float = 120.0, **kw
) -> list:
    """Start ``n`` CPU rollout servers on free loopback ports and wait until all are ready."""
    procs = [LocalServerProcess(model_path, api_key=api_key, **kw) for _ in range(n)]
    try:
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs
