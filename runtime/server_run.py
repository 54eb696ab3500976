"""Running the server: uvicorn with the server's log line, and a shutdown that ends in-flight streams cleanly
before uvicorn's own graceful timeout."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import uvicorn

from .server import AppServer, ServerConfig, build_app

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("specdeploy.server")


def run_server(engine: Engine, config: ServerConfig) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM; in-flight requests get ``config.shutdown_timeout`` seconds to finish."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    server = AppServer(engine, config)
    # uvicorn's own graceful timeout is only a backstop: ours ends the streams cleanly first.
    uv = uvicorn.Config(build_app(server), host=config.host, port=config.port, access_log=False, lifespan="on",
                        timeout_graceful_shutdown=config.shutdown_timeout + 5.0, log_level="info")
    _Uvicorn(uv, server).run()


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app_server: AppServer):
        super().__init__(config)
        self.app_server = app_server

    async def shutdown(self, sockets: Any = None) -> None:
        self.app_server.begin_shutdown(self.app_server.config.shutdown_timeout)
        await super().shutdown(sockets)
