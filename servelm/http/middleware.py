"""RequestLog: a pure-ASGI middleware that gives every request an id (the caller's `x-request-id`, when it
is a sane one, or a new one), echoes it in the response's `x-request-id`, writes one access line per
request on the "servelm.access" logger, and counts the request by route template and status."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.metrics import Metrics

log = logging.getLogger("servelm.access")

MAX_REQUEST_ID = 128
_SAFE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,%d}" % MAX_REQUEST_ID)
FILTERED_NOTE = "content_filter"  # scope state a content filter's block leaves ("input:hate"), logged here
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
OTHER_ROUTE = "other"  # a path no route matched: never a raw path, which would make labels unbounded


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's x-request-id if it is short and plain (no spaces, quotes or control characters),
    otherwise a fresh one."""
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if _SAFE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The matched route's template (`/v1/models/{model_id:path}`), as the router left it in the scope."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else OTHER_ROUTE


class RequestLog:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = request_id_from(scope.get("headers", []))
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode("latin-1"))
        status = 0
        done = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self._record(scope, status, start, rid, "")

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as exc:
            if not done:  # the outer error middleware answers 500; a cancelled stream keeps the status it sent, and a
                done = True  # request cancelled before its answer began (a batch's line at cancel) had no one to answer
                cancelled = isinstance(exc, asyncio.CancelledError)
                self._record(scope, status or (499 if cancelled else 500), start, rid, f" ({type(exc).__name__})")
            raise
        if not done:  # the app returned without finishing its body (a client that went away)
            self._record(scope, status or 499, start, rid, " (incomplete)")

    def _record(self, scope: Scope, status: int, start: float, rid: str, note: str) -> None:
        seconds = time.perf_counter() - start
        method = scope.get("method", "")
        self.metrics.observe_request(route_template(scope), method, status, seconds)
        filtered = scope.get("state", {}).get(FILTERED_NOTE)
        if filtered:  # that a request was filtered, and why; never what it said
            note += f" filtered={filtered}"
        trace_id, span_id = trace_of(scope)
        if trace_id:
            note += f" trace_id={trace_id}"
        path = scope.get("path", "")
        log.info("%s %s %d %.1fms request_id=%s%s", method, path, status, seconds * 1000, rid, note,
                 extra={"request_id": rid, "method": method, "path": path, "status": status,
                        "duration_ms": round(seconds * 1000, 1), "trace_id": trace_id, "span_id": span_id})


def trace_of(scope: Scope) -> tuple[str | None, str | None]:
    """The request's trace and span ids: its OpenTelemetry span's while traced, else the caller's W3C traceparent's
    (so a line can be found from the caller's trace even with tracing off)."""
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        return f"{span.trace_id:032x}", f"{span.span_id:016x}"
    for name, value in scope.get("headers", []):
        if name == b"traceparent":
            m = _TRACEPARENT.fullmatch(value.decode("latin-1").strip())
            if m and m.group(1) != "0" * 32:
                return m.group(1), m.group(2)
    return None, None
