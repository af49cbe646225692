"""aiohttp client for SGLang's native HTTP API (and the CPU local server, which speaks it too).

One :class:`RolloutClient` talks to several servers:
- ``generate`` goes to the least-loaded healthy server; a ``sticky_key`` (e.g. the episode's rid)
  keeps resubmissions of one request on the same server while it is healthy;
- a connection error, timeout or 5xx marks the server down and the request is retried on another
  server after an exponential backoff (``retries`` times); nothing is dropped. HTTP 4xx is the
  caller's fault and raises :class:`RolloutRequestError` at once;
- control calls (pause, continue, weight updates, LoRA adapter loads, flush) go to every live
  server. A LoRA trainer swaps each published version with ``pause``, ``load_lora_adapter``,
  ``unload_lora_adapter`` (the old one), ``resume``, then resubmits with the new name.

The server set is public (:attr:`RolloutClient.addrs`, ``set_servers``, ``add_server``,
``remove_server``). What varies between uses is composed in, not subclassed: the
:class:`~areal_mega.rollout.hooks.ClientHooks` given at construction choose which servers take
new requests, how a server is probed (and brought back), whether calls wait while none is up,
and observe each ``/generate``: :class:`~areal_mega.rollout.relaunch.RelaunchPolicy` and
:class:`~areal_mega.rollout.server_pool.ElasticPool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

import aiohttp

from areal_mega.rollout.generate_result import (
    GenerateResult,
    RolloutRequestError,
    RolloutServerError,
    check_prompt_tokens,
    generate_body,
    parse_generate_answer,
    sampling_dict,
)
from areal_mega.rollout.hooks import ClientHooks

__all__ = [
    "GenerateResult",
    "RolloutClient",
    "RolloutRequestError",
    "RolloutServerError",
    "sampling_dict",
    "server_url",
]

log = logging.getLogger(__name__)


def server_url(addr: str) -> str:
    """``host:port`` or a URL -> the URL form the client keys its servers by."""
    return addr if addr.startswith("http") else f"http://{addr}"


@dataclass
class _Server:
    addr: str
    inflight: int = 0
    healthy: bool = True
    down_since: float = 0.0
    failures: int = 0


class RolloutClient:
    """Async client for one or more SGLang-compatible servers (``host:port`` or URLs).

    ``hooks`` (a :class:`ClientHooks`, default the plain behaviour) is what a relaunch-tolerant
    or elastic client adds; see the module docstring."""

    def __init__(
        self,
        addrs: list,
        api_key: Optional[str] = None,
        timeout_s: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        control_timeout_s: float = 600.0,
        hooks: Optional[ClientHooks] = None,
    ):
        if not addrs:
            raise ValueError("RolloutClient: need at least one server address")
        self._servers = [_Server(server_url(a)) for a in addrs]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.hooks = hooks if hooks is not None else ClientHooks()
        self._sticky: dict[str, _Server] = {}
        self._session: Optional[aiohttp.ClientSession] = None
        self._health_lock: Optional[asyncio.Lock] = None
        # the LoRA adapter every generate uses unless told otherwise: a LoRA run's current
        # policy (set by areal_mega.rollout.lora_sync); None: the base model
        self.lora_name: Optional[str] = None

    # ------------------------------------------------------------------ the server set
    @property
    def addrs(self) -> list:
        """Member URLs, in order."""
        return [s.addr for s in self._servers]

    def set_servers(self, addrs: list) -> None:
        """Make ``addrs`` the members, in this order, as a fresh client would hold them: every
        one healthy with nothing in flight, sticky bindings forgotten. For a client between
        uses, e.g. the trainer's weight sender forming its group again."""
        if not addrs:
            raise ValueError("set_servers: need at least one server address")
        self._servers = [_Server(server_url(a)) for a in addrs]
        self._sticky.clear()

    def add_server(self, addr: str) -> str:
        """Append ``addr`` as a healthy member (it may be picked at once unless the hooks block
        it); returns its URL. ``ValueError`` if it is already a member."""
        if self._find(addr) is not None:
            raise ValueError(f"server {server_url(addr)} is already a member")
        self._servers.append(_Server(server_url(addr)))
        return server_url(addr)

    def remove_server(self, addr: str) -> None:
        """Forget the member ``addr`` and the sticky bindings to it (requests still in flight
        there finish or fail as they would). ``ValueError`` if it is not a member."""
        srv = self._find(addr)
        if srv is None:
            raise ValueError(f"server {server_url(addr)} is not a member")
        self._servers.remove(srv)
        for k, s in list(self._sticky.items()):
            if s is srv:
                del self._sticky[k]

    def is_healthy(self, addr: str) -> bool:
        """Whether the member ``addr`` is considered healthy (False for a non-member)."""
        srv = self._find(addr)
        return srv is not None and srv.healthy

    def inflight(self, addr: str) -> int:
        """Requests of this client in flight on ``addr`` (0 for a non-member)."""
        srv = self._find(addr)
        return srv.inflight if srv is not None else 0

    def mark_down(self, addr: str, err: BaseException) -> None:
        """Take the member ``addr`` out of use until a health check brings it back (a
        non-member is ignored: it may have been removed meanwhile)."""
        srv = self._find(addr)
        if srv is not None:
            self._mark_down(srv, err)

    def mark_up(self, addr: str) -> None:
        """Let the member ``addr`` take requests again (a non-member is ignored)."""
        srv = self._find(addr)
        if srv is not None:
            srv.healthy = True

    def _find(self, addr: str) -> Optional[_Server]:
        url = server_url(addr)
        for s in self._servers:
            if s.addr == url:
                return s
        return None

    # ------------------------------------------------------------------ plumbing
    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def close(self) -> None:
        """Close the HTTP session (and forget the lock of the loop it ran on)."""
        self._health_lock = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        addr: str,
        method: str,
        path: str,
        body: Optional[dict] = None,
        timeout: Optional[float] = None,
    ) -> dict:
        """One HTTP call to ``addr`` (a member or not) with this client's session and key;
        returns the JSON answer (``{}`` when empty). HTTP 4xx raises
        :class:`RolloutRequestError`, 5xx ``aiohttp.ClientResponseError``; connection errors
        and timeouts propagate. Touches no health flag."""
        url = server_url(addr)
        sess = await self._sess()
        to = aiohttp.ClientTimeout(total=timeout or self.timeout_s)
        async with sess.request(method, url + path, json=body, timeout=to) as resp:
            text = await resp.text()
            if resp.status >= 400:
                msg = text
                try:  # SGLang's error object, or a LoRA call's error_message
                    j = await resp.json(content_type=None)
                    msg = j["error"]["message"] if "error" in j else j["error_message"]
                except Exception:  # noqa: BLE001 - keep the raw text
                    pass
                if 400 <= resp.status < 500:
                    raise RolloutRequestError(
                        f"{url}{path}: HTTP {resp.status}: {msg}", status=resp.status
                    )
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=f"{msg}"[:500]
                )
            if not text:
                return {}
            try:
                return json.loads(text)
            except ValueError:
                return {"text": text}

    def _mark_down(self, srv: _Server, err: BaseException) -> None:
        if srv.healthy:
            log.warning("rollout server %s marked down: %s", srv.addr, err)
        srv.healthy, srv.down_since = False, time.monotonic()
        srv.failures += 1

    def live_servers(self) -> list:
        """Addresses of servers currently considered healthy."""
        return [s.addr for s in self._servers if s.healthy]

    def dispatchable(self) -> list:
        """Addresses that may get new requests: healthy and not blocked by the hooks."""
        blocked = self.hooks.blocked()
        return [s.addr for s in self._servers if s.healthy and s.addr not in blocked]

    def _pick(self, sticky_key: Optional[str], exclude: set) -> Optional[_Server]:
        exclude = exclude | self.hooks.blocked()
        s = self._sticky.get(sticky_key) if sticky_key else None
        if s is not None and s.healthy and s.addr not in exclude:
            return s
        cands = [s for s in self._servers if s.healthy and s.addr not in exclude] or [
            s for s in self._servers if s.healthy
        ]
        if not cands:
            return None
        s = min(cands, key=lambda x: x.inflight)
        if sticky_key:
            self._sticky[sticky_key] = s
        return s

    def sibling(self, addrs: list) -> "RolloutClient":
        """A new client of this kind and key for ``addrs``, with plain hooks."""
        return type(self)(addrs, api_key=self.api_key, control_timeout_s=self.control_timeout_s)

    def release(self, sticky_key: str) -> None:
        """Forget the server binding of ``sticky_key`` (call when an episode ends)."""
        self._sticky.pop(sticky_key, None)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        input_ids: list,
        sampling_params: dict,
        rid: Optional[str] = None,
        sticky_key: Optional[str] = None,
        return_routed_experts: bool = False,
        routes_from: int = 0,
        lora_path: Optional[str] = None,
        image_data: Optional[list] = None,
    ) -> GenerateResult:
        """``POST /generate`` with logprobs on the least-loaded server, retrying elsewhere on
        failure. Returns the parsed result (``finish_type`` is stop/length/abort). When every
        try failed for want of a server and ``hooks.down_wait_s`` is set, waits up to that
        long for one to come back (:meth:`wait_for_server`) and tries again.
        ``return_routed_experts``: ask for SGLang's routes (``GenerateResult.routed_experts``,
        still encoded), from position ``routes_from`` on (``routed_experts_start_len``).
        ``lora_path``: the name of a loaded LoRA adapter to generate with (default
        :attr:`lora_name`; None there too: the base model). ``image_data``: the prompt's
        images, one string each in order (see
        :func:`~areal_mega.rollout.generate_result.generate_body`), with ``input_ids`` the
        processor-expanded prompt."""
        body = generate_body(
            input_ids,
            sampling_params,
            rid,
            return_routed_experts,
            routes_from,
            lora_path if lora_path is not None else self.lora_name,
            image_data,
        )
        wait_s = self.hooks.down_wait_s
        deadline = time.monotonic() + (wait_s or 0.0)
        while True:
            try:
                res = await self._generate(body, sticky_key or rid)
                if image_data:
                    check_prompt_tokens(res, len(input_ids))
                return res
            except RolloutServerError:
                if wait_s is None or not await self.wait_for_server(deadline):
                    raise

    async def _generate(self, body: dict, key: Optional[str]) -> GenerateResult:
        tried: set = set()
        last: Optional[BaseException] = None
        for attempt in range(self.retries + 1):
            srv = self._pick(key, tried)
            if srv is None:
                await self.check_health()
                srv = self._pick(key, tried)
            if srv is None:
                last = last or RolloutServerError("no healthy rollout server")
                await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            srv.inflight += 1
            try:
                out = await self.request(srv.addr, "POST", "/generate", body)
            except RolloutRequestError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.hooks.generate_failed(srv.addr, e)
                last = e
                self._mark_down(srv, e)
                tried.add(srv.addr)
                if key:
                    self._sticky.pop(key, None)
                await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            finally:
                srv.inflight -= 1
            self.hooks.generated(srv.addr, out)
            return parse_generate_answer(out, srv.addr)
        raise RolloutServerError(f"generate failed after {self.retries + 1} attempts: {last}")

    async def abort(self, rid: Optional[str] = None) -> None:
        """``POST /abort_request`` for ``rid`` (on its server), or abort all when None."""
        body = {"rid": rid} if rid else {"abort_all": True}
        srv = self._sticky.get(rid) if rid else None
        await self._broadcast("/abort_request", body, only=[srv] if srv else None)

    # ------------------------------------------------------------------ control plane
    async def _broadcast(
        self,
        path: str,
        body: Optional[dict] = None,
        only=None,
        method: str = "POST",
        timeout: Optional[float] = None,
    ) -> list:
        wait_s = self.hooks.down_wait_s
        if only is None and wait_s is not None and not any(s.healthy for s in self._servers):
            await self.wait_for_server(time.monotonic() + wait_s)
        targets = only or [s for s in self._servers if s.healthy]
        if not targets:
            raise RolloutServerError(f"{path}: no healthy rollout server")

        async def one(s: _Server):
            try:
                return await self.request(
                    s.addr, method, path, body, timeout=timeout or self.control_timeout_s
                )
            except RolloutRequestError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(s, e)
                return None

        return await asyncio.gather(*(one(s) for s in targets))

    async def pause(self) -> None:
        """``POST /pause_generation``: in-flight requests return ``abort`` with partial output."""
        await self._broadcast("/pause_generation", {})

    async def resume(self) -> None:
        """``POST /continue_generation`` on every live server."""
        await self._broadcast("/continue_generation", {})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: Optional[int] = None
    ) -> None:
        """``POST /update_weights_from_disk`` on every live server."""
        body: dict = {"model_path": model_path, "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._broadcast("/update_weights_from_disk", body)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> list:
        """SGLang's ``POST /load_lora_adapter`` on every live server; returns the answers
        (``success``, ``error_message``, ``loaded_adapters``); a refusal (HTTP 400) raises
        :class:`RolloutRequestError` carrying the server's answer."""
        return await self._broadcast(
            "/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": lora_path, "pinned": bool(pinned)},
        )

    async def unload_lora_adapter(self, lora_name: str) -> list:
        """``POST /unload_lora_adapter`` on every live server (each answers once no request
        uses the adapter); raises on a refusal like :meth:`load_lora_adapter`."""
        return await self._broadcast("/unload_lora_adapter", {"lora_name": lora_name})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        rank_offsets: list,
    ) -> None:
        """``POST /init_weights_update_group``: server i joins as ranks from
        ``rank_offsets[i]`` (rank 0 is the trainer's sender)."""
        if len(rank_offsets) != len(self._servers):
            raise ValueError(f"rank_offsets: {len(rank_offsets)} for {len(self._servers)} servers")

        async def one(i: int, s: _Server):
            return await self.request(
                s.addr,
                "POST",
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": rank_offsets[i],
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
                timeout=self.control_timeout_s,
            )

        await asyncio.gather(*(one(i, s) for i, s in enumerate(self._servers)))

    async def update_weights_from_distributed(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        group_name: str,
        weight_version: Optional[int] = None,
    ) -> None:
        """``POST /update_weights_from_distributed`` to every server (the trainer broadcasts
        the tensors over the group while these requests are in flight)."""
        body: dict = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await asyncio.gather(
            *(
                self.request(
                    s.addr,
                    "POST",
                    "/update_weights_from_distributed",
                    body,
                    timeout=self.control_timeout_s,
                )
                for s in self._servers
            )
        )

    async def weights_received(self, weight_version: Optional[int] = None) -> None:
        """After the last bucket of a version: nothing on SGLang, which loads each bucket as
        it lands (a backend that loads the version at once does it here)."""

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """``POST /destroy_weights_update_group`` on every live server (before the group is
        formed again with other members). Every server's answer is awaited before the first
        error (e.g. a relaunched server that holds no group) is raised, so none is still
        destroying while the group is formed again."""
        targets = [s for s in self._servers if s.healthy]
        outs = await asyncio.gather(
            *(
                self._broadcast(
                    "/destroy_weights_update_group", {"group_name": group_name}, only=[s]
                )
                for s in targets
            ),
            return_exceptions=True,
        )
        errors = [e for e in outs if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    async def set_weight_version(self, version: int) -> bool:
        """``POST /update_weight_version`` on every live server; False if unsupported."""
        try:
            await self._broadcast("/update_weight_version", {"new_version": str(version)})
            return True
        except RolloutRequestError:
            return False

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` on every live server."""
        await self._broadcast("/flush_cache", {})

    async def model_info(self, i: int = 0) -> dict:
        """``GET /get_model_info`` of server ``i``."""
        return await self.request(
            self._servers[i].addr, "GET", "/get_model_info", timeout=self.control_timeout_s
        )

    async def check_health(self, timeout: float = 5.0) -> list:
        """Probe every server (``hooks.probe``; plain: ``GET /health``), updating the health
        flags; returns whether each check passed. One check at a time with
        ``hooks.serial_checks``."""
        if self.hooks.serial_checks and self._health_lock is None:
            self._health_lock = asyncio.Lock()
        async with self._health_lock if self.hooks.serial_checks else contextlib.nullcontext():
            return list(await asyncio.gather(*(self._check_one(s, timeout) for s in self._servers)))

    async def _check_one(self, srv: _Server, timeout: float) -> bool:
        try:
            await self.hooks.probe(self, srv.addr, srv.healthy, timeout)
        except Exception as e:  # noqa: BLE001 - down (or still booting) until it answers
            self._mark_down(srv, e)
            return False
        return True

    async def wait_for_server(self, deadline: float) -> bool:
        """Wait until some server is healthy (checking them), or ``deadline`` (monotonic)
        passes; returns whether one is."""
        while True:
            if any(s.healthy for s in self._servers) or any(await self.check_health(2.0)):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.5)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every server answers its health check."""
        deadline = time.monotonic() + timeout
        while True:
            if all(await self.check_health(timeout=2.0)):
                return
            if time.monotonic() > deadline:
                down = [s.addr for s in self._servers if not s.healthy]
                raise RolloutServerError(f"rollout servers not ready after {timeout}s: {down}")
            await asyncio.sleep(0.2)
