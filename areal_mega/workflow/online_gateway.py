"""Online RL: agents that areal-mega does not start call an HTTP gateway of the rollout worker,
and their sessions are trained (``rollout.workflow: online``, keys ``rollout.online.*``;
docs/workflows.md, "Online RL").

Routes (JSON bodies; errors in the OpenAI error shape ``{"error": {"message", "type",
"param", "code"}}``):

- ``POST /rl/start_session {"task_id"}`` (admin key) -> ``{"session_id", "api_key",
  "base_url", "sample_id"}`` (the session's trajectories have this id, ``-c<k>`` appended
  when its completions are separate samples); 429 with ``Retry-After`` while the staleness
  bound allows no new group, 503 past ``max_open_sessions``;
- ``POST /v1/chat/completions``, ``/v1/completions``, ``GET /v1/models`` (the session's key):
  the OpenAI-compatible surface of :mod:`areal_mega.workflow.openai_client`, every choice
  recorded token for token with its logprobs and weight versions;
- ``POST /rl/set_reward {"session_id", "reward", "completion_id"?}`` and ``POST
  /rl/end_session {"session_id"}`` (the admin key, or that session's key: another session's
  key is 403).

Hostile clients hurt only themselves (:mod:`areal_mega.common.http_guard`): a connection idle
for ``idle_timeout_s`` (no request, or headers never finished) is closed; a body not received
within ``body_timeout_s`` is 408; a body over 64 MiB is 413, nested too deep or with integers
beyond int64 400; past ``max_connections`` (kept below the file descriptor limit) the oldest
idle connection is closed for the newcomer, or the newcomer gets a plain 503 when all are busy,
counted as ``online/connections_closed_idle`` / ``online/connections_refused`` and logged once
per interval, never a traceback per socket. A completion whose client hung up before the answer
is not trained (``online/completions_abandoned``; ``train_abandoned=true`` keeps it).

Each group the controller starts (under its staleness bound) is one slot of the
:class:`~areal_mega.workflow.online_sessions.SessionBook`; sessions of one ``task_id`` fill
it, and when it is ready its done sessions become the group's trajectories
(:mod:`areal_mega.workflow.episode_export`), delivered like any other group (journal, prompt
ledger, exactly once). Dropped sessions are counted as ``online/sessions_dropped/<reason>``
(``rollout/online/...`` in the metrics rows). Sessions ended before their reward survive a
restart of the rollout worker (:mod:`~areal_mega.workflow.online_restore`); the sessions the
trainer has accepted are retired from the journal when a restarted worker knows its resume
plan (:meth:`OnlineWorkflow.retire_accepted`), so a restart holds the pending ones only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import ssl
import time
import uuid
from pathlib import Path
from typing import Optional

from aiohttp import web

from areal_mega.common import counters
from areal_mega.common.http_guard import ConnectionGuard
from areal_mega.common.net import is_loopback_host
from areal_mega.rollout.client import RolloutRequestError
from areal_mega.security import write_run_file
from areal_mega.workflow.api import EpisodeWorkflow, SampleContext
from areal_mega.workflow.online_journal import OnlineJournal
from areal_mega.workflow.online_restore import (
    RestoredSession,
    ended_record,
    key_digest,
    restored_sessions,
    session_trajectories,
)
from areal_mega.workflow.online_sessions import (
    DONE,
    DROPPED,
    ENDED,
    OPEN,
    REMEMBER_FINISHED,
    TRAINED,
    Busy,
    Session,
    SessionBook,
    SessionError,
)
from areal_mega.workflow.openai_client import (
    MODEL_NAME,
    OpenAIRequestError,
    chat_request,
    completion_request,
)
from areal_mega.workflow.openai_server import bearer_token, json_object_body

log = logging.getLogger(__name__)
TICK_S = 0.2
INFO_FILE = "online_gateway.json"


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: Optional[str] = None,
    headers: Optional[dict] = None,
):
    """An OpenAI-shaped error answer."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": None}},
        status=status,
        headers=headers,
    )


class OnlineWorkflow(EpisodeWorkflow):
    """The gateway as a workflow (see the module doc). ``online``: the
    :class:`~areal_mega.config.OnlineConfig`; ``n_samples``: sessions per task group;
    ``run_dir``: where ``online_gateway.json`` (base URL and admin key, mode 0600) and the
    session journal (:mod:`~areal_mega.workflow.online_journal`) are written; ``resume``:
    continue that journal (else it starts empty)."""

    def __init__(self, online, n_samples: int, run_dir: Optional[str] = None, resume: bool = False):
        self.cfg = online
        self.admin_key = online.admin_api_key or f"sk-areal-admin-{secrets.token_hex(16)}"
        self.book = SessionBook(
            n_samples,
            online.session_timeout_s,
            online.reward_timeout_s,
            online.group_timeout_s,
            online.max_open_sessions,
            online.max_abs_reward,
            completion_ids=_completion_ids,
        )
        self.run_dir = run_dir
        self.journal = None
        self.restored: dict = {}  # session id -> RestoredSession (ended, awaiting reward)
        if run_dir:
            self.journal = OnlineJournal(Path(run_dir) / "online", fresh=not resume)
            if self.journal.left_open:
                log.warning(
                    "%d online sessions were open when the previous rollout worker "
                    "stopped: counted as dropped (worker_restart)",
                    len(self.journal.left_open),
                )
                counters.bump("online/sessions_dropped/worker_restart", len(self.journal.left_open))
            for sid, why in list(self.journal.dropped_before.items())[-REMEMBER_FINISHED:]:
                self.book.finished[sid] = Session(
                    sid, "", None, 0, 0.0, state=DROPPED, reason=why
                )  # a clear 410 if it comes
            self.restored = restored_sessions(self.journal.awaiting, online.reward_timeout_s)
            if self.restored:
                log.info(
                    "%d online sessions ended before the restart still wait for their "
                    "reward (rollout.online.reward_timeout_s from now)",
                    len(self.restored),
                )
        self.restored_keys = {r.key_sha256: sid for sid, r in self.restored.items()}
        self.restored_done: dict = {}  # session id -> RestoredSession rewarded, not delivered
        self.keys: dict = {}  # session key -> session id
        self.slots: dict = {}  # slot -> (GroupContext, ready-group future, prompt)
        self.port = 0
        self.n_requests = 0
        self._start: Optional[asyncio.Task] = None
        self._runner: Optional[web.AppRunner] = None
        self._listener: Optional[asyncio.AbstractServer] = None
        self.guard: Optional[ConnectionGuard] = None
        self._ticker: Optional[asyncio.Task] = None
        self._to_retire: Optional[set] = None  # accepted prompts, from the worker's thread
        self.image_processor = None  # the policy's (set by the first episode), or None

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        """``http(s)://host:port`` of the gateway (the OpenAI base URL is this + ``/v1``)."""
        scheme = "https" if self.cfg.tls_cert else "http"
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve on the running loop (once; concurrent callers wait for it)."""
        if self._start is None:
            self._start = asyncio.ensure_future(self._serve_forever())
        await asyncio.shield(self._start)

    async def _serve_forever(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/rl/start_session", self._start_session)
        app.router.add_post("/rl/set_reward", self._set_reward)
        app.router.add_post("/rl/end_session", self._end_session)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        ctx = None
        if not self.cfg.tls_cert and not is_loopback_host(self.cfg.host):
            log.warning(
                "online gateway binds %s over plain HTTP (rollout.online."
                "allow_insecure_http=true): session keys travel in clear",
                self.cfg.host,
            )
        if self.cfg.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        # idle connections and headers that never complete are closed after idle_timeout_s;
        # the guard keeps the connections under the cap (and the descriptor limit)
        self._runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=self.cfg.idle_timeout_s
        )
        await self._runner.setup()
        self.guard = ConnectionGuard(
            "online gateway", self.cfg.max_connections, counter="online/connections"
        )
        self._listener = await self.guard.serve(
            self._runner, self.cfg.host, self.cfg.port, ssl_context=ctx, backlog=2048
        )
        self.port = self._listener.sockets[0].getsockname()[1]
        if self.run_dir:
            write_run_file(
                Path(self.run_dir) / INFO_FILE,
                json.dumps({"base_url": self.base_url, "admin_api_key": self.admin_key}),
                private=True,
            )
        self._ticker = asyncio.ensure_future(self._tick_forever())
        log.info("online gateway at %s", self.base_url)

    async def close(self) -> None:
        """Stop serving (registered with the controller's ``at_close``)."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._start = None  # a later controller (same process) serves it again

    def stats(self) -> dict:
        """Gauges of the gateway (the event counts go through ``common.counters``)."""
        # read from the control thread: len() only, no iteration over what the loop changes
        return {
            "online_live_sessions": len(self.book.sessions),
            "online_free_slots": len(self.book.free_slots),
        }

    def retire_accepted(self, accepted) -> Optional[dict]:
        """The resume plan is known: retire from the journal (memory and disk) the sessions of
        the prompt positions in ``accepted`` (the trainer's accepted-prompt ledger), keeping
        every session the trainer has not accepted
        (:meth:`~areal_mega.workflow.online_journal.OnlineJournal.retire`). Only before the
        gateway serves (the worker calls it before its controller starts); returns the
        journal's sizes, None when nothing was done."""
        if self.journal is None or self._start is not None:
            return None
        return self.journal.retire(accepted)

    def retire_accepted_later(self, accepted) -> None:
        """A newer trainer checkpoint holds the groups of the prompt positions ``accepted``
        (from any thread): the gateway's next tick deletes the journal segments whose sessions
        are all of such positions
        (:meth:`~areal_mega.workflow.online_journal.OnlineJournal.retire_segments`)."""
        self._to_retire = set(accepted)

    # ------------------------------------------------------------------ the controller side
    async def arun_episode(self, ctx, item: dict, n_samples: int) -> list:
        """One slot: wait until sessions of some task fill it and are done, then return their
        trajectories."""
        ctx.at_close(self.close)
        self.image_processor = getattr(
            ctx, "image_processor", None
        )  # restored sessions' images (the policy's)
        await self.start()
        k = item.get("prompt_index")
        while any(r.prompt_index == k for r in self.restored.values()):
            await asyncio.sleep(TICK_S)  # its ended sessions: rewarded or dropped first
        restored = self.journal.restore(k) if self.journal is not None else []
        for sid in {t.meta.get("session_id") for t in restored}:
            r = self.restored_done.pop(sid, None)  # a later reward: 409, as for a live one
            self.book.remember(
                Session(sid, getattr(r, "task_id", ""), None, 0, time.monotonic(), state=TRAINED)
            )
        if restored:  # done sessions of this slot from before a restart: train them now
            log.info("online: %d journaled samples of prompt %s delivered again", len(restored), k)
            counters.bump(
                "online/sessions_restored", len({t.meta.get("session_id") for t in restored})
            )
            return restored
        fut = asyncio.get_running_loop().create_future()
        self.slots[ctx.group_index] = (ctx, fut, k)
        self.book.add_slot(ctx.group_index)
        try:
            group = await fut
        except asyncio.CancelledError:
            self._dropped(self.book.remove_slot(ctx.group_index))
            raise
        finally:
            self.slots.pop(ctx.group_index, None)
        out: list = []
        for s in group.sessions:
            if s.state == DONE:
                out += self._trajectories(s)
        self.book.trained(group)
        counters.bump(
            "online/sessions_trained", sum(1 for s in group.sessions if s.state != "dropped")
        )
        return out

    def _trajectories(self, s) -> list:
        sctx: SampleContext = s.data
        return session_trajectories(
            sctx,
            sctx.client.records,
            s.reward,
            s.completion_rewards,
            self.settings.turn_discount,
            {
                "task_id": s.task_id,
                "session_id": s.session_id,
                "prompt_index": sctx.item.get("prompt_index"),
            },
        )

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - logged; the next tick tries again
                log.exception("online gateway: tick failed")

    def _tick(self) -> None:
        now = time.monotonic()
        accepted, self._to_retire = self._to_retire, None
        if accepted is not None and self.journal is not None:
            gone = self.journal.retire_segments(accepted)
            if gone:
                log.info(
                    "online journal: %d segments of sessions the trainer accepted retired",
                    len(gone),
                )
        dropped, ready = self.book.tick(now)
        for sid in [sid for sid, r in self.restored.items() if now > r.deadline]:
            r = self.restored.pop(sid)
            r.state, r.reason = DROPPED, "no_reward"
            self.book.finished[sid] = Session(
                sid, r.task_id, None, 0, now, state=DROPPED, reason="no_reward"
            )
            dropped.append(r)
        self._dropped(dropped)
        for g in ready:
            ctx_fut = self.slots.get(g.slot)
            if ctx_fut is not None and not ctx_fut[1].done():
                ctx_fut[1].set_result(g)

    def _dropped(self, sessions: list) -> None:
        for s in sessions:
            counters.bump(f"online/sessions_dropped/{s.reason}")
            # an ended session stopped by a shutdown is journaled: the next worker restores it
            keep = s.reason == "shutdown" and getattr(s, "ended_at", None) is not None
            if self.journal is not None and not keep:
                self.journal.dropped(s.session_id, s.reason)
            log.info("online session %s (task %r) dropped: %s", s.session_id, s.task_id, s.reason)

    def _settled(self, s) -> None:
        """After an end or a reward: journal a done session, or an ended one still waiting
        for its reward (durable before the answer)."""
        if self.journal is not None:
            if s.state == DONE:
                self.journal.done(self._trajectories(s))
            elif s.state == ENDED:
                self.journal.ended(ended_record(s, s.data, s.data.api_key))
        self._tick()

    def _reward_restored(self, r: RestoredSession, body: dict) -> str:
        """A reward for a session restored after a restart: once it has one, journal its
        trajectories for its prompt's next generation."""
        r.set_reward(body["reward"], body.get("completion_id"), self.cfg.max_abs_reward)
        if r.has_reward():  # (again: a changed reward replaces the journaled one)
            if self.journal is not None:
                trajs = r.trajectories(self.settings.turn_discount, self.image_processor)
                self.journal.done(trajs, restorable=True)
            self.restored.pop(r.session_id, None)
            self.restored_done[r.session_id] = r
            r.state = DONE
        return r.state

    # ------------------------------------------------------------------ HTTP
    def _is_admin(self, key: str) -> bool:
        return bool(key) and secrets.compare_digest(key.encode(), self.admin_key.encode())

    async def _guard(self, handler, request: web.Request) -> web.Response:
        self.n_requests += 1
        try:
            return await handler(request)
        except Busy as e:
            return error_response(
                e.status,
                str(e),
                "rate_limit_error" if e.status == 429 else "server_error",
                headers={"Retry-After": str(math.ceil(e.retry_after_s))},
            )
        except SessionError as e:
            return error_response(e.status, str(e), param=e.param)
        except OpenAIRequestError as e:
            resp = error_response(e.status, str(e), e.err_type, e.param)
            if e.status == 408:
                resp.force_close()  # the rest of the body may still come
            return resp
        except RolloutRequestError as e:  # the rollout server refused it (e.g. too long)
            return error_response(e.status if e.status and 400 <= e.status < 500 else 400, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged; the worker keeps serving
            log.exception("online gateway: request failed")
            return error_response(500, f"internal error: {e}", "server_error")

    def _auth_admin(self, request: web.Request) -> None:
        if not self._is_admin(bearer_token(request)):
            raise OpenAIRequestError(
                "invalid admin key: /rl/start_session needs "
                "rollout.online.admin_api_key as the Bearer token",
                status=401,
                err_type="authentication_error",
            )

    async def _own_session(self, request: web.Request) -> tuple:
        """``(session, body)``: the session named by ``body["session_id"]``, if the caller's
        key may act on it (the key is checked before the body is read)."""
        key = bearer_token(request)
        own = self.keys.get(key)
        if own is None and key and self.restored_keys:
            own = self.restored_keys.get(key_digest(key))
        if not self._is_admin(key) and own is None:
            raise OpenAIRequestError(
                "invalid API key: neither the admin key nor an open session's key",
                status=401,
                err_type="authentication_error",
            )
        body = await json_object_body(request, self.cfg.body_timeout_s)
        sid = body.get("session_id")
        if sid is None:
            raise SessionError("session_id: required", 400, "session_id")
        if own is not None and own != sid:
            raise SessionError("this session key belongs to another session", 403, "session_id")
        if isinstance(sid, str) and (sid in self.restored or sid in self.restored_done):
            return self.restored.get(sid) or self.restored_done[sid], body
        return self.book.get(sid), body

    async def _start_session(self, request: web.Request) -> web.Response:
        async def go(request):
            self._auth_admin(request)
            body = await json_object_body(request, self.cfg.body_timeout_s)
            sid = f"sess-{uuid.uuid4().hex}"
            s = self.book.start(sid, body.get("task_id"), time.monotonic())
            ctx, _, k = self.slots[s.slot]
            sctx = SampleContext(
                ctx, {"task_id": s.task_id, "prompt_index": k}, s.index, self.settings
            )
            sctx.api_key = f"sk-areal-sess-{secrets.token_hex(16)}"
            s.data = sctx
            self.keys[sctx.api_key] = sid
            while len(self.keys) > 2 * REMEMBER_FINISHED:  # old keys answer 401 then
                self.keys.pop(next(iter(self.keys)))
            counters.bump("online/sessions_started")
            if self.journal is not None:
                self.journal.started(sid, k)
            return web.json_response(
                {
                    "session_id": sid,
                    "api_key": sctx.api_key,
                    "task_id": s.task_id,
                    "sample_id": sctx.sample_id,
                    "base_url": self.base_url + "/v1",
                }
            )

        return await self._guard(go, request)

    async def _set_reward(self, request: web.Request) -> web.Response:
        async def go(request):
            s, body = await self._own_session(request)
            if "reward" not in body:
                raise SessionError("reward: required", 400, "reward")
            if isinstance(s, RestoredSession):
                return web.json_response(
                    {"session_id": s.session_id, "state": self._reward_restored(s, body)}
                )
            self.book.set_reward(s, body["reward"], body.get("completion_id"), time.monotonic())
            self._settled(s)
            return web.json_response({"session_id": s.session_id, "state": s.state})

        return await self._guard(go, request)

    async def _end_session(self, request: web.Request) -> web.Response:
        async def go(request):
            s, _ = await self._own_session(request)
            if isinstance(s, RestoredSession):  # ended before the restart
                return web.json_response({"session_id": s.session_id, "state": s.state})
            self.book.end(s, time.monotonic())
            if s.state == DROPPED:
                self._dropped([s])
            self._settled(s)
            return web.json_response(
                {
                    "session_id": s.session_id,
                    "state": s.state,
                    **({"reason": s.reason} if s.reason else {}),
                }
            )

        return await self._guard(go, request)

    def _session_of_key(self, request: web.Request, open_only: bool = True):
        sid = self.keys.get(bearer_token(request))
        if sid is None:
            raise OpenAIRequestError(
                "invalid API key: not an open session's key (from /rl/start_session)",
                status=401,
                err_type="authentication_error",
            )
        s = self.book.get(sid)
        if open_only and s.state != OPEN:
            raise SessionError(f"session {sid!r} has ended; start a new one", 409)
        return s

    async def _complete(self, request: web.Request, handler) -> web.Response:
        async def go(request):
            s = self._session_of_key(request)
            body = await json_object_body(request, self.cfg.body_timeout_s)
            c = s.data.client
            s.inflight += 1
            self.book.touch(s, time.monotonic())
            try:
                out = await handler(body, c.generate, c.tokenizer, c.records, c.default_max_tokens)
            finally:
                s.inflight -= 1
                self.book.touch(s, time.monotonic())
            if not self.cfg.train_abandoned and (
                request.transport is None or request.transport.is_closing()
            ):
                # the agent never got it (and its SDK may send it again): not trained
                gone = {f"{out['id']}-{i}" for i in range(len(out["choices"]))}
                c.records[:] = [r for r in c.records if r.completion_id not in gone]
                counters.bump("online/completions_abandoned")
            return web.json_response(out)

        return await self._guard(go, request)

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._complete(request, chat_request)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._complete(request, completion_request)

    async def _models(self, request: web.Request) -> web.Response:
        async def go(request):
            self._session_of_key(request, open_only=False)
            return web.json_response(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": MODEL_NAME,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "areal-mega",
                        }
                    ],
                }
            )

        return await self._guard(go, request)


def _completion_ids(s) -> list:
    return [] if s.data is None else [r.completion_id for r in s.data.client.records]
