"""Per-key rate limits: token buckets for requests per minute and tokens per minute, answered 429 with
Retry-After in OpenAI's envelope (type "requests" or "tokens", code "rate_limit_exceeded").

Requests per minute are counted by a pure-ASGI middleware before the app runs. Tokens per minute need the
prompt, so they are charged once the request is prepared (http/limits.py: admit): prompt tokens plus
max_tokens for every sequence run. The charge is admitted while the key's bucket is not in debt and may take
it below zero (a large request is not refused forever; the next ones wait for the debt to refill). When
the answer's usage is known (a whole answer, or a stream with include_usage), the unused part of the
max_tokens reservation is given back. Without API keys the buckets are per client address.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from servelm.errors import RateLimited
from servelm.http.asgi import ASGIApp, Receive, Scope, Send, send_error
from servelm.http.auth import BATCH_OWNER, OPEN_PATHS, current_key

SCOPE_TOKENS = "servelm.tpm"  # the key's token bucket, when it has a tokens-per-minute limit
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
        self._refill()
        if self.level > 0:
            self.level -= cost
            return 0.0
        return max(-self.level / self.rate, 1.0 / self.rate)

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
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or BATCH_OWNER in scope:  # a batch has its own bounds
            await self.app(scope, receive, send)
            return
        key = current_key(scope)
        caller, rpm, tpm = caller_of(scope), self.limiter.rpm, self.limiter.tpm
        if key is not None:
            rpm = rpm if key.rpm is None else key.rpm
            tpm = tpm if key.tpm is None else key.tpm
        requests = self.limiter.bucket(caller, "requests", rpm)
        if requests is not None:
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
    wait = bucket.take_on_credit(prompt_tokens + reserved)
    if wait:
        raise RateLimited(
            f"Rate limit reached on tokens per min (TPM): Limit {int(bucket.capacity)}. Please try again in "
            f"{math.ceil(wait)}s.", wait, kind="tokens")
    return Charge(bucket, reserved)
