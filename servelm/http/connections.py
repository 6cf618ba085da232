"""Connections that cannot starve the server: deadlines for reading a request's headers and its body, and a cap on
open connections that makes room by dropping the connection that has spent longest on its headers.

uvicorn bounds the idle time between requests (`timeout_keep_alive`) but not the time a request's headers may
take, so clients that send headers a byte at a time held their connections forever: 20,000 of them made the
server drop every new client. `guarded_protocol` returns uvicorn's httptools protocol with both bounds added:
- a request's headers must be complete within `header_timeout` seconds of its first byte (of the connection,
  for the first request); otherwise the connection is closed;
- past `max_connections`, a new connection closes the oldest one still reading headers (a slow client, most
  likely the one holding the place), or, when every connection is busy with a request, is itself answered 503
  and closed. Connections in the middle of a request are never dropped to make room;
- so a request's body must keep coming: it must be whole within `body_timeout` seconds of its headers, plus one
  second for each BODY_RATE bytes received (Apache's mod_reqtimeout rule), else it is answered 408 and closed.
  Headers announcing five megabytes, then a byte every few seconds on every connection the cap allowed, shut every
  other caller out for as long as they went on. Time the app leaves the body unread (reading paused) is not the
  client's and does not count.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
BUSY_BODY = (b'{"error": {"message": "The server has too many open connections; retry later.", '
             b'"type": "server_error", "param": null, "code": "too_many_connections"}}')
SLOW = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s")
SLOW_BODY = (b'{"error": {"message": "The request body arrived too slowly (--body-timeout).", '
             b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')
BODY_RATE = 16 << 10  # bytes of body that buy one more second past body_timeout


def guarded_protocol(header_timeout: float, max_connections: int, body_timeout: float = 0.0) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header deadline, a body deadline and a connection cap (0: none)."""

    class GuardedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._headers_since: float | None = None  # while it reads a request's headers
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_deadline: float | None = None  # while it reads a request's body
            self._body_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own signature
            super().connection_made(transport)
            if max_connections and len(self.connections) > max_connections and not self._make_room():
                transport.write(BUSY % (len(BUSY_BODY), BUSY_BODY))
                transport.close()
                return
            self._reading_headers()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._headers_since is None:
                self._reading_headers()

        def on_headers_complete(self) -> None:
            self._headers_since = None
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().on_headers_complete()
            if body_timeout and self._announces_body():
                self._body_deadline = time.monotonic() + body_timeout
                self._body_timer = self.loop.call_later(body_timeout, self._body_check)

        def on_body(self, body: bytes) -> None:
            if self._body_deadline is not None:
                self._body_deadline += len(body) / BODY_RATE
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._body_read()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._body_read()
            super().connection_lost(exc)

        def _announces_body(self) -> bool:
            for name, value in self.headers:
                if name == b"content-length":
                    return value.strip() not in (b"0", b"")
                if name == b"transfer-encoding":
                    return True
            return False

        def _body_read(self) -> None:
            self._body_deadline = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_check(self) -> None:
            self._body_timer = None
            if self._body_deadline is None or self.transport.is_closing():
                return
            now = time.monotonic()
            if self.flow.read_paused:  # the app has not taken what came: that wait is the server's
                self._body_deadline = max(self._body_deadline, now + 1.0)
            if now < self._body_deadline:
                self._body_timer = self.loop.call_later(self._body_deadline - now, self._body_check)
                return
            self._body_deadline = None
            if self.cycle is not None and not self.cycle.response_started:
                self.cycle.response_started = True  # the app's own answer, if it comes, goes nowhere
                self.transport.write(SLOW % (len(SLOW_BODY), SLOW_BODY))
            self.transport.close()

        def _reading_headers(self) -> None:
            self._headers_since = time.monotonic()
            if header_timeout and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._headers_since is not None and not self.transport.is_closing():
                self.transport.close()

        def _make_room(self) -> bool:
            """Close the connection that has been reading its headers longest (not this one); False if none is."""
            slowest: GuardedProtocol | None = None
            for c in self.connections:
                if c is self or not isinstance(c, GuardedProtocol) or c._headers_since is None:
                    continue
                if c.transport.is_closing():
                    continue
                if slowest is None or slowest._headers_since is None or c._headers_since < slowest._headers_since:
                    slowest = c
            if slowest is None:
                return False
            slowest.transport.close()
            return True

    return GuardedProtocol
