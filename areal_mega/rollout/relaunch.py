"""A rollout client that survives its servers being relaunched (``launch.local`` restarts a
killed rollout server on the same port).

A relaunched server boots with the base model. It must not get work until it serves the
current weights, so a server that was marked down is, once it answers its health check again,
first given the newest published weights directory (``<run_dir>/weights/vN``, the one the
trainer last exported: the current version, or the next one about to be announced) with its
version, and only then marked healthy. The trainer exports ``vN`` before it announces it, so a
broadcast of ``vN`` that a server missed while it was down is always on disk when that server
comes back; after loading, the newest directory is checked again (a newer one: load that too).

While no server is healthy, generation and control calls wait for one to come back (up to
``down_wait_s``) instead of failing the episode or the weight update.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from areal_mega.rollout.client import RolloutClient, RolloutServerError
from areal_mega.run_dir import RunDir

log = logging.getLogger(__name__)


class RelaunchTolerantClient(RolloutClient):
    """:class:`RolloutClient` that re-syncs a returning server before dispatching to it.

    ``paths``: the run directory (where the published weights are); ``down_wait_s``: how long
    a call waits for some server to be healthy again. Counts the servers brought back in
    ``resyncs``."""

    def __init__(self, addrs: list, *, paths: RunDir, down_wait_s: float = 120.0, **kw):
        super().__init__(addrs, **kw)
        self.paths = paths
        self.down_wait_s = float(down_wait_s)
        self.synced_version: Optional[int] = None   # the newest version a sync loaded
        self.resyncs = 0
        self._health_lock: Optional[asyncio.Lock] = None

    async def close(self) -> None:
        """Close the HTTP session (and forget the lock of the loop it ran on)."""
        self._health_lock = None
        await super().close()

    async def sync_server(self, srv) -> Optional[int]:
        """Load the newest published weights (and their version) into ``srv``; with none
        published it keeps what it has (a relaunched server: the base model, version 0).
        Returns the version loaded, or None."""
        seen = None
        while True:
            latest = self.paths.latest_weights()
            if latest is None or latest == seen:   # none published: the base model, v0
                return latest[0] if latest else None
            version, path = latest
            await self._call(srv, "POST", "/update_weights_from_disk",
                             {"model_path": str(path), "abort_all_requests": False,
                              "weight_version": str(version)}, timeout=self.control_timeout_s)
            self.synced_version = max(version, self.synced_version or 0)
            seen = latest

    async def sync_all(self) -> Optional[int]:
        """Bring every server to the newest published weights and let it generate (a relaunched
        worker calls this: its predecessor may have died with the servers paused). Returns
        the version they serve (None: none published, the base model)."""
        for srv in self.servers:
            try:
                await self.sync_server(srv)
            except Exception as e:  # noqa: BLE001 - re-synced when it answers again
                self._mark_down(srv, e)
        await self._broadcast("/continue_generation", {})   # waits for a server if none is up
        return self.synced_version

    async def check_health(self, timeout: float = 5.0) -> list:
        """``GET /health_generate`` on every server; a server that was down and answers again
        is re-synced (:meth:`sync_server`) before it is marked healthy."""
        if self._health_lock is None:
            self._health_lock = asyncio.Lock()
        async with self._health_lock:
            return list(await asyncio.gather(*(self._check_one(s, timeout)
                                               for s in self.servers)))

    async def _check_one(self, srv, timeout: float) -> bool:
        was_down = not srv.healthy
        try:
            await self._call(srv, "GET", "/health_generate", timeout=timeout)
            if was_down:
                v = await self.sync_server(srv)
                self.resyncs += 1
                log.warning("rollout server %s is back; it serves version %s now", srv.addr, v)
            srv.healthy = True
        except Exception as e:  # noqa: BLE001 - down (or still booting) until it answers
            self._mark_down(srv, e)
        return srv.healthy

    async def wait_for_server(self, deadline: float) -> bool:
        """Wait until some server is healthy (re-synced), or ``deadline`` (monotonic) passes."""
        while True:
            if any(s.healthy for s in self.servers) or any(await self.check_health(2.0)):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.5)

    async def generate(self, *args, **kw):
        """As :meth:`RolloutClient.generate`, but when every server is down it waits for one to
        be relaunched (up to ``down_wait_s``) and tries again."""
        deadline = time.monotonic() + self.down_wait_s
        while True:
            try:
                return await super().generate(*args, **kw)
            except RolloutServerError:
                if not await self.wait_for_server(deadline):
                    raise

    async def _broadcast(self, path: str, body: Optional[dict] = None, only=None,
                         method: str = "POST", timeout: Optional[float] = None) -> list:
        if only is None and not any(s.healthy for s in self.servers):
            await self.wait_for_server(time.monotonic() + self.down_wait_s)
        return await super()._broadcast(path, body, only=only, method=method, timeout=timeout)
