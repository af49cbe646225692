"""ZMQ transport for trajectories: many rollout senders (DEALER), one trainer receiver (ROUTER).

* The receiver **binds** (``tcp://127.0.0.1:*`` picks a free port; ``ipc://`` paths work too);
  every sender **connects**. Binding a non-loopback TCP interface needs
  ``allow_remote=True`` *and* a shared secret (:class:`DataplaneError` otherwise): without
  one anyone who reaches the port could inject training samples.
* **Credit window, acknowledged delivery**: a sender keeps at most ``window`` messages in
  flight; the receiver acknowledges messages as :meth:`TrajectoryReceiver.recv` takes them,
  in batches of up to ``window // 4`` per sender (the window travels in the sender's routing
  id) while more messages are queued, and at once when the recv that takes a message finds
  nothing else queued (so a sender never waits on a held-back batch for long, and the last
  message is acked by the recv that takes it).
  When the trainer stops calling ``recv`` no acks flow, every sender's window fills and
  :meth:`TrajectorySender.send` blocks (or raises ``TimeoutError``): a slow trainer slows the
  rollouts. Receiver memory is bounded by ``n_senders * window`` messages (and
  ``RCVHWM = max_queue`` per peer for peers that ignore the protocol).
  Why not plain PUSH/PULL: libzmq drops the messages a PULL socket's engine still holds when
  the sending peer disconnects while the receive queue is full (measured: 8 of 120 lost with
  3 senders and RCVHWM 8); waiting for acks before closing makes exits loss-free.
  Limitation: messages in flight when the *trainer* dies are lost (restore from the buffer
  checkpoint; a restarted receiver does not re-ack, so restart senders with it).
* **Robustness**: every message goes through :func:`decode_trajectory`; a bad one is dropped,
  counted per reason in :attr:`TrajectoryReceiver.rejected` and logged (rate-limited). A
  single frame larger than ``max_message_bytes`` is refused by libzmq itself
  (``ZMQ_MAXMSGSIZE``), which drops that connection (the peer reconnects); a message whose
  frames together exceed the limit is counted as ``oversize``.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import time
from typing import Optional

import zmq

from areal_mega.dataplane.multimodal import VisionSpec, vision_problem
from areal_mega.dataplane.trajectory import Trajectory, TrajectoryError
from areal_mega.dataplane.wire import (
    Secret,
    WireError,
    decode_trajectory,
    encode_trajectory,
    secret_bytes,
)

log = logging.getLogger("areal_mega.dataplane")

COPY_THRESHOLD = 64 * 1024
"""Frames smaller than this are copied into the message (cheaper than zero-copy tracking)."""

_PACK_COPY = 1 << 20
"""The pack is sent as a copy below this size: we built it, so a zero-copy send would only add
pyzmq's buffer tracking (measured: 8k-token trajectory, sender CPU 77 -> 64 us/message)."""
_SNDMORE = int(zmq.SNDMORE)

_ID_MAGIC = b"AMDP1"
"""Prefix of a sender's ZMQ routing id, followed by its window (uint32 LE) and 8 random bytes:
it tells the receiver how many acks it may batch for that sender without stalling it."""
_ID_LEN = len(_ID_MAGIC) + 4 + 8


def _sender_routing_id(window: int) -> bytes:
    return _ID_MAGIC + min(window, 0xFFFFFFFF).to_bytes(4, "little") + os.urandom(8)


def _ack_batch(peer: bytes, cap: int) -> int:
    """Messages the receiver may take from ``peer`` before it must ack them: a quarter of the
    window the peer advertises in its routing id, at most ``cap``; 1 for any other peer."""
    if len(peer) == _ID_LEN and peer.startswith(_ID_MAGIC):
        return max(1, min(cap, int.from_bytes(peer[5:9], "little") // 4))
    return 1


_LOG_FIRST = 10
_LOG_EVERY = 1000


class DataplaneError(RuntimeError):
    """Bad endpoint or configuration of the data plane."""


def _poll_ms(deadline: Optional[float]) -> Optional[int]:
    """Milliseconds to poll until the ``time.monotonic()`` ``deadline``: -1 (forever) for
    none, None once it has passed, at least 1 otherwise."""
    if deadline is None:
        return -1
    left = deadline - time.monotonic()
    return None if left <= 0 else max(1, int(left * 1000))


def default_endpoint(run_dir: str) -> str:
    """The ipc endpoint used when ``dataplane.endpoint`` is empty: ``<run_dir>/dataplane.sock``."""
    return check_endpoint("ipc://" + os.path.join(os.path.abspath(run_dir), "dataplane.sock"))


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this machine can reach ``endpoint``: ``ipc://``, ``inproc://`` or TCP on a
    loopback address (``localhost`` included); ``*``, host names and other addresses are not."""
    scheme, _, rest = str(endpoint).partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_secret(endpoint: str, secret: Secret, what: str = "endpoint") -> None:
    """Refuse (:class:`DataplaneError`) to bind a non-local ``endpoint`` without a shared
    secret: an unauthenticated socket reachable from the network accepts anyone's messages."""
    if secret_bytes(secret) is None and not is_local_endpoint(endpoint):
        raise DataplaneError(
            f"{what} {endpoint!r}: binding a non-loopback interface without a "
            "shared secret is refused (anyone who reaches it could inject "
            "messages); set dataplane.secret, or bind 127.0.0.1 / ipc://"
        )


def check_endpoint(endpoint: str, *, bind: bool = False, allow_remote: bool = False) -> str:
    """Validate a ``tcp://host:port`` / ``ipc://path`` / ``inproc://name`` endpoint.

    For a bind, ``:0`` becomes ``:*`` (a free port), ``localhost`` becomes ``127.0.0.1``, and a
    host that is not a loopback address is refused unless ``allow_remote``. Returns the
    normalised endpoint; raises :class:`DataplaneError` naming the problem.
    """
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise DataplaneError(
            f"endpoint {endpoint!r}: expected tcp://host:port, ipc://path or inproc://name"
        )
    scheme, rest = endpoint.split("://", 1)
    if scheme == "ipc":
        if not rest:
            raise DataplaneError(f"endpoint {endpoint!r}: empty ipc path")
        if len(rest) > 100:  # sockaddr_un path limit is 107 bytes on Linux
            raise DataplaneError(
                f"endpoint {endpoint!r}: ipc path longer than 100 characters; "
                "use a shorter run directory or tcp://127.0.0.1:*"
            )
        return endpoint
    if scheme == "inproc":
        return endpoint
    if scheme != "tcp":
        raise DataplaneError(f"endpoint {endpoint!r}: scheme {scheme!r} not supported")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise DataplaneError(f"endpoint {endpoint!r}: expected tcp://host:port")
    if port == "0" and bind:
        port = "*"
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise DataplaneError(f"endpoint {endpoint!r}: bad port {port!r}")
    if host == "localhost":
        host = "127.0.0.1"
    if bind and not allow_remote:
        try:
            loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise DataplaneError(
                f"endpoint {endpoint!r}: binding host {host!r} is not loopback;"
                " pass allow_remote=True (dataplane.allow_remote) and set a "
                "secret to accept remote senders"
            )
    return f"tcp://{host}:{port}"


class TrajectorySender:
    """DEALER side, one per rollout worker: ``send(traj)`` ships one trajectory.

    At most ``window`` messages are in flight (sent but not yet taken by the receiver's
    ``recv``); ``send`` blocks while the window is full (backpressure), or raises
    ``TimeoutError`` after ``timeout`` seconds without sending. :meth:`close` waits up to
    ``linger_s`` for every in-flight message to be acknowledged, so a sender that exits after
    ``close()`` returned 0 lost nothing. ``validate=True`` also checks each trajectory before
    sending (the receiver always checks; off by default to keep the rollout side cheap).
    """

    def __init__(
        self,
        endpoint: str,
        secret: Secret = None,
        *,
        window: int = 64,
        linger_s: float = 30.0,
        validate: bool = False,
        context: Optional[zmq.Context] = None,
        hwm: Optional[int] = None,
    ):
        self.endpoint = check_endpoint(endpoint)
        self._secret = secret_bytes(secret)
        self._validate = validate
        self.window = int(hwm if hwm is not None else window)
        if self.window < 1:
            raise DataplaneError(f"window={self.window} must be >= 1")
        self.linger_s = linger_s
        self._own_ctx = context is None
        self._ctx = context or zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, _sender_routing_id(self.window))
        self._sock.setsockopt(zmq.SNDHWM, 0)  # flow control is the ack window, not the HWM
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.copy_threshold = COPY_THRESHOLD
        self._sock.connect(self.endpoint)
        self.in_flight = 0
        self.sent = 0
        self.bytes_sent = 0

    def _drain_acks(self, wait_ms: int) -> None:
        """Read acknowledgements; wait up to ``wait_ms`` for the first (-1: forever)."""
        sock = self._sock
        if wait_ms and not sock.poll(wait_ms, zmq.POLLIN):
            return
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) == 8:
                self.in_flight = max(0, self.in_flight - int.from_bytes(msg, "little"))

    def _wait_window(self, limit: int, timeout: Optional[float]) -> bool:
        # Acks are only read when the window is full: ``in_flight`` is an upper bound that is
        # exact after :meth:`flush`. Reading them lazily costs one recv per ack batch.
        if self.in_flight <= limit:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._drain_acks(0)
        while self.in_flight > limit:
            wait = _poll_ms(deadline)
            if wait is None:
                return False
            self._drain_acks(wait)
        return True

    def send(self, traj: Trajectory, timeout: Optional[float] = None) -> None:
        """Validate (unless disabled), encode and send; see the class docstring for blocking."""
        if self._validate:
            traj.validate()
        frames = encode_trajectory(traj, self._secret)
        if not self._wait_window(self.window - 1, timeout):
            raise TimeoutError(
                f"send of sample_id={traj.sample_id!r} to {self.endpoint}: "
                f"{self.in_flight} messages unacknowledged for {timeout} s "
                "(receiver saturated)"
            )
        # the header and a small pack are copied (below the socket's copy_threshold), large
        # fields and a large pack sent zero-copy; a plain loop is cheaper than send_multipart
        send = self._sock.send
        last = len(frames) - 1
        send(frames[0], _SNDMORE)
        send(frames[1], _SNDMORE if last > 1 else 0, copy=len(frames[1]) < _PACK_COPY)
        for k in range(2, len(frames)):
            send(frames[k], _SNDMORE if k < last else 0, copy=False)
        self.in_flight += 1
        self.sent += 1
        self.bytes_sent += len(frames[0]) + len(frames[1])
        if last > 1:
            self.bytes_sent += sum(a.nbytes for a in frames[2:])

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every sent message was taken by the receiver; False on timeout."""
        return self._wait_window(0, timeout)

    def close(self, linger_s: Optional[float] = None) -> int:
        """Flush (up to ``linger_s``, default the constructor's), then close.

        Returns the number of messages still unacknowledged (0: all delivered); those may be
        lost and are logged.
        """
        if self._sock.closed:
            return self.in_flight
        self.flush(self.linger_s if linger_s is None else linger_s)
        if self.in_flight:
            log.warning(
                "dataplane: sender to %s closing with %d unacknowledged messages",
                self.endpoint,
                self.in_flight,
            )
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()
        return self.in_flight

    def __enter__(self) -> "TrajectorySender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrajectoryReceiver:
    """ROUTER side on the trainer: binds ``endpoint``; ``recv(timeout)`` -> Trajectory or None.

    A non-loopback ``endpoint`` needs ``allow_remote=True`` and a ``secret``
    (:class:`DataplaneError` naming the endpoint otherwise).

    Every message taken by :meth:`recv` (accepted or rejected) is acknowledged to its sender,
    which opens the sender's window. Acks are batched per sender: one ack covers up to
    ``window // 4`` messages of a :class:`TrajectorySender` (it advertises its window in its
    routing id; ``ack_every`` caps the batch further; any other peer is acked per message).
    A batch is sent when full, or by the ``recv`` that takes a message and finds nothing else
    queued (so when the trainer keeps up every message is acked before ``recv`` returns it, as
    without batching, and ``recv_many`` returns with all acks sent unless it stopped at
    ``max_n``), or when ``recv`` goes idle, or by :meth:`flush_acks`. A batch is at most a
    quarter of the window, so holding one back never blocks a sender. Counters: :attr:`accepted`,
    :attr:`bytes_accepted`, :attr:`rejected` (a ``collections.Counter`` by reason, see
    :data:`~areal_mega.dataplane.wire.REJECT_REASONS`).

    ``vision``: the receiving model's :class:`~areal_mega.dataplane.multimodal.VisionSpec`, or
    None for a text model; with ``validate`` every trajectory is checked against it
    (:func:`~areal_mega.dataplane.multimodal.vision_problem`: a text model refuses images, a
    vision-language one checks them against the tokens) and refused as ``invalid_field``.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        secret: Secret = None,
        *,
        max_queue: int = 1024,
        max_message_bytes: int = 1 << 30,
        allow_remote: bool = False,
        validate: bool = True,
        ack_every: Optional[int] = None,
        context: Optional[zmq.Context] = None,
        vision: Optional[VisionSpec] = None,
    ):
        ep = check_endpoint(endpoint, bind=True, allow_remote=allow_remote)
        check_bind_secret(ep, secret, "trajectory receiver endpoint")
        self._secret = secret_bytes(secret)
        self._max_bytes = int(max_message_bytes)
        self._validate = validate
        self._vision = vision
        self._ack_cap = 1 << 30 if ack_every is None else max(1, int(ack_every))
        self._unacked: dict[bytes, int] = {}
        self._batch: dict[bytes, int] = {}  # ack batch size per peer (from its routing id)
        self._next: Optional[zmq.Frame] = None
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVHWM, max_queue)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # acks are tiny; never drop one for HWM
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ep.startswith("ipc://") and os.path.exists(ep[6:]):
            os.unlink(ep[6:])  # stale socket file from a previous run
        try:
            self._sock.bind(ep)
        except zmq.ZMQError as e:
            self._sock.close()
            raise DataplaneError(f"endpoint {ep!r}: bind failed: {e}") from None
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.accepted = 0
        self.bytes_accepted = 0
        self.rejected: collections.Counter = collections.Counter()

    def _ack(self, peer: bytes) -> None:
        n = self._unacked.pop(peer, 0)
        if n:
            try:
                self._sock.send_multipart([peer, n.to_bytes(8, "little")], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # peer gone: nothing to open

    def flush_acks(self) -> None:
        """Acknowledge every message taken so far (``recv`` does this when it goes idle)."""
        for peer in list(self._unacked):
            self._ack(peer)

    def reject(self, err: WireError) -> None:
        """Count and log (rate-limited) a dropped message; also for a trajectory refused by a
        check after decoding (e.g. the trainer intake's routes check)."""
        self.rejected[err.reason] += 1
        n = self.rejected[err.reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            log.warning(
                "dataplane: dropped message (%s, #%d of this reason): %s", err.reason, n, err.detail
            )

    def recv(self, timeout: Optional[float] = None) -> Optional[Trajectory]:
        """Return the next valid trajectory, or None if none arrives within ``timeout`` s.

        ``timeout=None`` waits forever, ``0`` only takes what is already queued. Bad messages
        met on the way are dropped and counted; they never raise.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._sock
        unacked = self._unacked
        while True:
            part = self._next  # first frame of a message taken by the previous recv's look-ahead
            if part is not None:
                self._next = None
            else:
                try:
                    part = sock.recv(zmq.NOBLOCK, copy=False)  # the sender's routing id
                except zmq.Again:
                    if unacked:
                        self.flush_acks()  # idle: acknowledge everything taken
                    wait = _poll_ms(deadline)
                    if wait is None or not sock.poll(wait, zmq.POLLIN):
                        return None
                    continue
            peer = part.bytes
            # The rest of a multipart message is already here (ZMQ delivers it atomically);
            # Frame.more is set on receive, cheaper than recv_multipart's getsockopt(RCVMORE).
            frames = []
            while part.more:
                part = sock.recv(0, copy=False)
                frames.append(part)
            n = unacked.get(peer, 0) + 1
            unacked[peer] = n
            batch = self._batch.get(peer)
            if batch is None:
                batch = self._batch[peer] = _ack_batch(peer, self._ack_cap)
                if len(self._batch) > 4096:  # peers come and go: forget the oldest
                    del self._batch[next(iter(self._batch))]
            if n >= batch:
                self._ack(peer)
            try:
                traj = decode_trajectory(
                    frames, self._secret, max_message_bytes=self._max_bytes, validate=self._validate
                )
            except WireError as e:
                self.reject(e)
                continue
            if self._validate and (traj.multimodal or self._vision is not None):
                problem = vision_problem(traj, self._vision)
                if problem is not None:
                    self.reject(
                        WireError("invalid_field", str(TrajectoryError(*problem, traj.sample_id)))
                    )
                    continue
            self.accepted += 1
            self.bytes_accepted += sum(map(len, frames))
            if unacked:
                # Look ahead: take the next message's first frame now (the next recv starts
                # from it), or, when nothing else is queued, acknowledge what was taken. One
                # recv attempt costs less than asking libzmq for ZMQ_EVENTS.
                try:
                    self._next = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    self.flush_acks()
            return traj

    def recv_many(self, max_n: int, timeout: Optional[float] = None) -> list[Trajectory]:
        """Up to ``max_n`` trajectories: waits ``timeout`` for the first, then takes only what
        is already queued."""
        out: list[Trajectory] = []
        first = self.recv(timeout)
        if first is None:
            return out
        out.append(first)
        while len(out) < max_n:
            t = self.recv(0)
            if t is None:
                break
            out.append(t)
        return out

    def stats(self) -> dict:
        """Counters as a plain dict (for logging / tensorboard)."""
        return {
            "accepted": self.accepted,
            "bytes_accepted": self.bytes_accepted,
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
        }

    def close(self) -> None:
        """Close the socket (pending messages are discarded)."""
        self._next = None
        if not self._sock.closed:
            self._sock.close(0)
        if self.endpoint.startswith("ipc://") and os.path.exists(self.endpoint[6:]):
            try:
                os.unlink(self.endpoint[6:])
            except OSError:
                pass

    def __enter__(self) -> "TrajectoryReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
