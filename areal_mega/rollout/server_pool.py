"""Elastic rollout: servers join and leave the rollout worker's client while a run goes on.

:class:`ElasticPool` holds the worker's client (a plain
:class:`~areal_mega.rollout.client.RolloutClient` composed with the pool as its hooks). On top
of re-syncing relaunched servers (:class:`~areal_mega.rollout.relaunch.RelaunchPolicy`) it can

- **add** a server (:meth:`ElasticPool.add_server`): the server must answer ``/health``; it
  is brought to the controller's current weights and version (``<run_dir>/weights/v<version>``
  with that version, or just the version when the current weights are the base model at
  version 0) and only then joins the dispatch set, where the least-loaded pick gives it new
  requests at once;
- **remove** a server (:meth:`ElasticPool.remove_server`): it leaves the dispatch set first.
  With ``drain`` its in-flight requests finish there; without, they are aborted on it
  (``/abort_request``) and come back with ``finish_reason: abort`` and their partial output,
  which the controller resubmits to another server as prompt + partial output, the tokens
  already made keeping their versions (the same path as a weight-update interruption). The
  last dispatchable server cannot be removed.

A server that dies mid-request fails its HTTP call; the request is retried on another server
from the output the controller already holds (counted in ``resumptions``).

Counters: per-server requests and generated tokens, resumptions, joins and removals
(:meth:`ElasticPool.pool_stats`). :class:`ServerPoolCommands` answers the worker's control
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

from areal_mega.rollout.client import RolloutClient, RolloutRequestError
from areal_mega.rollout.hooks import ClientHooks
from areal_mega.rollout.lora_sync import load_published_into
from areal_mega.rollout.relaunch import RelaunchPolicy
from areal_mega.run_dir import RunDir

log = logging.getLogger(__name__)


NOT_GENERATING_YET = "the rollout worker is not generating yet"
"""In the answer to a pool command that came before the worker's first weights (at its start
or after a relaunch): callers with a deadline (``launch.scale``) retry it."""


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


class ElasticPool(ClientHooks):
    """The rollout worker's server set (see the module docstring): ``client`` is a
    :class:`~areal_mega.rollout.client.RolloutClient` composed with this pool as its hooks;
    the pool keeps joining (``pending``) and leaving servers out of dispatch, counts requests
    and tokens per server, and re-syncs relaunched servers through its
    :class:`~areal_mega.rollout.relaunch.RelaunchPolicy` (``relaunch``). ``client_kw`` go to
    the client, of class ``client_cls`` (:func:`areal_mega.backends.clients.client_class`
    picks it for ``rollout.backend``). All methods run on the controller's event loop."""

    serial_checks = True

    def __init__(
        self,
        addrs: list,
        *,
        paths: RunDir,
        down_wait_s: float = 120.0,
        client_cls: type = RolloutClient,
        **client_kw,
    ):
        self.relaunch = RelaunchPolicy(paths, down_wait_s)
        self.leaving: set = set()  # addresses out of dispatch (being removed)
        self.pending: set = set()  # joined, awaiting the group's next broadcast
        # distributed weight updates (set by the first begin_update): a relaunched server
        # cannot load weights from disk, so it comes back pending and the group is re-formed
        self.group_updates = False
        self.reform = False  # a relaunched member must rejoin the group
        self.requests: collections.Counter = collections.Counter()
        self.tokens: collections.Counter = collections.Counter()
        self.resumptions = 0
        self.joins = self.removals = 0
        self.client = client_cls(addrs, hooks=self, **client_kw)

    # ------------------------------------------------------------------ client hooks
    @property
    def down_wait_s(self) -> float:
        """The relaunch policy's wait for a server while none is healthy."""
        return self.relaunch.down_wait_s

    @property
    def paths(self) -> RunDir:
        """The run directory (published weights)."""
        return self.relaunch.paths

    def blocked(self) -> set:
        """Leaving and pending servers take no new requests."""
        return self.leaving | self.pending

    def generated(self, addr: str, out: dict) -> None:
        """Count a request and its tokens for ``addr``."""
        self.requests[addr] += 1
        self.tokens[addr] += len(out.get("output_ids") or ())

    def generate_failed(self, addr: str, error: BaseException) -> None:
        """A request failed on ``addr``; it is retried elsewhere from the output held."""
        self.resumptions += 1

    async def probe(self, client, addr: str, healthy: bool, timeout: float) -> None:
        """A live server is only checked for liveness. A server that answers again after
        being down (relaunched: it holds the base model) is re-synced from disk
        (:class:`RelaunchPolicy`), or, with distributed weight updates, becomes *pending*: no
        requests until the trainer's next update re-forms the group with it (``reform``) and
        broadcasts."""
        if healthy:
            # liveness only, probed every second: /get_model_info never generates (SGLang's
            # /health_generate and, by default, /health do) and answers while generation is
            # paused for an update; a slow answer is a busy server, not a dead one
            try:
                await client.request(addr, "GET", "/get_model_info", timeout=timeout)
            except asyncio.TimeoutError:
                pass
            return
        if not self.group_updates:
            return await self.relaunch.probe(client, addr, healthy, timeout)
        await client.request(addr, "GET", "/health_generate", timeout=timeout)
        self.pending.add(addr)
        self.reform = True
        self.relaunch.resyncs += 1
        client.mark_up(addr)
        log.warning(
            "rollout server %s is back; pending until the next weight broadcast "
            "re-forms the group with it",
            addr,
        )

    # ------------------------------------------------------------------ membership
    async def sync_all(self):
        """Bring every server to the newest published weights and let it generate
        (:meth:`RelaunchPolicy.sync_all`); returns their version (None: the base model)."""
        return await self.relaunch.sync_all(self.client)

    async def add_server(self, addr: str, version: int, via_group: bool = False) -> dict:
        """Bring the server at ``addr`` to weights ``version`` and start dispatching to it.
        With ``via_group`` (distributed weight updates) it joins as *pending*: no requests
        until the trainer, at its next update, forms the weight-update group again with it and
        broadcasts (:meth:`promote`). ``ServerPoolError`` (nothing changed) when it is already a
        member or does not answer ``/health``; returns ``{"addr", "version", "pending",
        "seconds"}`` (``version`` None while pending)."""
        url = normalize_addr(addr)
        if url in self.client.addrs:
            raise ServerPoolError(f"server {url} is already in the pool")
        t0 = time.monotonic()
        try:
            await self.client.request(url, "GET", "/health", timeout=5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RolloutRequestError) as e:
            raise ServerPoolError(
                f"server {url} is unreachable ({type(e).__name__}: {e}); the pool is unchanged"
            ) from None
        if via_group:
            self.pending.add(url)
        else:
            await self.sync_to_version(url, version)
            await self.client.request(
                url, "POST", "/continue_generation", {}, timeout=self.client.control_timeout_s
            )
        self.client.add_server(url)
        self.joins += 1
        log.info(
            "rollout server %s joined %s (%d servers)",
            url,
            "pending the next weight broadcast" if via_group else f"at version {version}",
            len(self.client.addrs),
        )
        return {
            "addr": url,
            "version": None if via_group else version,
            "pending": via_group,
            "seconds": time.monotonic() - t0,
        }

    def group_members(self) -> list:
        """The servers the weight-update group must hold now: all but leaving ones and those
        down (a dead rank would stall the broadcast; it rejoins once relaunched)."""
        return [a for a in self.client.live_servers() if a not in self.leaving]

    def probe_due(self) -> bool:
        """Whether the worker's once-a-second health check should run: always, so that a
        killed server is noticed even when no request of it failed (the staleness bound may
        hold every request back). Otherwise a relaunched server would be taken for the old
        one and serve the base model under the current version."""
        return bool(self.client.addrs)

    def promote(self, addrs: list) -> None:
        """``addrs`` received the broadcast of the current version: dispatch to them."""
        for a in addrs:
            if a in self.pending:
                self.pending.discard(a)
                log.info("rollout server %s serves the current weights; dispatching to it", a)

    async def sync_to_version(self, addr: str, version: int) -> None:
        """Load the weights of ``version`` into ``addr`` and set its version: the published
        directory ``weights/v<version>`` when there is one, the base model (which a fresh
        server already holds) at version 0; otherwise ``ServerPoolError``."""
        path = self.paths.weights_dir(version)
        timeout = self.client.control_timeout_s
        if path.is_dir():  # full weights, or a LoRA run's adapter
            await load_published_into(self.client, addr, path, version)
        elif version == 0:
            await self.client.request(
                addr, "POST", "/update_weight_version", {"new_version": "0"}, timeout=timeout
            )
        else:
            raise ServerPoolError(
                f"no published weights for version {version} ({path}); "
                "cannot bring a new server to the current version"
            )

    async def remove_server(self, addr: str, drain: bool, drain_timeout_s: float = 600.0) -> dict:
        """Take ``addr`` out of dispatch, then drain it (wait for its in-flight requests) or
        abort them (they resume elsewhere), and forget it. ``ServerPoolError`` (nothing
        changed) for an unknown address or the last dispatchable server. A drain still
        unfinished after ``drain_timeout_s`` is cut short: the rest is aborted. Returns
        ``{"addr", "aborted", "drained", "drain_timed_out", "seconds"}``."""
        url = normalize_addr(addr)
        client = self.client
        if url not in client.addrs:
            raise ServerPoolError(
                f"server {url} is not in the pool (members: {', '.join(client.addrs)})"
            )
        others = [a for a in client.dispatchable() if a != url]
        if not others:
            raise ServerPoolError(
                f"server {url} is the last server that can take requests; "
                "add another before removing it"
            )
        t0 = time.monotonic()
        self.leaving.add(url)
        aborted = 0
        timed_out = False
        try:
            if drain:
                deadline = time.monotonic() + drain_timeout_s
                while client.inflight(url) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            if client.inflight(url) > 0:
                timed_out = bool(drain)
                try:
                    out = await client.request(
                        url, "POST", "/abort_request", {"abort_all": True}, timeout=10.0
                    )
                    aborted = int(out.get("num_aborted", 0) or 0)
                except Exception as e:  # noqa: BLE001 - a dead server's requests fail over
                    log.warning("abort on leaving server %s failed: %s", url, e)
                while client.inflight(url) > 0:  # the aborted requests come back
                    await asyncio.sleep(0.05)
        finally:
            client.remove_server(url)
            self.leaving.discard(url)
            self.pending.discard(url)
        self.resumptions += aborted
        self.removals += 1
        log.info(
            "rollout server %s removed (%s, %d aborted; %d servers left)",
            url,
            "drained" if drain else "interrupted",
            aborted,
            len(client.addrs),
        )
        return {
            "addr": url,
            "aborted": aborted,
            "drained": bool(drain) and not timed_out,
            "drain_timed_out": timed_out,
            "seconds": time.monotonic() - t0,
        }

    def pool_stats(self) -> dict:
        """Live servers, per-server requests / tokens, resumptions, joins, removals."""
        c = self.client
        return {
            "servers": [
                {
                    "addr": a,
                    "healthy": c.is_healthy(a),
                    "inflight": c.inflight(a),
                    "leaving": a in self.leaving,
                    "pending": a in self.pending,
                    "requests": self.requests[a],
                    "tokens": self.tokens[a],
                }
                for a in c.addrs
            ],
            "live_servers": len(c.dispatchable()),
            "resumptions": self.resumptions,
            "joins": self.joins,
            "removals": self.removals,
        }


def pool_metrics(stats: dict) -> dict:
    """Flat ``rollout/*`` scalars of :meth:`ElasticPool.pool_stats` for the metrics row:
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

    - ``{"cmd": "servers"}`` -> :meth:`ElasticPool.pool_stats`;
    - ``{"cmd": "add_server", "addr": "host:port", "via_group": bool}`` -> join at the current
      version (from disk), or pending the next broadcast (distributed weight updates);
    - ``{"cmd": "remove_server", "addr": "host:port", "drain": bool, "drain_timeout_s": T}``
      (T optional: at most ``timeout_s``).

    With distributed weight updates the worker calls :meth:`begin_update` /
    :meth:`end_update` around the trainer's broadcast: the trainer forms its group with the
    members :meth:`begin_update` names, and :meth:`end_update` lets those pending members take
    requests. Between the two a removal is refused (retry): the server is a rank of the group.

    ``controller`` is a callable returning the running
    :class:`~areal_mega.rollout.controller.RolloutController` or None (not generating yet:
    membership changes are refused with a clear error, retry later)."""

    COMMANDS = ("servers", "add_server", "remove_server")

    def __init__(self, pool: ElasticPool, controller, timeout_s: float = 600.0):
        self.pool = pool
        self.controller = controller
        self.timeout_s = timeout_s
        self._in_group: Optional[list] = None  # members named to the open update

    def begin_update(self) -> dict:
        """A broadcast update starts: the members the trainer's group must hold (probed
        first, so a dead server is left out), and ``reform``: a member was relaunched, so the
        group must be formed again even if the list is unchanged."""
        self.pool.group_updates = True
        ctl = self.controller()
        if ctl is not None:
            ctl.run_async(self.pool.client.check_health(5.0)).result(60)
        self._in_group = self.pool.group_members()
        reform, self.pool.reform = self.pool.reform, False
        return {"servers": list(self._in_group), "reform": reform}

    def end_update(self) -> None:
        """The broadcast reached the members named by :meth:`begin_update`."""
        if self._in_group is not None:
            self.pool.promote(self._in_group)
        self._in_group = None

    def handle(self, msg: dict) -> dict:
        """Answer one command; raises ``ServerPoolError`` / ``ValueError`` for bad requests."""
        cmd = msg["cmd"]
        ctl = self.controller()
        if cmd == "servers":
            return self.pool.pool_stats()
        if ctl is None:
            raise ServerPoolError(
                f"{cmd}: {NOT_GENERATING_YET} (it waits for the trainer's first weights); "
                "retry shortly"
            )
        addr = msg.get("addr")
        if not isinstance(addr, str) or not addr:
            raise ServerPoolError(f"{cmd}: field 'addr' (host:port) is required")
        if cmd == "add_server":
            coro = self.pool.add_server(addr, ctl.version, bool(msg.get("via_group", False)))
        elif cmd == "remove_server":
            if self._in_group is not None:
                raise ServerPoolError(
                    "remove_server: a weight broadcast is in progress and the "
                    "server is a rank of its group; retry after it"
                )
            limit = msg.get("drain_timeout_s")  # the launcher's operation deadline
            limit = (
                self.timeout_s
                if not isinstance(limit, (int, float))
                else min(self.timeout_s, max(0.0, float(limit)))
            )
            coro = self.pool.remove_server(
                addr, bool(msg.get("drain", False)), drain_timeout_s=limit
            )
        else:
            raise ValueError(f"unknown server-pool command {cmd!r}")
        return ctl.run_async(coro).result(self.timeout_s + 30)
