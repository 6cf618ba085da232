"""Load control and request limits: the body-size limit (413), the request deadline (504), the bounded
waiting queue (429 queue_full), and the tokens-per-minute charge. install() stacks the pure-ASGI pieces:
auth (401) → requests per minute (429) → body size and deadline → the app.

The middleware here stamps each request's scope with its limits; admit() reads them where a generating
request is prepared (http/routes.py: generate), so any route that generates gets the same checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from servelm.errors import PayloadTooLarge, RequestTimeout
from servelm.http.asgi import ASGIApp, Receive, Scope, Send, header, send_error
from servelm.http.auth import AuthMiddleware, KeySpec, current_key
from servelm.http.ratelimit import Charge, RateLimiter, RateLimitMiddleware, caller_of, charge_tokens
from servelm.service.admission import Ticket, WaitingQueue

SCOPE_LIMITS = "servelm.limits"


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

    @classmethod
    def from_settings(cls, settings: Any, keys: Sequence[KeySpec] = ()) -> SecurityConfig:
        """From ServerSettings and the keys load_keys(settings, …) read."""
        return cls(keys=tuple(keys), max_body_bytes=settings.max_body_bytes, rate_limit_rpm=settings.rate_limit_rpm,
                   rate_limit_tpm=settings.rate_limit_tpm, max_waiting=settings.max_waiting,
                   max_waiting_per_key=settings.max_waiting_per_key, max_batch_prompts=settings.max_batch_prompts,
                   request_timeout=settings.request_timeout)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may use, put in its scope."""

    max_waiting: int
    timeout: float
    deadline: float | None  # time.monotonic() by which it must have finished
    max_waiting_per_key: int | None = None
    max_batch_prompts: int = 128

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def install(app: Any, config: SecurityConfig) -> None:
    """Add the pieces as middleware, the last added outermost (Starlette's order): auth runs first."""
    app.add_middleware(LimitsMiddleware, config=config)
    app.add_middleware(RateLimitMiddleware, limiter=RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm))
    app.add_middleware(AuthMiddleware, keys=config.keys)


class LimitsMiddleware:
    """413 for a body over the limit (by Content-Length before reading, or counted as it streams in); stamps
    the request's RequestLimits (deadline included) into the scope."""

    def __init__(self, app: ASGIApp, config: SecurityConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timeout = self.config.request_timeout
        c = self.config
        scope[SCOPE_LIMITS] = RequestLimits(c.max_waiting, timeout, time.monotonic() + timeout if timeout else None,
                                            c.max_waiting_per_key, c.max_batch_prompts)
        limit = self.config.max_body_bytes
        if not limit:
            await self.app(scope, receive, send)
            return
        length = header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await send_error(send, PayloadTooLarge(limit), scope)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked upload: raised where the route reads the body, rendered 413
                    raise PayloadTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def limits_of(scope: Scope) -> RequestLimits | None:
    return scope.get(SCOPE_LIMITS)


def remaining(scope: Scope) -> float | None:
    """Seconds left before the request's deadline, or None when it has none."""
    limits = limits_of(scope)
    return None if limits is None else limits.remaining()


def timed_out(scope: Scope) -> RequestTimeout:
    limits = limits_of(scope)
    return RequestTimeout(limits.timeout if limits is not None else 0)


@dataclass(eq=False)
class Admission:
    """A generating request let in: its places in the waiting queue, its token charge (settled from usage), and
    its deadline."""

    scope: Scope
    ticket: Ticket | None = None
    charge: Charge | None = None

    def settle(self, usage: Any) -> None:
        """Give back the unused part of the max_tokens reservation, from a response's `usage`."""
        if self.charge is not None and usage is not None:
            self.charge.settle(int(getattr(usage, "completion_tokens", 0) or 0))

    def release(self) -> None:
        """The request is over: whatever places it still holds in the queue are free."""
        if self.ticket is not None:
            self.ticket.release()

    async def stream(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The chunks, stopped by the deadline (RequestTimeout: the SSE writer turns it into an error event;
        closing the chunks aborts the request in the engine); usage, when a chunk has it, settles the charge."""
        try:
            async with aclosing(chunks) as it:  # type: ignore[type-var]
                while True:
                    left = remaining(self.scope)
                    try:
                        chunk = await (anext(it) if left is None else asyncio.wait_for(anext(it), left))
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise timed_out(self.scope) from None
                    usage = getattr(chunk, "usage", None)
                    if usage is not None:
                        self.settle(usage)
                    yield chunk
        finally:
            self.release()


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
    ticket = queue.reserve(caller_of(scope), request_ids, total, per_caller)
    return Admission(scope, ticket, charge)
