"""Remote MCP tool servers as a request reaches them (the Responses API's `{"type": "mcp"}` tools): which servers
it may reach, and each server's tools listed and called through the official `mcp` SDK (over streamable HTTP, or over
MCP's earlier HTTP+SSE transport where a server answers streamable HTTP with a 4xx), every step bounded.

A request's `server_url` reaches a server only when its origin (scheme, host, port) is one the operator allows
(`--allowed-mcp-servers`; none by default); any path under an allowed origin matches. A name that resolves to a
private, loopback or link-local address is refused unless the allowed origin names that address itself (an IP
literal, or `localhost`), so an allowed public name cannot be pointed inside the network. Every request of a
session goes to its server_url's origin: the SDK follows a redirect only within it, the HTTP client follows none, and
a request to any other origin (a redirect's, an SSE server's endpoint) is refused unsent.

Everything a server sends is bounded: the bytes of each HTTP response (a flood is cut at McpLimits.max_message_bytes;
an SSE server's event stream, which carries the whole session, at that much an event and max_calls + 4 times it in
all), the time to connect, to list and to call, the number of tools and their schemas' size, and a call's output text.
A server that hangs, floods, breaks the protocol or drops the connection fails only the request that named it, as
McpUnavailable (424, OpenAI's `external_connector_error`), a name that is not allowed as a 400. The request's
`headers` and `authorization` go to its server and nowhere else: never into a log line, an error or an echo.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import ipaddress
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import httpx2

if TYPE_CHECKING:  # the SDK takes a second to import: a server that never reaches an MCP server never loads it
    from mcp import Client

from servelm.errors import ApiError, InvalidParameter

log = logging.getLogger("servelm.mcp")
# the MCP SDK's HTTP client logs each request's URL at INFO: a request's server_url (its query too) stays out of
# the server's log
for _quiet in ("httpx2", "httpcore2"):  # at DEBUG the transport logs a refused header value whole
    logging.getLogger(_quiet).setLevel(logging.WARNING)
# the SDK's transports log what a server sends (a line for each event they do not know: a hostile server's flood of
# them would flood the log) and errors whole (the URL and its query with them): a step that fails logs its kind here
for _quiet in ("mcp.client.sse", "mcp.client.streamable_http"):
    logging.getLogger(_quiet).setLevel(logging.CRITICAL)


class _OneLineAMinute(logging.Filter):
    """The stdio client logs a traceback for each line a command writes that is not JSON-RPC (a command printing in
    a loop would fill the log): at most one line a minute says so instead."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -60.0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None:
            return True
        if time.monotonic() - self._last < 60:
            return False
        self._last = time.monotonic()
        kind = type(record.exc_info[1]).__name__ if record.exc_info[1] is not None else "an error"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "%s (%s; such lines are logged once a minute at most)", (record.getMessage(), kind), None, None)
        return True


logging.getLogger("mcp.client.stdio").addFilter(_OneLineAMinute())
T = TypeVar("T")
CLOSE_S = 10.0  # the longest an MCP client's close is waited for
MAX_SCHEMA_DEPTH = 24  # a tool schema's nesting (dicts and lists); deeper ones make constrained decoding crawl
DEFAULT_PORTS = {"http": 80, "https": 443}


class McpUnavailable(ApiError):
    """An MCP server that could not be reached, listed or called (OpenAI answers these 424)."""

    status = 424
    type = "external_connector_error"

    def __init__(self, label: str, what: str) -> None:
        super().__init__(f"Error {what} MCP server {label!r}.", param="tools", code="http_error")


@dataclass(frozen=True)
class McpLimits:
    """The bounds of one response's MCP work (ServerSettings' mcp_*)."""

    connect_s: float = 10.0  # to connect and agree on the protocol
    list_s: float = 10.0  # to list the tools
    call_s: float = 30.0  # one tool call
    total_s: float = 120.0  # all of a response's MCP time
    max_calls: int = 8  # tool calls a response may make
    max_tools: int = 128  # tools a server may list (past it: 424)
    max_schema_bytes: int = 64 << 10  # one tool's input schema, as JSON
    max_output_bytes: int = 64 << 10  # one call's output text (past it: cut, and said)
    max_message_bytes: int = 1 << 20  # any one HTTP response from a server


@dataclass(frozen=True)
class McpTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool = False  # the server says the tool changes nothing (its readOnlyHint)


@dataclass(frozen=True)
class McpResult:
    output: str | None  # the call's text (its content's text parts, joined), or None when it failed
    error: str | None  # what failed: the tool's own error, or the server's
    server_failed: bool = False  # the server (not the tool) failed: unreachable, too slow, broken


def origin_of(url: str) -> tuple[str, str, int] | None:
    """A URL's origin (scheme, host, port), or None if it is not an http(s) URL with a host (and nothing that is
    not printable ASCII: a line break in it would split the request)."""
    if not url.isascii() or not url.isprintable() or " " in url:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.password is not None:
        return None
    return scheme, parts.hostname.lower().rstrip("."), port or DEFAULT_PORTS[scheme]


def parse_allowed(origins: tuple[str, ...]) -> frozenset[tuple[str, str, int]]:
    """--allowed-mcp-servers' origins (config.py checks their form; a ValueError names one that is no origin)."""
    found = set()
    for text in origins:
        origin = origin_of(text)
        if origin is None or urlsplit(text).path not in ("", "/") or urlsplit(text).query:
            raise ValueError(f"{text!r} is not an origin such as http://127.0.0.1:8931")
        found.add(origin)
    return frozenset(found)


def _named_address(host: str) -> bool:
    """An origin whose host is an IP literal or localhost: the operator named the address itself."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


async def check_server_url(url: str, allowed: frozenset[tuple[str, str, int]], where: str) -> None:
    """A request's server_url, allowed (else a 400 naming `where`): its origin is one of `allowed`, and a name
    resolves to public addresses only."""
    origin = origin_of(url)
    if origin is None:
        raise InvalidParameter(f"`{where}` must be an http(s) URL without user info.", where)
    if origin not in allowed:
        raise InvalidParameter(f"`{where}`: this server does not reach MCP servers at {origin[0]}://{origin[1]}:"
                               f"{origin[2]} (the operator allows the origins in --allowed-mcp-servers).", where)
    if _named_address(origin[1]):
        return
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(origin[1], origin[2]), 5.0)
    except (TimeoutError, OSError):
        raise McpUnavailable(where, "resolving the host of") from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not address.is_global:
            raise InvalidParameter(f"`{where}`: its host resolves to a private address, which only an allowed "
                                   "origin naming that address may reach.", where)


class _BoundedStream(httpx2.AsyncByteStream):
    """A response body cut past `limit` bytes; or, an event stream that carries a whole session (`total` given),
    each event cut past `limit` bytes and the stream past `total`."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, total: int | None = None) -> None:
        self.inner, self.limit, self.total = inner, limit, total
        self.seen = self.seen_all = 0  # bytes since the start (an event stream: of the event it is in)
        self.line_ended = self.cr_ended = False  # an event stream's last chunk ended a line, with a CR

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.seen_all += len(chunk)
            if self.total is None:
                self.seen += len(chunk)
                if self.seen > self.limit:
                    raise httpx2.ReadError(f"an MCP server's response passed {self.limit} bytes")
            elif self._longest_event(chunk) > self.limit or self.seen_all > self.total:
                # SSEError: the SDK's SSE client fails on it at once (any other error before the endpoint event
                # leaves it waiting, until the connect bound)
                raise httpx2.SSEError(f"an MCP server's event stream passed its bound ({self.limit} bytes an event, "
                                      f"{self.total} in all)")
            yield chunk

    def _longest_event(self, chunk: bytes) -> int:
        """The bytes of the longest event `chunk` ends or goes on with (an event ends at a blank line; a line at
        CRLF, LF or CR, a CRLF perhaps split between two chunks)."""
        if self.cr_ended and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self.cr_ended = chunk.endswith(b"\r")
        text = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = ((b"\n" if self.line_ended else b"") + text).split(b"\n\n")
        self.line_ended = text.endswith(b"\n") or (self.line_ended and not text)
        lengths = [self.seen + len(events[0])] + [len(event) for event in events[1:]]
        self.seen = lengths[-1]
        return max(lengths)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport to one origin (a request to any other is refused unsent, whatever sent it there: a
    redirect, an SSE server's endpoint) whose every response body is cut past `limit` bytes (a flooding server).
    With `session_total`, a GET's event stream (the SSE transport's, which carries every answer of the session) is
    bounded per event and in all instead, and waits for its next event without a read timeout: it lives as long as
    the session, each step of which is bounded on its own. `post_status`: the status of the last POST's answer."""

    def __init__(self, origin: tuple[str, str, int] | None, limit: int, session_total: int | None = None) -> None:
        self.inner, self.origin, self.limit, self.session_total = httpx2.AsyncHTTPTransport(), origin, limit, session_total
        self.post_status = 0

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if origin_of(str(request.url)) != self.origin:
            raise httpx2.ConnectError("an MCP server's request to another origin is not sent", request=request)
        session_stream = self.session_total is not None and request.method == "GET"
        if session_stream:
            request.extensions = {**request.extensions,
                                  "timeout": {**request.extensions.get("timeout", {}), "read": None}}
        response = await self.inner.handle_async_request(request)
        if request.method == "POST":
            self.post_status = response.status_code
        stream = response.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        response.stream = _BoundedStream(stream, self.limit, self.session_total if session_stream else None)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


Job = Callable[["Client"], Awaitable[T]]
_SDK = ("mcp", "mcp.client.sse", "mcp.client.streamable_http")


async def _load_sdk() -> None:
    """The MCP SDK, imported on a thread when a client first opens: a server that reaches no MCP server never loads
    it, and its second of imports does not stall the event loop's other requests."""
    if not all(name in sys.modules for name in _SDK):
        await asyncio.to_thread(lambda: [importlib.import_module(name) for name in _SDK])


class McpBudget:
    """The time a response's MCP work may still take (--mcp-timeout): each step spends what it took, and the
    generation between steps spends none."""

    def __init__(self, total_s: float) -> None:
        self.left_s = total_s


class _Worker:
    """An MCP client run in a task of its own. The SDK's client cancels whatever runs inside its task group when its
    transport fails (a dropped connection, an answer cut at the byte bound); run in the request's task, that cancelled
    the request itself. Here only this task is cancelled, and the steps it was running fail as ConnectionError."""

    def __init__(self, label: str, open_client: Callable[[], AbstractAsyncContextManager[Client]]) -> None:
        loop = asyncio.get_running_loop()
        self.label = label
        self.ready: asyncio.Future[None] = loop.create_future()
        self._jobs: asyncio.Queue[tuple[Job[Any], asyncio.Future[Any]]] = asyncio.Queue()
        self.failed = False
        self._task = loop.create_task(self._run(open_client), name=f"mcp-client-{label}")

    async def _run(self, open_client: Callable[[], AbstractAsyncContextManager[Client]]) -> None:
        current: asyncio.Future[Any] | None = None
        try:
            await _load_sdk()
            async with open_client() as client:
                self.ready.set_result(None)
                while True:
                    job, current = await self._jobs.get()
                    try:
                        result = await job(client)
                    except Exception as exc:
                        if not current.done():
                            current.set_exception(exc)
                    else:
                        if not current.done():
                            current.set_result(result)
                    current = None
        except BaseException as exc:  # the client failed (its task group cancelled this task), or it was closed
            self.failed = True
            gone = ConnectionError(f"the MCP client stopped ({type(exc).__name__})")
            waiting = [self.ready, current]
            while not self._jobs.empty():
                waiting.append(self._jobs.get_nowait()[1])
            for future in waiting:
                if future is not None and not future.done():
                    future.set_exception(gone)

    async def submit(self, job: Job[T]) -> T:
        if self.failed:
            raise ConnectionError("the MCP client stopped")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put_nowait((job, future))
        return await future

    async def close(self) -> None:
        """Cancels the client's task, and waits at most CLOSE_S for it (the SDK's own bounded shutdown of a command
        closes its stdin, then terminates and kills its process tree within about 7 s): never longer, so that a
        client stuck in closing holds up neither a restart nor the app's stop."""
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=CLOSE_S)
        if not self._task.done():
            log.warning("MCP server %r: its client did not close within %.0f s; left to finish on its own",
                        self.label, CLOSE_S)
        if self.ready.done() and not self.ready.cancelled():
            self.ready.exception()  # looked at: never "exception never retrieved"


class _Connected:
    """A live MCP client's tools listed and called, each step within its bound and the response's budget."""

    def __init__(self, label: str, limits: McpLimits, budget: McpBudget) -> None:
        self.label, self.limits, self.budget = label, limits, budget
        self._worker: _Worker | None = None

    async def _timed(self, bound_s: float, step: Awaitable[T]) -> T:
        """`step` within `bound_s` and what is left of the budget, which it spends (TimeoutError past either)."""
        started = time.monotonic()
        try:
            return await asyncio.wait_for(step, max(0.0, min(bound_s, self.budget.left_s)))
        finally:
            self.budget.left_s -= time.monotonic() - started

    async def _step(self, bound_s: float, job: Job[T]) -> T:
        assert self._worker is not None
        return await self._timed(bound_s, self._worker.submit(job))

    def _on_failure(self) -> None:
        """A step failed (the server unreachable, too slow or broken)."""

    def _failed(self, what: str, exc: BaseException) -> McpUnavailable:
        # the exception's own text may hold the URL's query or a header echoed back: only its kind is logged
        log.warning("MCP server %r: %s it failed (%s)", self.label, what, type(exc).__name__)
        self._on_failure()
        return McpUnavailable(self.label, "timed out " + what if isinstance(exc, TimeoutError) else what)

    async def list_tools(self, allowed: tuple[str, ...] | None = None) -> list[McpTool]:
        """The server's tools (only those named in `allowed`, when given), each bounded."""
        try:
            listed = await self._step(self.limits.list_s, lambda client: client.list_tools())
        except Exception as exc:
            raise self._failed("listing the tools of", exc) from None
        if len(listed.tools) > self.limits.max_tools:
            raise McpUnavailable(self.label, f"with more than {self.limits.max_tools} tools from")
        tools = []
        for tool in listed.tools:
            if allowed is not None and tool.name not in allowed:
                continue
            schema = dict(tool.input_schema or {"type": "object"})
            if len(json.dumps(schema)) > self.limits.max_schema_bytes:
                raise McpUnavailable(self.label, f"with a tool schema over {self.limits.max_schema_bytes} bytes from")
            if schema_depth(schema) > MAX_SCHEMA_DEPTH:
                raise McpUnavailable(self.label, f"with a tool schema nested deeper than {MAX_SCHEMA_DEPTH} from")
            hints = tool.annotations
            tools.append(McpTool(tool.name, tool.description or "", schema,
                                 bool(hints is not None and hints.read_only_hint)))
        return tools

    async def call(self, name: str, arguments: dict[str, Any]) -> McpResult:
        """One call of a tool: its text output, or its error (a tool's own error is a result, not an exception;
        a server that fails or takes too long is McpResult(None, what failed, server_failed=True))."""
        try:
            result = await self._step(self.limits.call_s, lambda client: client.call_tool(name, arguments))
        except Exception as exc:
            return McpResult(None, str(self._failed(f"calling {name!r} on", exc)), server_failed=True)
        texts = [str(part.text) for part in getattr(result, "content", None) or [] if getattr(part, "type", "") == "text"]
        text = "\n".join(texts)
        data = text.encode()
        if len(data) > self.limits.max_output_bytes:
            text = data[:self.limits.max_output_bytes].decode(errors="ignore") + \
                f"\n[output cut at {self.limits.max_output_bytes} bytes]"
        if getattr(result, "is_error", False):
            return McpResult(None, text or "the tool failed")
        return McpResult(text, None)


def schema_depth(schema: Any) -> int:
    """How deeply a JSON schema nests (objects and arrays in it): grammar-constrained decoding slows with it."""
    if isinstance(schema, dict):
        return 1 + max((schema_depth(v) for v in schema.values()), default=0)
    if isinstance(schema, list):
        return max((schema_depth(v) for v in schema), default=0)
    return 0


class McpSession(_Connected):
    """One request's connection to one MCP server: `async with McpSession(...) as s`, then list and call.

    Over streamable HTTP; when the server answers that with a 4xx (a server of MCP's earlier HTTP+SSE transport
    answers the POST 404 or 405), over SSE at the same URL, as the MCP specification's backwards compatibility asks
    of a client: a GET that opens the server's event stream, whose first event names the URL to POST to (refused
    unless on the same origin). Both within the one connect bound. `transport`: which one it speaks."""

    def __init__(self, label: str, url: str, headers: Mapping[str, str], limits: McpLimits, budget: McpBudget) -> None:
        super().__init__(label, limits, budget)
        self._url, self._headers = url, dict(headers)
        self.transport = "streamable_http"

    def _http(self, session_total: int | None = None) -> tuple[httpx2.AsyncClient, _BoundedTransport]:
        limits = self.limits
        transport = _BoundedTransport(origin_of(self._url), limits.max_message_bytes, session_total)
        return httpx2.AsyncClient(headers=self._headers, transport=transport, follow_redirects=False,
                                  timeout=httpx2.Timeout(limits.connect_s, read=limits.call_s)), transport

    def _sse_http(self, headers: dict[str, str] | None = None, timeout: httpx2.Timeout | None = None,
                  auth: httpx2.Auth | None = None) -> httpx2.AsyncClient:
        """The SSE client's HTTP client (the SDK's headers, timeouts and auth are unused: this session's hold).
        Its event stream carries the whole session: the endpoint event, the answers to the handshake's two requests
        (discover, initialize), to the listing and to each call, each at most max_message_bytes."""
        return self._http((self.limits.max_calls + 4) * self.limits.max_message_bytes)[0]

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[Client]:
        from mcp import Client
        from mcp.client.sse import sse_client
        from mcp.client.streamable_http import streamable_http_client

        http, transport = self._http()
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            try:
                client = await stack.enter_async_context(Client(streamable_http_client(
                    self._url, http_client=http, max_sse_event_size=self.limits.max_message_bytes), cache=None))
            except Exception:
                if not 400 <= transport.post_status < 500:
                    raise
                self.transport = "sse"
                client = await stack.enter_async_context(Client(sse_client(self._url,
                                                                           httpx_client_factory=self._sse_http),
                                                                cache=None))
            yield client

    async def __aenter__(self) -> McpSession:
        self._worker = _Worker(self.label, self._open)
        try:
            await self._timed(self.limits.connect_s, asyncio.shield(self._worker.ready))
        except BaseException as exc:
            await self._worker.close()
            if isinstance(exc, Exception):
                raise self._failed("connecting to", exc) from None
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._worker is not None:
            await self._worker.close()


class StdioServer:
    """An MCP server the operator configured as a command: started with the app, kept running (a process that
    exits or stops answering is started again, waiting 1 s, then twice as long each time up to 30 s), and shared
    by every request that names it (MCP sessions take concurrent requests). `status`: starting, ready or
    restarting."""

    CHECK_EVERY_S = 10.0  # how often a running server is asked for its tools (and how long it has to answer)
    START_S = 60.0  # how long a start may take (the command's own start-up and the protocol's handshake)

    def __init__(self, label: str, command: str, args: list[str], env: Mapping[str, str]) -> None:
        self.label = label
        self._command, self._args, self._env = command, list(args), {**os.environ, **env}
        self.worker: _Worker | None = None
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.broken = asyncio.Event()
        self.status = "starting"
        self.restarts = 0
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"mcp-{self.label}")

    async def stop(self) -> None:
        """No start any more; the running client closed (each wait bounded: the app's stop is never held up)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2 * CLOSE_S)

    def _client(self) -> AbstractAsyncContextManager[Client]:
        from mcp import Client, StdioServerParameters

        return Client(StdioServerParameters(command=self._command, args=self._args, env=self._env), cache=None)

    async def _run(self) -> None:
        backoff = 1.0
        while not self._stopping:
            worker = _Worker(self.label, self._client)
            try:
                await asyncio.wait_for(asyncio.shield(worker.ready), self.START_S)
                self.worker, self.status, backoff = worker, "ready", 1.0
                self.ready.set()
                log.info("MCP server %r: started", self.label)
                await self._until_broken(worker)
            except Exception as exc:
                log.warning("MCP server %r: %s; starting it again in %.0f s", self.label, type(exc).__name__, backoff)
            finally:
                self.ready.clear()
                self.worker = None
                self.status = "restarting"
                await worker.close()
            self.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(30.0, backoff * 2)

    async def _until_broken(self, worker: _Worker) -> None:
        """Until the server fails to list its tools, asked every CHECK_EVERY_S and at once when a request's step
        failed (MCP's ping is gone from its 2026 protocol)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.broken.wait(), self.CHECK_EVERY_S)
            self.broken.clear()
            await asyncio.wait_for(worker.submit(lambda client: client.list_tools()), self.CHECK_EVERY_S)

    def session(self, limits: McpLimits, budget: McpBudget) -> StdioSession:
        return StdioSession(self, limits, budget)


class StdioSession(_Connected):
    """A request's use of a running StdioServer (nothing to open or close; one starting is waited for within the
    connect bound)."""

    def __init__(self, server: StdioServer, limits: McpLimits, budget: McpBudget) -> None:
        super().__init__(server.label, limits, budget)
        self._server = server

    async def __aenter__(self) -> StdioSession:
        with contextlib.suppress(TimeoutError):
            await self._timed(self.limits.connect_s, self._server.ready.wait())
        self._worker = self._server.worker
        if self._worker is None:
            raise McpUnavailable(self.label, f"reaching ({self._server.status})")
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        pass

    def _on_failure(self) -> None:
        self._server.broken.set()  # a server that failed a step is checked at once
