"""What the pure-ASGI pieces share: answering an ApiError themselves, before the app runs."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from servelm.errors import ApiError
from servelm.http.errors import AZURE_PATHS, azure_error_parts

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, exc: ApiError, scope: Scope | None = None) -> None:
    """The error envelope with the error's status and headers (WWW-Authenticate, Retry-After); on Azure ML's
    paths, in Azure ML's shape (status and code at the top)."""
    status, data, extra = exc.status, exc.body(), exc.headers
    if scope is not None and scope.get("path") in AZURE_PATHS:
        status, data, extra = azure_error_parts(exc)
    body = json.dumps(data).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (the first one), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
