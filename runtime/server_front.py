"""The server's front door: a pure ASGI wrapper (streaming-safe, unlike BaseHTTPMiddleware) that checks the API
key, counts each request in the metrics and logs one line per request."""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from .server_metrics import Metrics
from .server_schema import ApiError

log = logging.getLogger("specdeploy.server")


class FrontDoor:
    """Pure ASGI wrapper (streaming-safe, unlike BaseHTTPMiddleware): API key, request metrics, one log line."""

    def __init__(self, app: Any, api_key: str | None, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def _authorized(self, scope: dict) -> bool:
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(got, self.expected or b"")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.expected is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
                err = ApiError(401, "Missing or incorrect API key; send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                await err.response()(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe(scope["path"], status[0])
            log.info("%s %s %d tokens=%d %.3fs%s", scope["method"], scope["path"], status[0],
                     scope.get("specdeploy.tokens", 0), time.perf_counter() - t0, scope.get("specdeploy.note", ""))
