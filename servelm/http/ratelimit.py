"""Per-key rate limits: token buckets for requests per minute and tokens per minute, answered 429 with
Retry-After in OpenAI's envelope (type "requests" or "tokens", code "rate_limit_exceeded").

Requests per minute are counted by a pure-ASGI middleware before the app runs. Tokens per minute need the
prompt, so they are charged once the request is prepared (http/limits.py: admit): prompt tokens plus
max_tokens for every sequence run. The charge is admitted while the key's bucket is not in debt and may take
it below zero (a large request is not refused forever; the next ones wait for the debt to refill). When
the answer's usage is known (a whole answer, or a stream with include_usage), the unused part of the
max_tokens reservation is given back. Without API keys the buckets are per client address.

A batch's lines (http/batches.py, batch/runner.py) count against the key that created the batch, paced rather
than refused: BatchPacer makes a line wait, before it takes a place among the lines in flight, until the key has a
request to spend and its token bucket is out of debt; its tokens are then charged as any request's. An owner's
lines take their turns one at a time up to that charge, so they go in as the bucket refills, as interactive
requests would (without keys, every batch shares one budget: the caller "addr:batch").
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass

from servelm.errors import RateLimited
from servelm.http.asgi import ASGIApp, Receive, Scope, Send, send_error
from servelm.http.auth import BATCH_OWNER, OPEN_PATHS, current_key
from servelm.keys import KeySpec

SCOPE_TOKENS = "servelm.tpm"  # the key's token bucket, when it has a tokens-per-minute limit
# a batch line's turn (BatchPacer), ended once its tokens are charged: its owner's next line may then wait for them
_TURN: ContextVar[_Turn | None] = ContextVar("servelm_batch_turn", default=None)
MAX_CALLERS = 10_000  # buckets kept before the full (idle) ones are dropped


class TokenBucket:
    """`per_minute` units, refilled continuously at per_minute/60 a second, holding at most per_minute."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._clock = clock
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, cost: float) -> float:
        """Take `cost` if the bucket holds it: 0.0; else the seconds until it will (nothing taken)."""
        self._refill()
        if self.level >= cost:
            self.level -= cost
            return 0.0
        return (cost - self.level) / self.rate

    def take_on_credit(self, cost: float) -> float:
        """Take `cost` if the bucket is not in debt, even into debt: 0.0; else the seconds until it is not."""
        wait = self.in_debt()
        if not wait:
            self.level -= cost
        return wait

    def in_debt(self) -> float:
        """0.0 when the bucket holds something; else the seconds until it will."""
        self._refill()
        return 0.0 if self.level > 0 else max(-self.level / self.rate, 1.0 / self.rate)

    def give(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    @property
    def full(self) -> bool:
        self._refill()
        return self.level >= self.capacity


class RateLimiter:
    """The buckets of every caller (a key's digest, or a client address)."""

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def limits(self, key: KeySpec | None) -> tuple[int, int]:
        """A caller's requests and tokens per minute: its key's own, else the server's (0: none)."""
        if key is None:
            return self.rpm, self.tpm
        return self.rpm if key.rpm is None else key.rpm, self.tpm if key.tpm is None else key.tpm

    def bucket(self, caller: str, kind: str, per_minute: int) -> TokenBucket | None:
        if per_minute <= 0:
            return None
        found = self._buckets.get((caller, kind))
        if found is None or found.capacity != per_minute:
            if len(self._buckets) >= MAX_CALLERS:
                self._buckets = {k: b for k, b in self._buckets.items() if not b.full}
            found = self._buckets[(caller, kind)] = TokenBucket(per_minute, self._clock)
        return found


class RateLimitMiddleware:
    """429 when the caller's requests-per-minute bucket is empty; puts its tokens-per-minute bucket in the
    scope for admit() to charge."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        caller, (rpm, tpm) = caller_of(scope), self.limiter.limits(current_key(scope))
        requests = self.limiter.bucket(caller, "requests", rpm)
        if requests is not None and BATCH_OWNER not in scope:  # (a batch line took its request in BatchPacer.turn)
            wait = requests.take(1)
            if wait:
                await send_error(send, RateLimited(
                    f"Rate limit reached on requests per min (RPM): Limit {rpm}. Please try again in "
                    f"{math.ceil(wait)}s.", wait, kind="requests"), scope)
                return
        tokens = self.limiter.bucket(caller, "tokens", tpm)
        if tokens is not None:
            scope[SCOPE_TOKENS] = tokens
        await self.app(scope, receive, send)


def caller_of(scope: Scope) -> str:
    """Who a request counts against: its API key (by digest), or its client's address on a server without keys."""
    key = current_key(scope)
    if key is not None:
        return "key:" + key.digest.hex()
    client = scope.get("client")
    return f"addr:{client[0] if client else '?'}"


@dataclass(eq=False)
class Charge:
    """Tokens taken from a bucket; the part that turned out unused may be given back once."""

    bucket: TokenBucket
    reserved: int  # of the charge, the completion tokens reserved (max_tokens for every sequence)

    def settle(self, completion_tokens: int) -> None:
        unused, self.reserved = max(0, self.reserved - completion_tokens), 0
        if unused:
            self.bucket.give(unused)


def charge_tokens(scope: Scope, prompt_tokens: int, reserved: int) -> Charge | None:
    """Charge the request's tokens to its caller's tokens-per-minute bucket, or raise 429."""
    bucket: TokenBucket | None = scope.get(SCOPE_TOKENS)
    if bucket is None:
        return None
    try:
        wait = bucket.take_on_credit(prompt_tokens + reserved)
    finally:
        turn = _TURN.get()
        if turn is not None:  # a batch line: its owner's next line may wait for its budget now
            turn.let_next()
    if wait:
        raise RateLimited(
            f"Rate limit reached on tokens per min (TPM): Limit {int(bucket.capacity)}. Please try again in "
            f"{math.ceil(wait)}s.", wait, kind="tokens")
    return Charge(bucket, reserved)


class BatchPacer:
    """Batch lines wait here for their owner's rate limits (see the module's description): `turn` returns once the
    owner may send one more line, and the line runs inside the context it returns."""

    def __init__(self, limiter: RateLimiter, keys: Sequence[KeySpec]) -> None:
        self.limiter = limiter
        self._keys = {k.digest.hex(): k for k in keys}
        self._turns: dict[str, asyncio.Lock] = {}  # an owner's line waiting, or charging: at most one per key

    async def turn(self, owner: str) -> _Turn:
        if self._keys and owner not in self._keys:
            return _Turn(None)  # a key no longer accepted: its line is a 401, nothing to pace
        key = self._keys.get(owner)
        caller = "key:" + owner if key is not None else "addr:batch"  # (caller_of of the line's scope)
        rpm, tpm = self.limiter.limits(key)
        lock = self._turns.setdefault(owner, asyncio.Lock())
        await lock.acquire()
        turn = _Turn(lock)
        try:
            requests = self.limiter.bucket(caller, "requests", rpm)
            while requests is not None and (wait := requests.take(1)):
                await asyncio.sleep(wait)
            turn.requests = requests
            tokens = self.limiter.bucket(caller, "tokens", tpm)
            while tokens is not None and (wait := tokens.in_debt()):
                await asyncio.sleep(wait)
            if tokens is None:
                turn.let_next()  # nothing to charge: the owner's next line need not wait for this one
        except BaseException:
            turn.end()
            raise
        return turn


class _Turn:
    """A batch line's turn: entered around the line's call (charge_tokens ends it there), ended at the latest when
    the line is answered; ending it twice is nothing. Ended without being entered (no line came: the batch's file
    ended, or it stopped), its request is given back."""

    def __init__(self, lock: asyncio.Lock | None) -> None:
        self._lock = lock
        self._reset: Token[_Turn | None] | None = None
        self.requests: TokenBucket | None = None  # the request it took

    def end(self) -> None:
        if self._reset is None and self.requests is not None:
            self.requests.give(1)
        self.requests = None
        self.let_next()

    def let_next(self) -> None:
        """The owner's next line may wait for its budget."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __enter__(self) -> None:
        self._reset = _TURN.set(self)

    def __exit__(self, *exc: object) -> None:
        if self._reset is not None:
            _TURN.reset(self._reset)
        self.end()
