"""Real vLLM servers for the tests: tiny models vLLM's CPU kernels serve, and a server process
started with the command and environment launch.local uses.

The vLLM interpreter: :func:`tests.helpers.vllm_env.vllm_python` (skipped without one, except where
``make test`` runs them: there they fail).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from areal_mega.common.net import free_port
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "vllm-test-key"
# vLLM's CPU attention takes head sizes 32, 64, 80, ...: the tiny models use 64
TINY_VLLM = dict(
    arch="llama", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2
)


def make_vllm_models(base: Path, n: int = 2, **overrides) -> list:
    """``n`` tiny llama models of one shape with different weights (seeds 0..n-1);
    ``overrides`` change TINY_VLLM's shape (e.g. max_position_embeddings)."""
    return [make_tiny_model(base / f"m{i}", **{**TINY_VLLM, **overrides}, seed=i) for i in range(n)]


class VLLMServer:
    """One vLLM server process on ``model`` (its log in ``log_dir``); ``dev_mode=False``
    starts it without the dev-mode routes; ``max_model_len`` bounds prompt + generation."""

    def __init__(self, model: Path, log_dir: Path, dev_mode: bool = True, max_model_len: int = 512):
        from areal_mega.backends.vllm.launch import build_vllm_command, vllm_env

        self.port = free_port("127.0.0.1")
        self.addr = f"127.0.0.1:{self.port}"
        argv = build_vllm_command(
            vllm_python(),
            str(model),
            self.port,
            host="127.0.0.1",
            tp=1,
            dtype="fp32",
            max_model_len=max_model_len,
            seed=0,
            enforce_eager=True,
            served_model_name="tiny",
            extra=[],
        )
        env = dict(os.environ, **vllm_env(API_KEY, "cpu", 1.0, str(ROOT)))
        if not dev_mode:
            env.pop("VLLM_SERVER_DEV_MODE")
        self.log = Path(log_dir) / f"vllm-{self.port}.log"
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.ready_s = None

    def wait_ready(self, timeout: float = 400.0) -> "VLLMServer":
        """Wait for ``GET /health`` (200); fail with the log's tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.addr}/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"vLLM not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server's whole process group (the API server and its engine core)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
