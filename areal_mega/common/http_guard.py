"""Defences of our aiohttp servers against hostile or broken clients (the online gateway, the
OpenAI endpoint of episode workflows, the CPU rollout server).

* :func:`strict_json_loads`: a JSON body with an integer out of range (400 digits) or nested
  too deeply is a :class:`BodyError` (HTTP 400), never an exception that ends as a 500 further
  in (non-finite floats are left to each field's check, or refused too on request);
* :func:`read_json_body`: the body must arrive within a time limit (408, and the connection is
  closed) and fit the application's ``client_max_size`` (413);
* :class:`ConnectionGuard`: a cap on open connections, kept below the process's file
  descriptor limit, enforced when a connection is accepted: past it the oldest connection
  with no request in progress (idle, or still sending its headers) is closed for the newcomer,
  and when every connection is busy the newcomer gets a fixed ``503`` and is closed. Nothing
  is parsed and no traceback is written per socket; one log line per interval counts what was
  closed or refused. Idle connections (including those whose headers never complete) are
  closed by aiohttp's ``keepalive_timeout``, which the callers set.

No torch: every process may import it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import resource
import socket
import time
from typing import Optional

from aiohttp import web

from . import counters

log = logging.getLogger(__name__)

MAX_INT = 2**63 - 1
"""JSON integers beyond +-this are refused (no field of ours takes more than int64)."""
FD_RESERVE = 128
"""File descriptors kept free for everything but client connections (the rollout servers'
connections, journal files, sockets of the data plane)."""
ACCEPT_BATCH = FD_RESERVE // 4
"""Connections the event loop accepts in one go (asyncio takes up to its ``backlog`` per
wake-up, and a closed connection's descriptor is released only on the next loop iteration)."""


class BodyError(ValueError):
    """A request body refused: HTTP ``status`` and a message for the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or not -MAX_INT - 1 <= int(text) <= MAX_INT:
        raise BodyError(
            f"number {text[:24]}{'...' if len(text) > 24 else ''} is out of "
            "range (integers must fit in int64)"
        )
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise BodyError(f"number {text[:24]} is out of range (not a finite float)")
    return v


def _constant(name: str):
    raise BodyError(f"{name} is not a JSON number")


def strict_json_loads(raw, finite: bool = False):
    """``json.loads`` of a request body that refuses, as :class:`BodyError` (400), integers
    beyond int64 (``10**400`` would overflow wherever it is turned into a float), nesting too
    deep for the parser, and text that is not UTF-8 JSON. ``finite``: also refuse floats that
    overflow (``1e400``) and ``NaN``/``Infinity``; without it they come through as floats for
    the field's own check (which names the field)."""
    kw = {"parse_float": _float, "parse_constant": _constant} if finite else {}
    try:
        return json.loads(raw, parse_int=_int, **kw)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError("malformed JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BodyError(f"malformed JSON: {e}") from None


async def read_json_body(request: web.Request, timeout_s: Optional[float] = None):
    """The request's body parsed by :func:`strict_json_loads`. :class:`BodyError` 408 when it
    does not arrive within ``timeout_s`` (the caller closes the connection), 413 beyond the
    application's ``client_max_size``, 400 when malformed."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyError(f"request body not received within {timeout_s:g} s", 408) from None
    except web.HTTPRequestEntityTooLarge as e:
        raise BodyError(f"request body too large ({e.text or 'over the limit'})", 413) from None
    return strict_json_loads(raw)


def connection_cap(requested: int, reserve: int = FD_RESERVE) -> int:
    """``requested`` connections at most, and fewer than the process's file descriptor limit
    minus ``reserve`` (so that accepting never fails for want of descriptors); at least 8."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(8, requested)
    return max(8, min(requested, soft - reserve))


_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
)


class _Refuse(asyncio.Protocol):
    """Answers a fixed 503 and closes: what a connection past the cap gets."""

    def __init__(self, body: bytes):
        self.body = body

    def connection_made(self, transport) -> None:
        transport.write(_REFUSAL % len(self.body) + self.body)
        transport.close()

    def data_received(self, data) -> None:
        pass


class ConnectionGuard:
    """The connection cap of one aiohttp server (see the module doc). ``name`` is what the
    log lines call it; ``max_connections`` is capped by :func:`connection_cap`."""

    def __init__(
        self,
        name: str,
        max_connections: int,
        log_every_s: float = 10.0,
        counter: Optional[str] = None,
    ):
        """``counter``: a :mod:`~areal_mega.common.counters` prefix; ``<counter>_refused`` and
        ``<counter>_closed_idle`` are bumped per connection."""
        self.name = name
        self.counter = counter
        self.cap = connection_cap(max_connections)
        self.log_every_s = log_every_s
        self.refused = self.evicted = 0  # since the start
        self._unlogged = [0, 0]  # refused, evicted since the last log line
        self._last_log = 0.0
        self._refusal = json.dumps(
            {
                "error": {
                    "message": f"{name}: too many connections ({self.cap}); retry later",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode()

    def factory(self, server: web.Server):
        """The protocol factory to serve ``server`` (``runner.server``) with."""

        def make():
            conns = server._connections  # handler -> transport, oldest first
            live = [(h, t) for h, t in conns.items() if not t.is_closing()]
            if len(live) >= self.cap:
                # the oldest connection without a request in progress makes room
                idle = next((h for h, _ in live if getattr(h, "_current_request", 1) is None), None)
                if idle is None:
                    self._count(0)
                    return _Refuse(self._refusal)
                idle.force_close()
                self._count(1)
            return server()

        return make

    def _count(self, which: int) -> None:
        if which == 0:
            self.refused += 1
        else:
            self.evicted += 1
        if self.counter:
            counters.bump(f"{self.counter}_{'refused' if which == 0 else 'closed_idle'}")
        self._unlogged[which] += 1
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            log.warning(
                "%s at its cap of %d connections: %d refused (503), %d idle ones closed "
                "for newcomers since the last such line",
                self.name,
                self.cap,
                self._unlogged[0],
                self._unlogged[1],
            )
            self._unlogged = [0, 0]
            self._last_log = now

    async def serve(
        self, runner: web.AppRunner, host: str, port: int, ssl_context=None, backlog: int = 2048
    ) -> asyncio.AbstractServer:
        """Listen on ``host:port`` for ``runner`` (set up) through this guard; returns the
        asyncio server (close it before ``runner.cleanup()``). The kernel queues ``backlog``
        connections; the loop accepts at most :data:`ACCEPT_BATCH` of them at a time, so the
        descriptors of those it closed (past the cap) are released before it accepts more."""
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop)
        server = await loop.create_server(
            self.factory(runner.server),
            host,
            port,
            ssl=ssl_context,
            backlog=ACCEPT_BATCH,
            reuse_address=True,
        )
        for ts in server.sockets:  # asyncio listens with its accept batch: widen the queue
            with socket.socket(ts.family, ts.type, fileno=os.dup(ts.fileno())) as dup:
                dup.listen(backlog)
        return server


_ACCEPT_ERROR = "socket.accept() out of system resource"


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """Out of file descriptors, asyncio logs a traceback for every failed ``accept()``; on
    ``loop`` these become one line per ``every_s`` with their count (other errors go to the
    handler there was). Idempotent."""
    old = loop.get_exception_handler()
    if getattr(old, "_quiet_accept", False):
        return
    state = {"n": 0, "last": 0.0}

    def handler(lp, context) -> None:
        if str(context.get("message", "")).startswith(_ACCEPT_ERROR):
            state["n"] += 1
            now = time.monotonic()
            if now - state["last"] >= every_s:
                log.warning(
                    "%s (%d times in the last %.0f s): %s",
                    _ACCEPT_ERROR,
                    state["n"],
                    every_s,
                    context.get("exception"),
                )
                state["n"], state["last"] = 0, now
            return
        if old is not None:
            old(lp, context)
        else:
            lp.default_exception_handler(context)

    handler._quiet_accept = True
    loop.set_exception_handler(handler)


def run_app_guarded(
    app: web.Application,
    host: str,
    port: int,
    *,
    name: str,
    max_connections: int = 1024,
    **runner_kwargs,
) -> None:
    """``web.run_app(app, host=host, port=port, **runner_kwargs)`` with the connections kept
    under a :class:`ConnectionGuard` named ``name``. As ``run_app``: SIGINT/SIGTERM stop it,
    the application's shutdown hooks run while requests in progress may still answer, then
    the tasks left are cancelled."""

    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=True, **runner_kwargs)
        await runner.setup()
        listener = await ConnectionGuard(name, max_connections).serve(runner, host, port)
        try:
            while True:
                await asyncio.sleep(3600)
        finally:
            listener.close()
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        for tasks in ({main}, asyncio.all_tasks(loop)):  # the server first, then the rest
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        asyncio.set_event_loop(None)
        loop.close()
