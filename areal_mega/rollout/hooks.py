"""What a :class:`~areal_mega.rollout.client.RolloutClient` leaves to its owner, by
composition: the :class:`ClientHooks` given at construction. The client calls them; they reach
the servers only through the client's public methods (``request``, ``mark_up``, ...)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from areal_mega.rollout.client import RolloutClient

log = logging.getLogger(__name__)


class ClientHooks:
    """The points where a :class:`RolloutClient` defers to its owner (pass an object overriding
    some of them as ``RolloutClient(..., hooks=...)``). The defaults are the plain client: every
    healthy server may be picked, ``GET /health`` is the probe, checks may overlap, and a call
    fails at once when no server is healthy. Hooks run on the client's event loop and reach
    servers only through the client's public methods."""

    #: how long (s) a generate or broadcast control call waits for some server to be healthy
    #: again (:meth:`RolloutClient.wait_for_server`) when none is; None: fail at once
    down_wait_s: Optional[float] = None
    #: run health checks one at a time (a probe that re-syncs a server must not run twice)
    serial_checks: bool = False

    def blocked(self) -> set:
        """Member addresses that get no new requests now (they still get control calls)."""
        return set()

    async def probe(
        self, client: "RolloutClient", addr: str, healthy: bool, timeout: float
    ) -> None:
        """Check the member ``addr`` (``healthy``: its flag before the check). Raise when it is
        down: the client marks it down. A check that finds it usable calls
        ``client.mark_up(addr)``; one that returns without doing so leaves the flag as is.

        ``/health`` is the liveness probe (as in AReaL): on SGLang ``/health_generate`` runs a
        generation and answers 503 after a while when generation is paused (e.g. during a
        weight update), which would mark a live server down."""
        await client.request(addr, "GET", "/health", timeout=timeout)
        if not client.is_healthy(addr):
            log.warning("rollout server %s is back", addr)
        client.mark_up(addr)

    def generated(self, addr: str, out: dict) -> None:
        """``/generate`` on ``addr`` answered ``out`` (the raw answer)."""

    def generate_failed(self, addr: str, error: BaseException) -> None:
        """``/generate`` on ``addr`` failed (connection error, timeout or 5xx); the request is
        retried on another server."""
