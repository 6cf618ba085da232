"""What the pure-ASGI pieces share: answering an ApiError themselves, before the app runs; and the boundary that
answers whatever else escapes the app."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from servelm.errors import ApiError, ServerError
from servelm.http.errors import error_parts

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, exc: ApiError, scope: Scope | None = None) -> None:
    """The error envelope with the error's status and headers (WWW-Authenticate, Retry-After); on Azure ML's
    paths, in Azure ML's shape (status and code at the top)."""
    status, data, extra = error_parts(exc, scope.get("path") if scope is not None else None)
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()  # as the routes' own errors write it
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (the first one), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            text: str = value.decode("latin-1")
            return text
    return None


log = logging.getLogger("servelm.http")


class ErrorBoundary:
    """Innermost of our middleware: an exception that escapes the app (a bug) is answered 500 in the envelope
    and goes no further. Starlette's own last handler re-raises after answering, and uvicorn then closes the
    connection, which clients that reuse connections see as a reset; here the connection stays usable. If the
    answer had begun, its body is ended where it stands."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracked(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, ServerError("The server had an error while processing your request."), scope)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
