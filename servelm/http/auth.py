"""API keys checked by a pure-ASGI middleware that answers 401 itself (servelm/keys.py loads them). A key may
be limited to some deployments: asking for another is a 404 `model_not_found`, the same answer as for a model
that does not exist (it reveals nothing)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Protocol

from servelm.errors import Forbidden, ModelNotFound, Unauthorized
from servelm.http.asgi import ASGIApp, Receive, Scope, Send, header, send_error
from servelm.keys import KeySpec, hash_key

OPENAPI_PATH = "/openapi.json"
# probes, scrapers, the API's description, and the playground's page (it holds nothing; it asks for a key itself)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", OPENAPI_PATH, "/"})
SCOPE_KEY = "servelm.key"  # the request's KeySpec, set in the ASGI scope by AuthMiddleware
# a batch line's call in this process (http/batches.py AppCaller): its owner, the digest of the key that created the
# batch ("" on an open server); only code in the process sets it (a client's scope comes from the server)
BATCH_OWNER = "servelm.batch_owner"
KEYS_ON = "servelm.keys_on"  # set in the scope when the server has API keys
# open, but what they say depends on the key: /health says more to a key, /metrics answers only a monitor key
KEYED_OPEN_PATHS = frozenset({"/health", "/metrics"})

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an api-key or x-api-key header.")
WRONG = "Incorrect API key provided."


def _unknown(presented: Sequence[str]) -> Unauthorized:
    """The 401 for a request that matched no key: none presented, or one the server does not know."""
    return Unauthorized(WRONG, 'Bearer error="invalid_token"') if presented else Unauthorized(MISSING)


def presented_keys(scope: Scope) -> list[str]:
    """The keys a request carries: `Authorization: Bearer KEY` (OpenAI), `api-key: KEY` (Azure) and
    `x-api-key: KEY` (Anthropic)."""
    found = []
    auth = header(scope, b"authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            found.append(value.strip())
    for name in (b"api-key", b"x-api-key"):
        key = header(scope, name)
        if key and key.strip():
            found.append(key.strip())
    return found


class AuthMiddleware:
    """401 unless the request carries a known key; the key's KeySpec goes into scope["servelm.key"]."""

    def __init__(self, app: ASGIApp, keys: Sequence[KeySpec], open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = tuple(keys)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        scope[KEYS_ON] = True
        if BATCH_OWNER in scope:  # a batch's line, as the key that created the batch (while the server knows it)
            spec = next((k for k in self.keys if k.digest.hex() == scope[BATCH_OWNER]), None)
            if spec is None:
                await send_error(send, Unauthorized("The key that created this batch is no longer accepted."), scope)
                return
            scope[SCOPE_KEY] = spec
            await self.app(scope, receive, send)
            return
        if scope["path"] in KEYED_OPEN_PATHS:
            presented = presented_keys(scope)
            spec = self.match(presented)
            if scope["path"] == "/metrics" and (spec is None or not spec.monitor):
                await send_error(send, _unknown(presented) if spec is None else
                                 Forbidden("/metrics answers a monitoring key only (--monitor-key): its counters "
                                           "add up every key's traffic."), scope)
                return
            if spec is not None:
                scope[SCOPE_KEY] = spec
            await self.app(scope, receive, send)
            return
        if scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope)
        spec = self.match(presented)
        if spec is None:
            await send_error(send, _unknown(presented), scope)
            return
        scope[SCOPE_KEY] = spec
        await self.app(scope, receive, send)

    def match(self, presented: Sequence[str]) -> KeySpec | None:
        """Compare every presented key's digest with every stored one, in constant time, without stopping
        at a match (the time taken says nothing about which key, or how much of one, matched)."""
        found = None
        for digest in (hash_key(k) for k in presented):
            for spec in self.keys:
                if hmac.compare_digest(digest, spec.digest) and found is None:
                    found = spec
        return found


def current_key(scope: Scope) -> KeySpec | None:
    return scope.get(SCOPE_KEY)


def sees_counters(scope: Scope) -> tuple[bool, bool]:
    """What /health may tell this caller: (the engines' load and state, the prefix cache's counters). Everything on an
    open server; with keys on, nothing but up or down without a key, the load to any key, and the prefix cache's
    counters (every key's hits added up: a side channel on what another key sent) to a monitoring key only."""
    if not scope.get(KEYS_ON):
        return True, True
    spec = current_key(scope)
    return spec is not None, spec is not None and spec.monitor


def allowed(scope: Scope, *names: str | None) -> bool:
    """Whether the request's key may use a model known by any of these names (an open server: always)."""
    spec = current_key(scope)
    if spec is None or spec.deployments is None:
        return True
    return any(n in spec.deployments for n in names if n)


class _Resolver(Protocol):
    def targets(self, model: str) -> list[str]: ...


def check_access(scope: Scope, deployments: _Resolver, model: str | None) -> None:
    """404 model_not_found, as for an unknown model, when the key may not use `model`: neither the name asked
    for nor every deployment it may reach (an alias's one, all of a weighted endpoint's) is the key's."""
    if not can_use(scope, deployments, model):
        raise ModelNotFound(model or "")


def can_use(scope: Scope, deployments: _Resolver, model: str | None) -> bool:
    if allowed(scope, model):
        return True
    targets = deployments.targets(model) if model else []
    return bool(targets) and all(allowed(scope, t) for t in targets)
