"""Running the app under uvicorn: bounded connections, and a graceful shutdown that tells.

Connections (http/connections.py): a request's headers must arrive within `header_timeout` and its body keep
coming (`body_timeout`, plus a second for each 16 KiB), idle keep-alive
connections close after `keep_alive_timeout`, and past `max_connections` a new connection closes the one that
has been reading its headers longest. Behind a reverse proxy, let the proxy face clients (its own header and
body timeouts, per-address connection limits) and keep these as the backstop.

On SIGTERM or SIGINT uvicorn stops accepting connections and lets requests in flight finish for up to
`shutdown_timeout` seconds. Just before that time is up, every stream still running ends with a
`server_shutting_down` error event and `data: [DONE]`, and a whole answer still being made is answered 503
(limits.Drain), so no client sees a body cut off mid-way; uvicorn then cancels whatever is left (a cancelled
stream aborts its sequences) and runs the lifespan's shutdown, which stops the engines. Once done, uvicorn
raises the signal again for the handler that was there before it; the one installed here takes it, so the
caller can free the models and the process exits 0 instead of dying by the signal before its cleanup runs.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any, Literal

import uvicorn

from servelm.http.connections import guarded_protocol
from servelm.http.state import state_of

STARTUP_FAILURE = 3  # uvicorn's own exit status when the server could not start (the port is taken, …)
DRAIN_MARGIN = 0.5  # seconds before the shutdown timeout at which streams still running are ended with an event


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app (its AppState's drain) when its shutdown began and how long requests have."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        state = state_of(app)
        self._drain = state.drain if state is not None else None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._drain is not None:
            grace = float(self.config.timeout_graceful_shutdown or 0)
            self._drain.ends_at = time.monotonic() + grace
            self._drain.begin(max(0.0, grace - min(DRAIN_MARGIN, grace / 4)))
        await super().shutdown(sockets)


def make_server(app: Any, *, host: str, port: int, log_level: str = "info", shutdown_timeout: float = 10.0,
                header_timeout: float = 10.0, keep_alive_timeout: float = 5.0, max_connections: int = 1024,
                body_timeout: float = 20.0, lifespan: Literal["auto", "on", "off"] = "auto") -> DrainingServer:
    # uvicorn declares its two timeouts as int; it waits a float just as well, and ours are floats (seconds)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan=lifespan,
        access_log=False,  # servelm.http.middleware.RequestLog writes the access lines (with the request id)
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]  # a float: see above
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]  # a float: see above
        http=guarded_protocol(header_timeout, max_connections, body_timeout),
    )
    return DrainingServer(config, app)


def run(app: Any, *, host: str, port: int, log_level: str, shutdown_timeout: float, **connections: Any) -> None:
    """Serve until SIGTERM or SIGINT; `connections`: header_timeout, body_timeout, keep_alive_timeout,
    max_connections."""
    server = make_server(app, host=host, port=port, log_level=log_level, shutdown_timeout=shutdown_timeout,
                         **connections)
    signals = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _shutdown_done) for sig in signals} if in_main else {}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)


def _shutdown_done(_sig: int, _frame: object) -> None:
    """uvicorn handing back a signal it has already served: the server has shut down; nothing is left to do."""
