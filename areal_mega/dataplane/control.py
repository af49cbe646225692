"""Control channel between the trainer (rank 0) and the rollout worker: JSON over ZMQ REQ/REP.

Commands (trainer -> worker), each answered with ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``:

* ``{"cmd": "update_weights", "version": V, "path": DIR}`` — pause generation, load the HF
  weights in DIR on every server, continue, make V the current version (interrupted requests
  are resubmitted with their partial output). Answered when the servers serve version V.
* ``{"cmd": "begin_update"}`` / ``{"cmd": "end_update", "version": V}`` — the two halves of
  an update whose tensors the trainer broadcasts itself over its weight-update group (pause
  before, continue with version V after). ``begin_update`` answers ``{"servers": [...],
  "reform": bool}``: the live servers the group must hold, and whether one of them was
  relaunched (the group must be formed again even if the list is unchanged).
* ``{"cmd": "evaluate", "version": V}`` — run the evaluation set (``eval.*``) on the servers,
  which serve version V, and answer ``{"version": V, "metrics": {"eval/...": x}}``
  (:mod:`areal_mega.eval.worker_hook`).
* ``{"cmd": "stats"}`` — the worker's counters (running, accepted, staleness holds, ...).
* ``{"cmd": "servers"}``, ``{"cmd": "add_server", "addr": A}``, ``{"cmd": "remove_server",
  "addr": A, "drain": bool}`` — elastic rollout membership (:mod:`areal_mega.rollout.server_pool`;
  ``launch.scale`` sends them through ``launch.local``).
* ``{"cmd": "ping"}``.

JSON only (no pickle); a malformed message gets ``ok: false`` and the worker keeps serving.

**Authentication** (with a shared secret, ``dataplane.secret``; required to bind anything but
``ipc://`` or a loopback address, which also needs ``allow_remote``): every message is two
frames, the JSON body and its HMAC-SHA256 under the secret (requests and replies use different
tags, compared in constant time). Replay: each request carries a single-use nonce the worker
issued in its previous reply (a client without one sends ``null`` and gets ``ok: false`` with a
fresh nonce, then repeats the request: two round trips on first contact), and each reply echoes
the request's random id, so neither a recorded request nor a recorded reply can be played
again. A request that fails authentication is not executed: it is counted in
:attr:`ControlServer.rejected` (``missing_mac``, ``bad_mac``, ``replay``), logged (rate-limited)
and answered with an unsigned ``ok: false``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from typing import Callable, Optional

import zmq

from areal_mega.dataplane.transport import is_local_endpoint
from areal_mega.dataplane.wire import Secret, secret_bytes

log = logging.getLogger(__name__)

_REQ_TAG = b"areal-mega-control/1 request\n"
_REP_TAG = b"areal-mega-control/1 reply\n"
_MAX_NONCES = 64
"""Issued, unused nonces the worker remembers (oldest forgotten first)."""
_LOG_FIRST, _LOG_EVERY = 10, 1000


def _mac(key: bytes, tag: bytes, body: bytes) -> bytes:
    return hmac.new(key, tag + body, hashlib.sha256).digest()


class ControlError(RuntimeError):
    """The worker answered ``ok: false``, did not answer in time, failed authentication, or the
    endpoint may not be bound."""


class ControlTimeout(ControlError):
    """The peer did not answer within the request's time (it may still be alive, and busy)."""


def _said(body: bytes) -> str:
    """The ``error`` text of an (untrusted) reply body, for an error message."""
    try:
        return str(json.loads(body).get("error", "?"))[:200]
    except (ValueError, AttributeError):
        return "unreadable reply"


class RolloutLink:
    """Trainer side: send a command, wait for the reply (REQ with a timeout).

    With ``secret`` every request is signed and carries the worker's last nonce, and every
    reply must be signed and answer this request (see the module docstring); a worker that
    refuses the signature or an unsigned reply raise :class:`ControlError`. A worker that dies
    while it holds a request (``launch.local`` relaunches it) is seen as a disconnect: the
    request goes again, on a fresh socket, to its successor.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        secret: Secret = None,
        timeout_s: float = 600.0,
        peer: str = "rollout worker",
    ):
        self.endpoint = endpoint
        self.peer = peer  # who answers, for error messages
        self.timeout_ms = int(timeout_s * 1000)
        self._key = secret_bytes(secret)
        self._nonce: Optional[str] = None
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
        self._nonce = None

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

    def _send(self, msg: dict, rid: str) -> None:
        if self._key is None:
            self._sock.send(json.dumps(msg).encode())
        else:
            body = json.dumps({**msg, "_id": rid, "_nonce": self._nonce}).encode()
            self._sock.send_multipart([body, _mac(self._key, _REQ_TAG, body)])

    def _exchange(self, msg: dict, deadline: float, timeout_ms: int) -> dict:
        """One request/reply round (resent to a relaunched worker); verifies the reply when a
        secret is set."""
        cmd = msg.get("cmd")
        rid = os.urandom(12).hex()
        self._send(msg, rid)
        while not self._sock.poll(
            min(500, max(0, int((deadline - time.monotonic()) * 1000))), zmq.POLLIN
        ):
            if time.monotonic() >= deadline:
                self._connect()
                raise ControlTimeout(
                    f"{self.peer} at {self.endpoint} did not answer "
                    f"{cmd!r} within {timeout_ms / 1000:g} s"
                )
            if self._peer_lost():
                log.warning(
                    "%s at %s went away during %r; sending it again to its successor",
                    self.peer,
                    self.endpoint,
                    cmd,
                )
                self._connect()
                self._send(msg, rid)
        frames = self._sock.recv_multipart()
        if self._key is None:
            return json.loads(frames[0])
        self._nonce = None
        if len(frames) != 2 or not hmac.compare_digest(
            frames[1], _mac(self._key, _REP_TAG, frames[0])
        ):
            raise ControlError(
                f"{self.peer} at {self.endpoint}: the reply to {cmd!r} is not "
                "signed with dataplane.secret (do both sides use the same "
                f"secret?); it says: {_said(frames[0])}"
            )
        reply = json.loads(frames[0])
        if reply.pop("_re", None) != rid:
            raise ControlError(
                f"{self.peer} at {self.endpoint}: the reply to {cmd!r} "
                "answers another request (replayed reply?)"
            )
        self._nonce = reply.pop("_nonce", None)
        return reply

    def request(self, msg: dict, timeout_s: Optional[float] = None) -> dict:
        """Send ``msg`` (a dict with ``cmd``) and return the worker's ``ok: true`` reply;
        :class:`ControlError` on ``ok: false``, failed authentication, or no answer within
        ``timeout_s`` in all (a relaunched worker answers a weight update it already applied
        as done)."""
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        deadline = time.monotonic() + timeout_ms / 1000
        reply = self._exchange(msg, deadline, timeout_ms)
        if reply.pop("_stale", False) and self._nonce is not None:
            reply = self._exchange(msg, deadline, timeout_ms)  # now with a fresh nonce
        if not reply.get("ok"):
            raise ControlError(
                f"{self.peer} refused {msg.get('cmd')!r}: {reply.get('error', 'no reason given')}"
            )
        return reply

    def update_weights(self, *, version: int, path: str) -> dict:
        """Load the HF weights in ``path`` on every server and make ``version`` current."""
        return self.request({"cmd": "update_weights", "version": int(version), "path": path})

    def begin_update(self) -> dict:
        """Pause generation before the trainer broadcasts new weights."""
        return self.request({"cmd": "begin_update"})

    def end_update(self, *, version: int) -> dict:
        """Continue generation with ``version`` after a broadcast."""
        return self.request({"cmd": "end_update", "version": int(version)})

    def stats(self) -> dict:
        """The worker's counters."""
        return self.request({"cmd": "stats"}, timeout_s=30)

    def close(self) -> None:
        """Close the sockets."""
        self._close_sockets()


class ControlServer:
    """Worker side: answer commands with ``handler(msg) -> dict`` in a background thread.

    Binding an endpoint other than ``ipc://``, ``inproc://`` or a loopback address needs
    ``allow_remote=True`` and a ``secret`` (:class:`ControlError` otherwise). With a secret
    only signed, fresh requests reach ``handler``; the others are counted in :attr:`rejected`.
    """

    def __init__(
        self,
        endpoint: str,
        handler: Callable[[dict], dict],
        *,
        secret: Secret = None,
        allow_remote: bool = False,
    ):
        self._key = secret_bytes(secret)
        if not is_local_endpoint(endpoint):
            if not allow_remote:
                raise ControlError(
                    f"control endpoint {endpoint!r}: not loopback; binding it "
                    "needs dataplane.allow_remote=true and dataplane.secret"
                )
            if self._key is None:
                raise ControlError(
                    f"control endpoint {endpoint!r}: binding a non-loopback "
                    "interface without dataplane.secret is refused (anyone who "
                    "reaches it could drive weight updates)"
                )
        self.handler = handler
        self.rejected: collections.Counter = collections.Counter()
        self._nonces: collections.OrderedDict = collections.OrderedDict()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise ControlError(f"control endpoint {endpoint!r}: bind failed: {e}") from None
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rollout-control", daemon=True)

    def start(self) -> "ControlServer":
        """Start answering in the background; returns self."""
        self._thread.start()
        return self

    def _run(self, msg) -> dict:
        try:
            if not isinstance(msg, dict) or "cmd" not in msg:
                raise ValueError("expected a JSON object with a 'cmd' field")
            return {"ok": True, **(self.handler(msg) or {})}
        except Exception as e:  # noqa: BLE001 - the worker never dies on a bad command
            log.warning("control command failed: %s", e)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        n = self.rejected[reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            log.warning("control: rejected a request (%s, #%d of this reason)", reason, n)

    def _issue(self) -> str:
        nonce = os.urandom(16).hex()
        self._nonces[nonce] = None
        while len(self._nonces) > _MAX_NONCES:
            self._nonces.popitem(last=False)
        return nonce

    def _answer(self, frames: list) -> list:
        """The reply frames for one request's frames."""
        if self._key is None:
            if len(frames) != 1:
                return [
                    json.dumps(
                        {
                            "ok": False,
                            "error": "signed request, but this worker has no dataplane.secret",
                        }
                    ).encode()
                ]
            try:
                msg = json.loads(frames[0])
            except ValueError as e:
                return [json.dumps({"ok": False, "error": f"bad JSON: {e}"}).encode()]
            return [json.dumps(self._run(msg)).encode()]
        body = frames[0]
        reason = None
        if len(frames) != 2:
            reason = "missing_mac"
        elif not hmac.compare_digest(frames[1], _mac(self._key, _REQ_TAG, body)):
            reason = "bad_mac"
        if reason is not None:
            self._reject(reason)
            return [
                json.dumps(
                    {
                        "ok": False,
                        "error": f"authentication failed ({reason}): "
                        "requests must be signed with dataplane.secret",
                    }
                ).encode()
            ]
        try:
            msg = json.loads(body)
        except ValueError as e:
            msg = {"_bad": str(e)}
        if not isinstance(msg, dict):
            msg = {"_bad": "not a JSON object"}
        rid, nonce = msg.pop("_id", None), msg.pop("_nonce", None)
        if "_bad" in msg:
            reply = {"ok": False, "error": f"bad JSON: {msg['_bad']}"}
        elif nonce is None or nonce not in self._nonces:
            if nonce is not None:
                self._reject("replay")
            reply = {
                "ok": False,
                "_stale": True,
                "error": "stale or replayed nonce; repeat with the fresh one",
            }
        else:
            del self._nonces[nonce]
            reply = self._run(msg)
        reply["_re"], reply["_nonce"] = rid, self._issue()
        out = json.dumps(reply).encode()
        return [out, _mac(self._key, _REP_TAG, out)]

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100, zmq.POLLIN):
                    continue
                self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        """Stop the thread and close the socket. A command still running after 2 s keeps
        the socket until it has answered: the serving thread closes it then (a ZMQ socket
        belongs to one thread)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
            if self._thread.is_alive():
                return
        self._sock.close(linger=0)
