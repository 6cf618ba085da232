"""Running the app under uvicorn with a graceful shutdown.

On SIGTERM or SIGINT uvicorn stops accepting connections, lets requests in flight finish for up to
`shutdown_timeout` seconds, cancels those still running (a cancelled stream aborts its sequences), and then
runs the lifespan's shutdown, which stops the engines. Once done, uvicorn raises the signal again for the
handler that was there before it; the one installed here takes it, so the caller can free the models and the
process exits 0 instead of dying by the signal before its cleanup runs.
"""

from __future__ import annotations

import signal
import threading

import uvicorn
from starlette.types import ASGIApp

STARTUP_FAILURE = 3  # uvicorn's own exit status when the server could not start (the port is taken, …)


def run(app: ASGIApp, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        access_log=False,  # servelm.http.middleware.RequestLog writes the access lines (with the request id)
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]  (uvicorn waits with a float fine)
    )
    server = uvicorn.Server(config)
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
