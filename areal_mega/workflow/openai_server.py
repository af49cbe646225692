"""The OpenAI-compatible HTTP endpoint of the rollout worker: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` (aiohttp), so that programs in any language can be
trained.

It runs on the rollout controller's event loop (started on first use by a workflow, see
:meth:`~areal_mega.workflow.api.SampleContext.openai_endpoint`). Each episode sample
opens a session: a fresh API key bound to that sample's
:class:`~areal_mega.workflow.openai_client.OpenAICompatClient`, so every call made with the key
is recorded on that episode. A missing or unknown key is answered 401, a bad request 400, both
with the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``. Streaming is
refused with 400 (``param: "stream"``). The endpoint binds 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Optional

from aiohttp import web

from areal_mega.common import counters
from areal_mega.common.http_guard import BodyError, read_json_body
from areal_mega.rollout.client import RolloutRequestError
from areal_mega.workflow.openai_client import (
    MODEL_NAME,
    OpenAIRequestError,
    chat_request,
    completion_request,
)

log = logging.getLogger(__name__)

_SERVERS: dict = {}  # event loop -> task starting its server
_SESSIONS: dict = {}  # api key -> OpenAICompatClient (shared by the servers of a process)


def _error(
    status: int, message: str, err_type: str = "invalid_request_error", param: Optional[str] = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": None}},
        status=status,
    )


def bearer_token(request: web.Request) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ("" without one)."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


async def json_object_body(request: web.Request, timeout_s: Optional[float] = None) -> dict:
    """The request's JSON body, which must be an object and arrive within ``timeout_s``
    (:func:`~areal_mega.common.http_guard.read_json_body`: numbers out of range, nesting too
    deep, a body too big or too slow are refused); else :class:`OpenAIRequestError` (HTTP 400,
    408 or 413)."""
    try:
        body = await read_json_body(request, timeout_s)
    except BodyError as e:
        raise OpenAIRequestError(str(e), status=e.status) from None
    if not isinstance(body, dict):
        raise OpenAIRequestError("request body must be a JSON object")
    return body


class OpenAIHTTPServer:
    """An aiohttp site serving the OpenAI routes for the open sessions."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, int(port)
        self._runner: Optional[web.AppRunner] = None
        self.n_requests = self.n_errors = 0

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` (the value of ``OPENAI_BASE_URL``)."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> "OpenAIHTTPServer":
        """Bind and serve on the running loop; ``port`` 0 picks a free port."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("OpenAI-compatible endpoint at %s", self.base_url)
        return self

    async def close(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def open_session(client) -> str:
        """A new API key whose calls go to ``client`` (and are recorded there)."""
        key = f"sk-areal-{secrets.token_hex(16)}"
        _SESSIONS[key] = client
        counters.bump("gateway/sessions")
        return key

    def _session(self, request: web.Request):
        client = _SESSIONS.get(bearer_token(request))
        if client is None:
            raise OpenAIRequestError(
                "invalid API key: not an open episode session "
                "(use the OPENAI_API_KEY given to this episode)",
                status=401,
                err_type="authentication_error",
            )
        return client

    async def _serve(self, request: web.Request, handler) -> web.Response:
        self.n_requests += 1
        try:
            client = self._session(request)
            body = await json_object_body(request)
            out = await handler(
                body,
                client.generate,
                client.tokenizer,
                client.records,
                client.default_max_tokens,
                image_processor=getattr(client, "image_processor", None),
            )
            return web.json_response(out)
        except OpenAIRequestError as e:
            self.n_errors += 1
            resp = _error(e.status, str(e), e.err_type, e.param)
            if e.status == 408:
                resp.force_close()  # the rest of the body may still come
            return resp
        except RolloutRequestError as e:  # the rollout server refused it (e.g. too long)
            self.n_errors += 1
            return _error(e.status if e.status and 400 <= e.status < 500 else 400, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged; the worker keeps serving
            self.n_errors += 1
            log.exception("OpenAI endpoint: request failed")
            return _error(500, f"internal error: {e}", "server_error")

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat_request)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, completion_request)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except OpenAIRequestError as e:
            return _error(e.status, str(e), e.err_type)
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


async def shared_server(port: int = 0) -> OpenAIHTTPServer:
    """The endpoint of the running event loop, started on first call (concurrent first
    callers wait for the same start)."""
    loop = asyncio.get_running_loop()
    task = _SERVERS.get(loop)
    if task is None:
        task = _SERVERS[loop] = loop.create_task(OpenAIHTTPServer(port=port).start())
    try:
        return await asyncio.shield(task)
    except Exception:
        if _SERVERS.get(loop) is task:
            _SERVERS.pop(loop, None)
        raise


def close_session(api_key: str) -> None:
    """Forget ``api_key``; later calls with it are answered 401."""
    _SESSIONS.pop(api_key, None)


async def close_shared_server() -> None:
    """Stop the endpoint of the running loop, if one was started (registered with the
    controller's ``at_close`` when a sample first asks for it)."""
    task = _SERVERS.pop(asyncio.get_running_loop(), None)
    if task is not None and task.done() and not task.exception():
        await task.result().close()
