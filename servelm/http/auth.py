"""API keys: loaded once and kept only as SHA-256 digests; checked by a pure-ASGI middleware that answers
401 itself. A key may be limited to some deployments: asking for another is a 404 `model_not_found`, the
same answer as for a model that does not exist (it reveals nothing).

Keys come from --api-key (repeatable; SERVELM_API_KEY takes a comma-separated list), from --api-key-file
(one a line), and from the config file's [[keys]] tables. A line of the file, or a table, may limit the key:

    sk-alpha                                   # any deployment, the server's rate limits
    sk-beta deployments=smollm2,minilm rpm=60 tpm=20000 max_waiting=16
    sha256:6b86b273ff34fce19d6b804eff5a3f57...  deployments=smollm2   # the key's digest, not the key

    [[keys]]                                   # in the config file
    key = "sk-gamma"                           # or key_sha256 = "6b86…"
    deployments = ["smollm2"]
    rpm = 60
    tpm = 20000
    max_waiting = 16                           # places in a deployment's waiting queue (--max-waiting-per-key)
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from servelm.errors import ModelNotFound, Unauthorized
from servelm.http.asgi import ASGIApp, Receive, Scope, Send, header, send_error

OPENAPI_PATH = "/openapi.json"
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", OPENAPI_PATH})  # probes, scrapers and the API's description
SCOPE_KEY = "servelm.key"  # the request's KeySpec, set in the ASGI scope by AuthMiddleware

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an api-key header.")
WRONG = "Incorrect API key provided."


@dataclass(frozen=True)
class KeySpec:
    digest: bytes  # SHA-256 of the key: the key itself is never kept
    deployments: frozenset[str] | None = None  # the model names it may use; None: all
    rpm: int | None = None  # requests per minute; None: the server's --rate-limit-rpm; 0: none
    tpm: int | None = None  # tokens per minute; None: the server's --rate-limit-tpm; 0: none
    name: str = ""  # a label for logs
    max_waiting: int | None = None  # places it may hold in a deployment's queue; None: --max-waiting-per-key

    @property
    def label(self) -> str:
        return self.name or f"key-{self.digest.hex()[:8]}"


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_spec(key: str | None = None, *, sha256: str | None = None, deployments: Iterable[str] | None = None,
             rpm: int | None = None, tpm: int | None = None, name: str = "",
             max_waiting: int | None = None) -> KeySpec:
    """A KeySpec from a key or its digest (hex); a ValueError says what is wrong."""
    if (key is None) == (sha256 is None):
        raise ValueError("a key needs exactly one of `key` and `key_sha256`")
    if key is not None:
        if not key.strip() or key != key.strip():
            raise ValueError("an API key may not be empty or begin or end with spaces")
        digest = hash_key(key)
    else:
        try:
            digest = bytes.fromhex(sha256 or "")
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError("key_sha256 must be 64 hexadecimal digits (a SHA-256 digest)")
    for limit in (rpm, tpm, max_waiting):
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError("rpm, tpm and max_waiting must be whole numbers >= 0")
    names = None if deployments is None else frozenset(deployments)
    return KeySpec(digest, names, rpm, tpm, name, max_waiting)


def key_from_table(table: Mapping[str, Any]) -> KeySpec:
    """A config file's [[keys]] table: key or key_sha256, and optionally deployments, rpm, tpm, max_waiting, name."""
    unknown = set(table) - {"key", "key_sha256", "deployments", "rpm", "tpm", "max_waiting", "name"}
    if unknown:
        raise ValueError(f"unknown field(s) in a [[keys]] table: {', '.join(sorted(unknown))}")
    deployments = table.get("deployments")
    if isinstance(deployments, str):
        deployments = [deployments]
    return key_spec(table.get("key"), sha256=table.get("key_sha256"), deployments=deployments,
                    rpm=table.get("rpm"), tpm=table.get("tpm"), name=str(table.get("name", "")),
                    max_waiting=table.get("max_waiting"))


def parse_key_file(text: str, source: str = "the key file") -> list[KeySpec]:
    specs = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()  # a key cannot hold `#`
        if not line:
            continue
        first, *options = line.split()
        fields: dict[str, Any] = {"key_sha256": first[7:]} if first.startswith("sha256:") else {"key": first}
        try:
            for option in options:
                name, sep, value = option.partition("=")
                if not sep or name not in ("deployments", "rpm", "tpm", "max_waiting", "name"):
                    raise ValueError(f"expected deployments=a,b rpm=N tpm=N max_waiting=N or name=TEXT, not {option!r}")
                if name == "deployments":
                    fields[name] = [d for d in value.split(",") if d]
                else:
                    fields[name] = value if name == "name" else int(value)
            specs.append(key_from_table(fields))
        except ValueError as exc:
            raise ValueError(f"{source}, line {number}: {exc}") from None
    return specs


class _KeySettings(Protocol):
    api_key: list[str]
    api_key_file: Path | None


def load_keys(settings: _KeySettings, tables: Sequence[Mapping[str, Any]] = ()) -> list[KeySpec]:
    """Every key the settings name (flags, variable, file) plus the config file's [[keys]] tables."""
    specs = [key_spec(k) for k in settings.api_key]
    if settings.api_key_file is not None:
        path = Path(settings.api_key_file)
        specs += parse_key_file(path.read_text(encoding="utf-8"), str(path))
    for number, table in enumerate(tables, 1):
        try:
            specs.append(key_from_table(table))
        except ValueError as exc:
            raise ValueError(f"[[keys]] table {number}: {exc}") from None
    return specs


def presented_keys(scope: Scope) -> list[str]:
    """The keys a request carries: `Authorization: Bearer KEY` (OpenAI) and `api-key: KEY` (Azure)."""
    found = []
    auth = header(scope, b"authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            found.append(value.strip())
    api_key = header(scope, b"api-key")
    if api_key and api_key.strip():
        found.append(api_key.strip())
    return found


class AuthMiddleware:
    """401 unless the request carries a known key; the key's KeySpec goes into scope["servelm.key"]."""

    def __init__(self, app: ASGIApp, keys: Sequence[KeySpec], open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = tuple(keys)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope)
        if not presented:
            await send_error(send, Unauthorized(MISSING), scope)
            return
        spec = self.match(presented)
        if spec is None:
            await send_error(send, Unauthorized(WRONG, 'Bearer error="invalid_token"'), scope)
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
