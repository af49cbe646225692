"""Helpers shared by the rollout tests: tiny models, HTTP calls to a server, teacher-forced
logprobs, a collecting group sink (the ``models`` and ``server`` fixtures are in
tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import torch

from areal_mega.models.tiny import make_tiny_model

API_KEY = "test-key"


def make_models(tmp_path_factory):
    """Two tiny llama models with the same shapes and different weights."""
    base = tmp_path_factory.mktemp("rollout_models")
    a = make_tiny_model(base / "a", arch="llama", hidden_size=64, num_layers=2, seed=0)
    b = make_tiny_model(base / "b", arch="llama", hidden_size=64, num_layers=2, seed=1)
    return a, b


def load_model(path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced_logprobs(model, ids, start, temperature=1.0):
    """log p(ids[t] | ids[:t]) for t >= start, at ``temperature``."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(start, len(ids))]


def http(server, path, body=None, key=API_KEY, timeout=120):
    """``(status, JSON answer)`` of one request to ``server`` (a server handle or
    ``host:port``): GET without ``body``, else POST of ``body`` as JSON; ``key`` as the Bearer
    token."""
    data = None if body is None else json.dumps(body).encode()
    r = urllib.request.Request(
        f"http://{getattr(server, 'addr', server)}{path}",
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    if key:
        r.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def run(coro, timeout=120):
    """Run ``coro`` on a fresh event loop with a timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class GroupSink:
    """A controller sink that appends each delivered group to ``groups`` (sinks run on the
    controller's thread pool, hence the lock); :meth:`take` reads them like a trainer reads its
    buffer: in arrival order, ``n`` at a time."""

    def __init__(self):
        self.groups: list = []
        self._lock = threading.Lock()
        self._taken = 0

    def __call__(self, group: list) -> None:
        with self._lock:
            self.groups.append(group)

    def __len__(self) -> int:
        with self._lock:
            return len(self.groups)

    def take(self, ctl, n: int, timeout: float = 120.0) -> list:
        """The next ``n`` delivered groups not taken yet; polls until they arrive and raises
        the controller's failure (``ctl.raise_if_failed``) instead of waiting it out."""
        deadline = time.monotonic() + timeout
        while True:
            ctl.raise_if_failed()
            with self._lock:
                if len(self.groups) >= self._taken + n:
                    out = self.groups[self._taken : self._taken + n]
                    self._taken += n
                    return out
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{n} groups not delivered within {timeout}s "
                    f"({len(self)} delivered, {self._taken} taken)"
                )
            time.sleep(0.02)
