"""Elastic rollout: servers join and leave the rollout worker's client while a run goes on.

:class:`ElasticClient` is the worker's client. On top of re-syncing relaunched servers
(:class:`~areal_mega.rollout.relaunch.RelaunchTolerantClient`) it can

- **add** a server (:meth:`ElasticClient.add_server`): the server must answer ``/health``; it
  is brought to the controller's current weights and version (``<run_dir>/weights/v<version>``
  with that version, or just the version when the current weights are the base model at
  version 0) and only then joins the dispatch set, where the least-loaded pick gives it new
  requests at once;
- **remove** a server (:meth:`ElasticClient.remove_server`): it leaves the dispatch set first.
  With ``drain`` its in-flight requests finish there; without, they are aborted on it
  (``/abort_request``) and come back with ``finish_reason: abort`` and their partial output,
  which the controller resubmits to another server as prompt + partial output, the tokens
  already made keeping their versions (the same path as a weight-update interruption). The
  last dispatchable server cannot be removed.

A server that dies mid-request fails its HTTP call; the request is retried on another server
from the output the controller already holds (counted in ``resumptions``).

Counters: per-server requests and generated tokens, resumptions, joins and removals
(:meth:`ElasticClient.pool_stats`). :class:`ServerPoolCommands` answers the worker's control
commands ``servers``, ``add_server`` and ``remove_server``; membership changes are applied on
the controller's event loop, between weight updates (the control channel runs one command
at a time), so no server misses an update or serves a request at a version it does not hold.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Optional

import aiohttp

from areal_mega.rollout.client import RolloutRequestError, _Server
from areal_mega.rollout.relaunch import RelaunchTolerantClient

log = logging.getLogger(__name__)


class ServerPoolError(ValueError):
    """A membership request that cannot be applied (unknown server, unreachable address,
    removing the last server, a duplicate); nothing was changed."""


def normalize_addr(addr: str) -> str:
    """``host:port`` or a URL -> the client's URL form ``http://host:port``; ``ServerPoolError``
    for anything without a numeric port."""
    a = str(addr).strip()
    url = a if a.startswith("http") else f"http://{a}"
    host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServerPoolError(f"server address {addr!r}: expected host:port")
    return url.rstrip("/")


class ElasticClient(RelaunchTolerantClient):
    """A :class:`RelaunchTolerantClient` whose server list changes at run time (see the module
    docstring). All methods run on the controller's event loop."""

    def __init__(self, addrs: list, **kw):
        super().__init__(addrs, **kw)
        self.leaving: set = set()               # addresses out of dispatch (being removed)
        self.pending: set = set()               # joined, awaiting the group's next broadcast
        # distributed weight updates (set by the first begin_update): a relaunched server
        # cannot load weights from disk, so it comes back pending and the group is re-formed
        self.group_updates = False
        self.reform = False                     # a relaunched member must rejoin the group
        self.requests: collections.Counter = collections.Counter()
        self.tokens: collections.Counter = collections.Counter()
        self.resumptions = 0
        self.joins = self.removals = 0

    # ------------------------------------------------------------------ dispatch hooks
    def _pick(self, sticky_key: Optional[str], exclude: set):
        return super()._pick(sticky_key, exclude | self.leaving | self.pending)

    def dispatchable(self) -> list:
        """Addresses that may get new requests (healthy and not being removed)."""
        return [s.addr for s in self.servers if s.healthy and s.addr not in self.leaving
                and s.addr not in self.pending]

    async def _call(self, srv, method: str, path: str, body: Optional[dict] = None,
                    timeout: Optional[float] = None) -> dict:
        try:
            out = await super()._call(srv, method, path, body, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            if path == "/generate":
                self.resumptions += 1          # retried elsewhere from the output held
            raise
        if path == "/generate":
            self.requests[srv.addr] += 1
            self.tokens[srv.addr] += len(out.get("output_ids") or ())
        return out

    def _find(self, addr: str):
        for s in self.servers:
            if s.addr == addr:
                return s
        return None

    # ------------------------------------------------------------------ membership
    async def add_server(self, addr: str, version: int, via_group: bool = False) -> dict:
        """Bring the server at ``addr`` to weights ``version`` and start dispatching to it.
        With ``via_group`` (distributed weight updates) it joins as *pending*: no requests
        until the trainer, at its next update, forms the weight-update group again with it and
        broadcasts (:meth:`promote`). ``ServerPoolError`` (nothing changed) when it is already a
        member or does not answer ``/health``; returns ``{"addr", "version", "pending",
        "seconds"}`` (``version`` None while pending)."""
        url = normalize_addr(addr)
        if self._find(url) is not None:
            raise ServerPoolError(f"server {url} is already in the pool")
        t0 = time.monotonic()
        srv = _Server(url)
        try:
            await self._call(srv, "GET", "/health", timeout=5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RolloutRequestError) as e:
            raise ServerPoolError(f"server {url} is unreachable ({type(e).__name__}: {e}); "
                                  "the pool is unchanged") from None
        if via_group:
            self.pending.add(url)
        else:
            await self.sync_to_version(srv, version)
            await self._call(srv, "POST", "/continue_generation", {},
                             timeout=self.control_timeout_s)
        self.servers.append(srv)
        self.joins += 1
        log.info("rollout server %s joined %s (%d servers)", url, "pending the next weight "
                 "broadcast" if via_group else f"at version {version}", len(self.servers))
        return {"addr": url, "version": None if via_group else version, "pending": via_group,
                "seconds": time.monotonic() - t0}

    def group_members(self) -> list:
        """The servers the weight-update group must hold now: all but leaving ones and those
        down (a dead rank would stall the broadcast; it rejoins once relaunched)."""
        return [s.addr for s in self.servers if s.addr not in self.leaving and s.healthy]

    def probe_due(self) -> bool:
        """Whether the worker's once-a-second health check should run: always, so that a
        killed server is noticed even when no request of it failed (the staleness bound may
        hold every request back). Otherwise a relaunched server would be taken for the old
        one and serve the base model under the current version."""
        return bool(self.servers)

    async def _check_one(self, srv, timeout: float) -> bool:
        """A live server is only checked for liveness. A server that answers again after
        being down (relaunched: it holds the base model) is re-synced from disk
        (:class:`RelaunchTolerantClient`), or, with distributed weight updates, becomes
        *pending*: no requests until the trainer's next update re-forms the group with it
        (``reform``) and broadcasts."""
        if srv.healthy:
            # liveness only, probed every second: /get_model_info never generates (SGLang's
            # /health_generate and, by default, /health do) and answers while generation is
            # paused for an update; a slow answer is a busy server, not a dead one
            try:
                await self._call(srv, "GET", "/get_model_info", timeout=timeout)
            except asyncio.TimeoutError:
                return True
            except Exception as e:  # noqa: BLE001 - killed or unreachable
                self._mark_down(srv, e)
                return False
            return True
        if not self.group_updates:
            return await super()._check_one(srv, timeout)
        try:
            await self._call(srv, "GET", "/health_generate", timeout=timeout)
        except Exception as e:  # noqa: BLE001 - still down (or booting)
            self._mark_down(srv, e)
            return False
        self.pending.add(srv.addr)
        self.reform = True
        self.resyncs += 1
        srv.healthy = True
        log.warning("rollout server %s is back; pending until the next weight broadcast "
                    "re-forms the group with it", srv.addr)
        return True

    def promote(self, addrs: list) -> None:
        """``addrs`` received the broadcast of the current version: dispatch to them."""
        for a in addrs:
            if a in self.pending:
                self.pending.discard(a)
                log.info("rollout server %s serves the current weights; dispatching to it", a)

    async def sync_to_version(self, srv, version: int) -> None:
        """Load the weights of ``version`` into ``srv`` and set its version: the published
        directory ``weights/v<version>`` when there is one, the base model (which a fresh
        server already holds) at version 0; otherwise ``ServerPoolError``."""
        path = self.paths.weights_dir(version)
        if path.is_dir():
            await self._call(srv, "POST", "/update_weights_from_disk",
                             {"model_path": str(path), "abort_all_requests": False,
                              "weight_version": str(version)}, timeout=self.control_timeout_s)
        elif version == 0:
            await self._call(srv, "POST", "/update_weight_version", {"new_version": "0"},
                             timeout=self.control_timeout_s)
        else:
            raise ServerPoolError(f"no published weights for version {version} ({path}); "
                                  "cannot bring a new server to the current version")

    async def remove_server(self, addr: str, drain: bool, drain_timeout_s: float = 600.0) -> dict:
        """Take ``addr`` out of dispatch, then drain it (wait for its in-flight requests) or
        abort them (they resume elsewhere), and forget it. ``ServerPoolError`` (nothing
        changed) for an unknown address or the last dispatchable server. Returns
        ``{"addr", "aborted", "drained", "seconds"}``."""
        url = normalize_addr(addr)
        srv = self._find(url)
        if srv is None:
            raise ServerPoolError(f"server {url} is not in the pool (members: "
                                  f"{', '.join(s.addr for s in self.servers)})")
        others = [a for a in self.dispatchable() if a != url]
        if not others:
            raise ServerPoolError(f"server {url} is the last server that can take requests; "
                                  "add another before removing it")
        t0 = time.monotonic()
        self.leaving.add(url)
        aborted = 0
        try:
            if drain:
                deadline = time.monotonic() + drain_timeout_s
                while srv.inflight > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            if srv.inflight > 0:
                try:
                    out = await self._call(srv, "POST", "/abort_request", {"abort_all": True},
                                           timeout=10.0)
                    aborted = int(out.get("num_aborted", 0) or 0)
                except Exception as e:  # noqa: BLE001 - a dead server's requests fail over
                    log.warning("abort on leaving server %s failed: %s", url, e)
                while srv.inflight > 0:        # the aborted requests come back
                    await asyncio.sleep(0.05)
        finally:
            self.servers.remove(srv)
            self.leaving.discard(url)
            self.pending.discard(url)
            for k, s in list(self._sticky.items()):
                if s is srv:
                    del self._sticky[k]
        self.resumptions += aborted
        self.removals += 1
        log.info("rollout server %s removed (%s, %d aborted; %d servers left)", url,
                 "drained" if drain else "interrupted", aborted, len(self.servers))
        return {"addr": url, "aborted": aborted, "drained": bool(drain),
                "seconds": time.monotonic() - t0}

    def pool_stats(self) -> dict:
        """Live servers, per-server requests / tokens, resumptions, joins, removals."""
        return {"servers": [{"addr": s.addr, "healthy": s.healthy, "inflight": s.inflight,
                             "leaving": s.addr in self.leaving,
                             "pending": s.addr in self.pending,
                             "requests": self.requests[s.addr], "tokens": self.tokens[s.addr]}
                            for s in self.servers],
                "live_servers": len(self.dispatchable()), "resumptions": self.resumptions,
                "joins": self.joins, "removals": self.removals}


def pool_metrics(stats: dict) -> dict:
    """Flat ``rollout/*`` scalars of :meth:`ElasticClient.pool_stats` for the metrics row:
    ``rollout/servers`` (live), ``rollout/resumptions``, and per server (its address with
    ``.`` and ``:`` as ``_``) ``rollout/server/<addr>/requests`` and ``.../tokens`` (pure)."""
    out = {"rollout/servers": stats["live_servers"], "rollout/resumptions": stats["resumptions"]}
    for s in stats["servers"]:
        key = s["addr"].split("://", 1)[-1].replace(".", "_").replace(":", "_")
        out[f"rollout/server/{key}/requests"] = s["requests"]
        out[f"rollout/server/{key}/tokens"] = s["tokens"]
    return out


class ServerPoolCommands:
    """The worker's membership commands (see :mod:`areal_mega.dataplane.control`):

    - ``{"cmd": "servers"}`` -> :meth:`ElasticClient.pool_stats`;
    - ``{"cmd": "add_server", "addr": "host:port", "via_group": bool}`` -> join at the current
      version (from disk), or pending the next broadcast (distributed weight updates);
    - ``{"cmd": "remove_server", "addr": "host:port", "drain": bool}``.

    With distributed weight updates the worker calls :meth:`begin_update` /
    :meth:`end_update` around the trainer's broadcast: the trainer forms its group with the
    members :meth:`begin_update` names, and :meth:`end_update` lets those pending members take
    requests. Between the two a removal is refused (retry): the server is a rank of the group.

    ``controller`` is a callable returning the running
    :class:`~areal_mega.rollout.controller.RolloutController` or None (not generating yet:
    membership changes are refused with a clear error, retry later)."""

    COMMANDS = ("servers", "add_server", "remove_server")

    def __init__(self, client: ElasticClient, controller, timeout_s: float = 600.0):
        self.client = client
        self.controller = controller
        self.timeout_s = timeout_s
        self._in_group: Optional[list] = None    # members named to the open update

    def begin_update(self) -> dict:
        """A broadcast update starts: the members the trainer's group must hold (probed
        first, so a dead server is left out), and ``reform``: a member was relaunched, so the
        group must be formed again even if the list is unchanged."""
        self.client.group_updates = True
        ctl = self.controller()
        if ctl is not None:
            ctl.run_async(self.client.check_health(5.0)).result(60)
        self._in_group = self.client.group_members()
        reform, self.client.reform = self.client.reform, False
        return {"servers": list(self._in_group), "reform": reform}

    def end_update(self) -> None:
        """The broadcast reached the members named by :meth:`begin_update`."""
        if self._in_group is not None:
            self.client.promote(self._in_group)
        self._in_group = None

    def handle(self, msg: dict) -> dict:
        """Answer one command; raises ``ServerPoolError`` / ``ValueError`` for bad requests."""
        cmd = msg["cmd"]
        ctl = self.controller()
        if cmd == "servers":
            return self.client.pool_stats()
        if ctl is None:
            raise ServerPoolError(f"{cmd}: the rollout worker is not generating yet (it waits "
                                  "for the trainer's first weights); retry shortly")
        addr = msg.get("addr")
        if not isinstance(addr, str) or not addr:
            raise ServerPoolError(f"{cmd}: field 'addr' (host:port) is required")
        if cmd == "add_server":
            coro = self.client.add_server(addr, ctl.version, bool(msg.get("via_group", False)))
        elif cmd == "remove_server":
            if self._in_group is not None:
                raise ServerPoolError("remove_server: a weight broadcast is in progress and the "
                                      "server is a rank of its group; retry after it")
            coro = self.client.remove_server(addr, bool(msg.get("drain", False)),
                                             drain_timeout_s=self.timeout_s)
        else:
            raise ValueError(f"unknown server-pool command {cmd!r}")
        return ctl.run_async(coro).result(self.timeout_s + 30)
