"""Relaunch tolerance for a rollout client: its servers may be relaunched (``launch.local``
restarts a killed rollout server on the same port).

A relaunched server boots with the base model. It must not get work until it serves the
current weights, so a server that was marked down is, once it answers its health check again,
first given the newest published weights directory (``<run_dir>/weights/vN``, the one the
trainer last exported: the current version, or the next one about to be announced) with its
version, and only then marked healthy. The trainer exports ``vN`` before it announces it, so a
broadcast of ``vN`` that a server missed while it was down is always on disk when that server
comes back; after loading, the newest directory is checked again (a newer one: load that too).

While no server is healthy, generation and control calls wait for one to come back (up to
``down_wait_s``) instead of failing the episode or the weight update.

:class:`RelaunchPolicy` is composed into a client as its hooks::

    client = RolloutClient(addrs, hooks=RelaunchPolicy(paths))

(the rollout worker's :class:`~areal_mega.rollout.server_pool.ElasticPool` composes one too).
"""

from __future__ import annotations

import logging
from typing import Optional

from areal_mega.rollout.hooks import ClientHooks
from areal_mega.rollout.lora_sync import load_published_into
from areal_mega.run_dir import RunDir

log = logging.getLogger(__name__)


class RelaunchPolicy(ClientHooks):
    """Client hooks that re-sync a returning server before dispatching to it.

    ``paths``: the run directory (where the published weights are); ``down_wait_s``: how long
    a call waits for some server to be healthy again. Counts the servers brought back in
    ``resyncs``; ``synced_version`` is the newest version a sync loaded."""

    serial_checks = True  # a returning server is re-synced once, not by two checks at once

    def __init__(self, paths: RunDir, down_wait_s: float = 120.0):
        self.paths = paths
        self.down_wait_s = float(down_wait_s)
        self.synced_version: Optional[int] = None
        self.resyncs = 0

    async def sync_server(self, client, addr: str) -> Optional[int]:
        """Load the newest published weights (and their version) into ``addr`` through
        ``client``; with none published it keeps what it has (a relaunched server: the base
        model, version 0). Returns the version loaded, or None."""
        seen = None
        while True:
            latest = self.paths.latest_weights()
            if latest is None or latest == seen:  # none published: the base model, v0
                return latest[0] if latest else None
            version, path = latest  # full weights, or a LoRA run's adapter
            await load_published_into(client, addr, path, version)
            self.synced_version = max(version, self.synced_version or 0)
            seen = latest

    async def sync_all(self, client) -> Optional[int]:
        """Bring every server of ``client`` to the newest published weights and let it generate
        (a relaunched worker calls this: its predecessor may have died with the servers
        paused). Returns the version they serve (None: none published, the base model)."""
        for addr in client.addrs:
            try:
                await self.sync_server(client, addr)
            except Exception as e:  # noqa: BLE001 - re-synced when it answers again
                client.mark_down(addr, e)
        await client.resume()  # waits for a server if none is up
        return self.synced_version

    async def probe(self, client, addr: str, healthy: bool, timeout: float) -> None:
        """``GET /health_generate``; a server that was down and answers again is re-synced
        (:meth:`sync_server`) before it is marked healthy."""
        await client.request(addr, "GET", "/health_generate", timeout=timeout)
        if not healthy:
            v = await self.sync_server(client, addr)
            self.resyncs += 1
            log.warning("rollout server %s is back; it serves version %s now", addr, v)
        client.mark_up(addr)
