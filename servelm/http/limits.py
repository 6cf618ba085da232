"""Load control and request limits: the body-size limit (413), the request deadline (504), the bounded
waiting queue (429 queue_full), and the tokens-per-minute charge. install() stacks the pure-ASGI pieces:
auth (401) → requests per minute (429) → body size and deadline → the app.

The middleware here stamps each request's scope with its limits; admit() reads them where a generating
request is prepared (http/routes.py: generate), so any route that generates gets the same checks.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from servelm.engine.wrappers.admission import Admission, WaitingQueue
from servelm.errors import ApiError, InvalidParameter, PayloadTooLarge, RequestTimeout, ServiceUnavailable, UnsupportedMediaType
from servelm.http.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_error
from servelm.http.auth import BATCH_OWNER, AuthMiddleware, current_key
from servelm.http.ratelimit import RateLimiter, RateLimitMiddleware, caller_of, charge_tokens
from servelm.keys import KeySpec

SCOPE_LIMITS = "servelm.limits"
# objects and arrays one JSON body may hold: each becomes a model of a few hundred bytes when it is validated, so a
# body within --max-body-bytes of tiny ones (200,000 empty messages in 6.8 MB) would take 160 MiB before any bound on
# a list refused it
MAX_JSON_CONTAINERS = 32_768
MAX_JSON_DEPTH = 128  # objects and arrays inside one another (pydantic's parser gives up past about 255, wordlessly)
OFF_LOOP_BYTES = 64 << 10  # a body longer than this is counted and validated on a worker thread, not the event loop
# a string (skipped whole; a key when a colon follows; one never closed runs to the end, so that no quote inside it
# starts a scan of its own: that was quadratic), or a bracket
_JSON_TOKEN = re.compile(rb'("[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z))(\s*:)?|[\[{\]}]', re.DOTALL)
UPLOAD_PATHS = frozenset({"/v1/files", "/files"})  # multipart uploads, bounded by max_file_bytes
UPLOAD_OVERHEAD = 64 << 10  # a multipart body's boundaries and fields beside the file
T = TypeVar("T")


@dataclass(frozen=True)
class SecurityConfig:
    """Everything of security and load control that create_app needs (see ServerSettings for each)."""

    keys: Sequence[KeySpec] = ()
    max_body_bytes: int = 8 * 1024 * 1024  # 0: no limit
    rate_limit_rpm: int = 0
    rate_limit_tpm: int = 0
    max_waiting: int = 256  # for each deployment that sets none; 0: no bound
    max_waiting_per_key: int | None = None  # of those, one caller's (None: half of max_waiting; 0: no bound)
    max_batch_prompts: int = 128  # prompts in one legacy-completions request
    request_timeout: float = 0  # seconds; 0: no deadline
    cors_allow_origins: Sequence[str] = ()  # browser origins allowed to call the API (none: no CORS headers)
    max_file_bytes: int = 200 << 20  # an upload to POST /v1/files (multipart), instead of max_body_bytes

    @classmethod
    def from_settings(cls, settings: Any, keys: Sequence[KeySpec] = ()) -> SecurityConfig:
        """From ServerSettings and the keys load_keys(settings, …) read."""
        return cls(keys=tuple(keys), max_body_bytes=settings.max_body_bytes, rate_limit_rpm=settings.rate_limit_rpm,
                   rate_limit_tpm=settings.rate_limit_tpm, max_waiting=settings.max_waiting,
                   max_waiting_per_key=settings.max_waiting_per_key, max_batch_prompts=settings.max_batch_prompts,
                   request_timeout=settings.request_timeout, cors_allow_origins=tuple(settings.cors_allow_origins),
                   max_file_bytes=settings.batch_max_file_mib << 20)


EXIT_RESERVE_S = 2.0  # seconds of a shutdown's timeout kept for what follows the app's stop: freeing models, the exit


class Drain:
    """The server's shutdown, as requests in flight see it: once the graceful period is nearly over, `cutoff` is set
    and every stream still running ends with a `server_shutting_down` error event and `data: [DONE]` (a whole
    answer still being made is a 503), rather than being cut off mid-body by the server's cancellation. A request's
    task waiting on a step (bounded) is cancelled at the cutoff, and the cancellation turned into that error."""

    def __init__(self) -> None:
        self.cutoff = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self.ends_at: float | None = None  # time.monotonic() by which the whole shutdown must be over
        self.watches: set[StepWatch] = set()  # the requests in flight that wait on steps (streamed, bounded)

    def left(self, default: float) -> float:
        """Seconds the app's own stop may still take: what is left of the shutdown's timeout less EXIT_RESERVE_S
        (`default` when no timed shutdown began: a test's app, say)."""
        return default if self.ends_at is None else max(0.0, self.ends_at - EXIT_RESERVE_S - time.monotonic())

    def begin(self, seconds: float) -> None:
        """Shutdown began; requests in flight have `seconds` left (on the event loop's thread)."""
        if self._timer is None and not self.cutoff.is_set():
            self._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), self.cut_now)

    def cut_now(self) -> None:
        """The cutoff: every request waiting on a step is cancelled (its StepWatch turns that into the error)."""
        self.cutoff.set()
        for watch in list(self.watches):
            watch.fire(self.error)

    @staticmethod
    def error() -> ServiceUnavailable:
        return ServiceUnavailable("The server is shutting down and stopped this request before it finished; retry it "
                                  "on another server or once this one is back.", code="server_shutting_down")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may use, put in its scope."""

    max_waiting: int
    timeout: float
    deadline: float | None  # time.monotonic() by which it must have finished
    max_waiting_per_key: int | None = None
    max_batch_prompts: int = 128
    drain: Drain | None = None

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def install(app: Any, config: SecurityConfig, drain: Drain | None = None) -> RateLimiter:
    """Add the pieces as middleware, the last added outermost (Starlette's order): auth runs first. The rate
    limiter's buckets are returned (a batch's lines wait on them: http/ratelimit.py BatchPacer)."""
    limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
    app.add_middleware(LimitsMiddleware, config=config, drain=drain)
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    app.add_middleware(AuthMiddleware, keys=config.keys)
    return limiter


def install_cors(app: Any, config: SecurityConfig) -> None:
    """Browsers on the listed origins may call the API (preflights answered before auth); none listed: no CORS
    headers at all, so no page elsewhere can read an answer."""
    if config.cors_allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allow_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["authorization", "api-key", "x-api-key", "content-type", "x-request-id",
                                          "extra-parameters", "azureml-model-deployment", "anthropic-version"],
                           expose_headers=["x-request-id", "x-servelm-deployment", "retry-after"], max_age=600)


JSON_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: str | None) -> bool:
    """application/json (any parameters, such as charset) or a +json type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class LimitsMiddleware:
    """415 for a body that is not JSON (a form or text/plain body is what a web page can send across origins
    without a CORS preflight; requiring JSON closes that door), 413 for a body over the limit (by Content-Length
    before reading, or counted as it streams in); stamps the request's RequestLimits (deadline included) into the
    scope."""

    def __init__(self, app: ASGIApp, config: SecurityConfig, drain: Drain | None = None) -> None:
        self.app = app
        self.config = config
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timeout = 0.0 if BATCH_OWNER in scope else self.config.request_timeout  # a batch has its completion window
        upload = scope["path"] in UPLOAD_PATHS and scope.get("method") == "POST"  # a multipart file (http/batches.py)
        if scope.get("method") in JSON_METHODS and not upload and not is_json(header(scope, b"content-type")) \
                and not _bodiless(scope):
            await send_error(send, UnsupportedMediaType(header(scope, b"content-type")), scope)
            return
        c = self.config
        scope[SCOPE_LIMITS] = RequestLimits(c.max_waiting, timeout, time.monotonic() + timeout if timeout else None,
                                            c.max_waiting_per_key, c.max_batch_prompts, self.drain)
        limit = c.max_file_bytes + UPLOAD_OVERHEAD if upload else c.max_body_bytes
        if not limit:
            await self.app(scope, receive, send)
            return
        length = header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await send_error(send, PayloadTooLarge(limit), scope)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked upload: raised where the route reads the body, rendered 413
                    raise PayloadTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def _bodiless(scope: Scope) -> bool:
    """A request with no body and no content type (`curl -X POST …/cancel`): nothing in it to read as JSON."""
    length = header(scope, b"content-length")
    return header(scope, b"content-type") is None and header(scope, b"transfer-encoding") is None \
        and (length or "0").strip() == "0"


def check_json_containers(body: bytes) -> None:
    """A 400 for a body of more than MAX_JSON_CONTAINERS objects and arrays, or nested more than MAX_JSON_DEPTH deep,
    before any is built: counted as brackets (an upper bound, since strings may hold some), then, past either bound,
    again outside its strings (a match at a time: no copy of the body, and the GIL let go between matches)."""
    if body.count(b"{") + body.count(b"[") <= MAX_JSON_DEPTH:
        return
    found, depth, deepest, key, deep_key = 0, 0, 0, b"", b""
    under: dict[bytes, int] = {}  # containers under each top-level field
    for m in _JSON_TOKEN.finditer(body):
        first = body[m.start()]
        if first == 0x22:  # a string's quote
            if depth == 1 and m.group(2):
                key = m.group(1)[1:-1]
        elif first in (0x5B, 0x7B):  # [ {
            found += 1
            if depth >= 1:
                under[key] = under.get(key, 0) + 1
            depth += 1
            if depth > deepest:
                deepest, deep_key = depth, key
        else:
            depth -= 1
    if deepest > MAX_JSON_DEPTH:
        field = deep_key.decode(errors="replace")[:64] or None
        raise InvalidParameter(f"The request body nests JSON objects and arrays {deepest} deep"
                               f"{f' (in {field!r})' if field else ''}; at most {MAX_JSON_DEPTH} are read.", field)
    if found > MAX_JSON_CONTAINERS:
        most = max(under, key=under.__getitem__) if under else b""
        field = most.decode(errors="replace")[:64] or None
        where = f" ({under[most]} of them in {field!r})" if field else ""
        raise InvalidParameter(f"The request body holds {found} JSON objects and arrays{where}; at most "
                               f"{MAX_JSON_CONTAINERS} are read (a message, a content part, a tool, a schema's object "
                               "each count).", field)


def limits_of(scope: Scope) -> RequestLimits | None:
    return scope.get(SCOPE_LIMITS)


def remaining(scope: Scope) -> float | None:
    """Seconds left before the request's deadline, or None when it has none."""
    limits = limits_of(scope)
    return None if limits is None else limits.remaining()


def timed_out(scope: Scope) -> RequestTimeout:
    limits = limits_of(scope)
    return RequestTimeout(limits.timeout if limits is not None else 0)


async def streamed(scope: Scope, admission: Admission, chunks: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """A stream's chunks, each within the request's deadline (RequestTimeout: the SSE writer turns it into an error
    event; closing the chunks aborts the request in the engine); the admission closes with the stream."""
    watch = StepWatch(scope)
    try:
        async with aclosing(chunks) as it:
            while True:
                try:
                    chunk = await watch.step(anext(it))
                except StopAsyncIteration:
                    return
                yield chunk
    finally:
        watch.close()
        admission.close()


class StepWatch:
    """A request's deadline and the shutdown's cutoff over the steps it awaits, armed once (for a stream, once, not
    a chunk: armed for each chunk, a timer and a registration cost the event loop about 12 µs a chunk here; once,
    about 1). Either one cancels the request's task only while it awaits a step, and the step then raises its error
    (RequestTimeout, 504; server_shutting_down, 503). Either one that comes between two steps (a stream's chunk
    being written) ends the request at its next step, which is not begun."""

    __slots__ = ("scope", "deadline", "task", "drain", "timer", "awaiting", "error", "fired", "floor")

    def __init__(self, scope: Scope) -> None:
        limits = limits_of(scope)
        self.scope = scope
        self.deadline = limits.deadline if limits is not None else None  # time.monotonic()'s
        self.task: asyncio.Task[Any] | None = None
        self.drain = limits.drain if limits is not None else None
        self.awaiting = False
        self.error: Callable[[], ApiError] | None = None  # the error due, once the deadline or the cutoff came
        self.fired = False  # the task was cancelled for it
        self.floor = 0  # the task's cancellations requested before the step now awaited
        left = limits.remaining() if limits is not None else None
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(left, self.fire, self._timed_out) if left is not None else None
        if self.drain is not None:
            self.drain.watches.add(self)

    def fire(self, error: Callable[[], ApiError]) -> None:
        """The deadline or the cutoff came (on the loop): the first one's error is the stream's."""
        if self.error is None:
            self.error = error
        if self.awaiting and not self.fired and self.task is not None:
            self.fired = True
            self.task.cancel()

    async def step(self, step: Awaitable[T]) -> T:
        if self.error is None:
            if self.deadline is not None and time.monotonic() >= self.deadline:  # its timer may not have run yet
                self.error = self._timed_out
            elif self.drain is not None and self.drain.cutoff.is_set():
                self.error = self.drain.error
        if self.error is not None:
            _close(step)
            raise self.error()
        task = self.task = asyncio.current_task()  # the stream's consumer (the same task in practice)
        self.floor = task.cancelling() if task is not None else 0
        self.awaiting = True
        try:
            return await step
        except asyncio.CancelledError:
            if self.fired and self.error is not None and task is not None:
                self.fired = False
                if task.uncancel() <= self.floor:  # ours alone: nothing else cancelled the task
                    raise self.error() from None
            raise
        finally:
            self.awaiting = False
            if self.fired and task is not None:  # the step ended before the cancellation reached it
                self.fired = False
                task.uncancel()

    def _timed_out(self) -> ApiError:
        return timed_out(self.scope)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.drain is not None:
            self.drain.watches.discard(self)


async def bounded(scope: Scope, step: Awaitable[T]) -> T:
    """Await one step of a request, within its deadline (RequestTimeout, 504) and the server's shutdown (503
    server_shutting_down); the step is cancelled when either comes first, and has ended when this raises. Awaited
    in the request's own task (no task or wait of its own)."""
    watch = StepWatch(scope)
    try:
        return await watch.step(step)
    finally:
        watch.close()


def _close(step: Awaitable[Any]) -> None:
    close = getattr(step, "close", None)
    if close is not None:
        close()


def admit(scope: Scope, queue: WaitingQueue, request_ids: Sequence[str], prompt_tokens: int, max_tokens: int,
          max_waiting: int | None = None) -> Admission:
    """Let a generating request in, or raise: 429 queue_full when its deployment's queue, or its caller's share
    of it, has no room for every generation it runs (max_waiting: the deployment's own, else the server's; 0: no
    bound), 429 tokens when its key's tokens per minute are spent. The places are taken at once (no await
    between the check and the count)."""
    limits = limits_of(scope) or RequestLimits(0, 0, None)
    total = limits.max_waiting if max_waiting is None else max_waiting
    key = current_key(scope)
    per_caller = key.max_waiting if key is not None and key.max_waiting is not None else limits.max_waiting_per_key
    if per_caller is None:
        per_caller = (total + 1) // 2
    charge = charge_tokens(scope, prompt_tokens, max_tokens)  # 429 tokens: nothing reserved yet
    try:
        return queue.reserve(caller_of(scope), request_ids, total, per_caller, charge)
    except BaseException:
        if charge is not None:
            charge.settle(0)  # not let in: the key's tokens per minute get the reservation back
        raise
