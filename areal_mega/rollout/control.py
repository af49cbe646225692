"""Control channel between the trainer (rank 0) and the rollout worker: JSON over ZMQ REQ/REP.

Commands (trainer -> worker), each answered with ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``:

* ``{"cmd": "update_weights", "version": V, "path": DIR}`` — pause generation, load the HF
  weights in DIR on every server, continue, make V the current version (interrupted requests
  are resubmitted with their partial output). Answered when the servers serve version V.
* ``{"cmd": "begin_update"}`` / ``{"cmd": "end_update", "version": V}`` — the two halves of
  an update whose tensors the trainer broadcasts itself over its weight-update group (pause
  before, continue with version V after).
* ``{"cmd": "stats"}`` — the worker's counters (running, accepted, staleness holds, ...).
* ``{"cmd": "ping"}``.

JSON only (no pickle); a malformed message gets ``ok: false`` and the worker keeps serving.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

import zmq

log = logging.getLogger(__name__)


class ControlError(RuntimeError):
    """The worker answered ``ok: false`` or did not answer in time."""


class RolloutLink:
    """Trainer side: send a command, wait for the reply (REQ with a timeout)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 600.0):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._connect()

    def _connect(self) -> None:
        self._close_sockets()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.REQ_RELAXED, 1)
        self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        # a worker that dies takes the request with it: seen as a disconnect, then resent
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)

    def _close_sockets(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = None

    def _peer_lost(self) -> bool:
        lost = False
        while self._monitor.poll(0, zmq.POLLIN):
            self._monitor.recv_multipart()
            lost = True
        return lost

    def request(self, msg: dict, timeout_s: Optional[float] = None) -> dict:
        """Send ``msg`` and return the worker's ``ok`` reply. A worker that dies meanwhile
        (``launch.local`` relaunches it) gets the request again, on a fresh socket, once it
        is back; the worker answers a repeated weight update it already applied as done.
        Raises :class:`ControlError` on an error reply or after ``timeout_s`` in all."""
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        deadline = time.monotonic() + timeout_ms / 1000
        payload = json.dumps(msg).encode()
        self._sock.send(payload)
        while not self._sock.poll(min(500, max(0, int((deadline - time.monotonic()) * 1000))),
                                  zmq.POLLIN):
            if time.monotonic() >= deadline:
                self._connect()
                raise ControlError(f"rollout worker at {self.endpoint} did not answer "
                                   f"{msg.get('cmd')!r} within {timeout_ms / 1000:.0f} s")
            if self._peer_lost():
                log.warning("rollout worker at %s went away during %r; sending it again to "
                            "its successor", self.endpoint, msg.get("cmd"))
                self._connect()
                self._sock.send(payload)
        reply = json.loads(self._sock.recv())
        if not reply.get("ok"):
            raise ControlError(f"rollout worker refused {msg.get('cmd')!r}: "
                               f"{reply.get('error', 'no reason given')}")
        return reply

    def update_weights(self, *, version: int, path: str) -> dict:
        return self.request({"cmd": "update_weights", "version": int(version), "path": path})

    def begin_update(self) -> dict:
        return self.request({"cmd": "begin_update"})

    def end_update(self, *, version: int) -> dict:
        return self.request({"cmd": "end_update", "version": int(version)})

    def stats(self) -> dict:
        return self.request({"cmd": "stats"}, timeout_s=30)

    def close(self) -> None:
        self._close_sockets()


class ControlServer:
    """Worker side: answer commands with ``handler(msg) -> dict`` in a background thread."""

    def __init__(self, endpoint: str, handler: Callable[[dict], dict]):
        self.endpoint = endpoint
        self.handler = handler
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rollout-control", daemon=True)

    def start(self) -> "ControlServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            raw = self._sock.recv()
            try:
                msg = json.loads(raw)
                if not isinstance(msg, dict) or "cmd" not in msg:
                    raise ValueError("expected a JSON object with a 'cmd' field")
                reply = {"ok": True, **(self.handler(msg) or {})}
            except Exception as e:  # noqa: BLE001 - the worker never dies on a bad command
                log.warning("control command failed: %s", e)
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            self._sock.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._sock.close(linger=0)
