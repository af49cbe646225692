"""The API key on every route of a vLLM server (vLLM loads this as ``--middleware``).

vLLM's own check (``VLLM_API_KEY``) guards only the paths under /v1, /v2, /inference and
/cohere. The development routes that ``VLLM_SERVER_DEV_MODE=1`` turns on, and that weight
updates need (/collective_rpc, /pause, /resume, /update_weights, /sleep, ...), answer anyone:
/collective_rpc calls any method of the workers. :class:`BearerOnEveryRoute` asks every HTTP
and WebSocket request but ``GET /health`` (the launcher's and Slurm script's readiness probe)
and CORS preflights for ``Authorization: Bearer <VLLM_API_KEY>``; without a key in the
environment it lets everything through (the launcher binds such a server to loopback only).

Runs inside vLLM's Python: standard library only, nothing else of ours imported.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Optional

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BearerOnEveryRoute:
    """Pure ASGI middleware: 401 unless the request carries the key (see the module doc).
    ``api_key`` defaults to ``$VLLM_API_KEY`` read when the app is built."""

    def __init__(self, app, api_key: Optional[str] = None):
        self.app = app
        key = os.environ.get(KEY_ENV) if api_key is None else api_key
        self._key_digest = _digest(key.encode()) if key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    _digest(token.strip()), self._key_digest
                )
        return False

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if (
            self._key_digest is None
            or kind not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
        ):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if kind == "websocket":  # refused before the handshake: the server answers 403
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
