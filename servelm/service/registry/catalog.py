"""Models that come and go: what the HTTP layer asks of the server's catalog of models loaded on demand (its
implementation, servelm/fleet.py, loads and unloads them), each model's status as /v1/models tells it, and
Ollama's `keep_alive`."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from servelm.errors import InvalidParameter
from servelm.metrics import ModelCounts
from servelm.service.registry.deployments import Deployments

Status = Literal["loaded", "loading", "unloaded", "failed"]


@dataclass(frozen=True)
class ModelStatus:
    """A model's state, in the field llama-server's router mode uses (`status.value`), with the reason a load
    failed."""

    value: Status
    reason: str | None = None

    def wire(self) -> dict[str, object]:
        out: dict[str, object] = {"value": self.value}
        if self.reason:
            out["reason"] = self.reason
        return out


class ModelCatalog(Protocol):
    """The models a server loads when a request names them and unloads when idle, or by route."""

    def statuses(self) -> dict[str, ModelStatus]:
        """Every model of the catalog by name, loaded or not."""
        ...

    async def resolve(self, model: str) -> str | None:
        """The catalog's model a request's `model` names (by name or alias), looking in the models directory (off
        the event loop) for a name it does not know yet; None: not one of the catalog's. A name that cannot be a
        model's (too long, a projector's, a later shard's) is None without a look, and one found not to be a model
        is not looked for again until what is on disk under it changes."""
        ...

    def use(self, name: str, keep_alive: float | None) -> AbstractAsyncContextManager[None]:
        """Holds the model loaded while the block runs: loads it first when it is not (waiting as long as that
        takes), and it is not unloaded while any block holds it. `keep_alive`: seconds it stays loaded after this
        request (None: the server's default, negative: forever, 0: unloaded at once)."""
        ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None:
        """Unloads it once the requests on it end (new ones wait, then load it again)."""
        ...

    async def refresh(self) -> None:
        """Rescans the models directory, off the event loop; calls while a scan runs share the next one."""
        ...

    def attach(self, registry: Deployments) -> None:
        """The app's deployments, where loaded models go (with the app's engine wrappers) and whence they leave."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Unloads every model (each writes its prefix cache out)."""
        ...

    def counts(self) -> Iterable[ModelCounts]: ...


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


KEEP_ALIVE_MAX_S = 2**31 - 1  # seconds (68 years): past it, a 400


def parse_keep_alive(value: object) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a Go duration string ("5m", "1h30m", "0", "-1m"); a negative
    one keeps the model loaded. At most KEEP_ALIVE_MAX_S either way, written in ASCII. A 400 naming the field for
    anything else (NaN, Infinity, "1e999", other scripts' digits)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad_keep_alive(value)
    if isinstance(value, str):
        seconds = _duration(value)
    else:
        seconds = float(value) if abs(value) <= KEEP_ALIVE_MAX_S else math.inf
    if not math.isfinite(seconds) or abs(seconds) > KEEP_ALIVE_MAX_S:
        raise _bad_keep_alive(value)
    return seconds


def _duration(value: str) -> float:
    text = value.strip()
    if not text.isascii():
        raise _bad_keep_alive(value)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)  # a number written as text: seconds
    except ValueError:
        pass
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise _bad_keep_alive(value)
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)


def _bad_keep_alive(value: object) -> InvalidParameter:
    return InvalidParameter(f"Invalid keep_alive {value!r}: give seconds, a duration such as \"5m\" or \"1h30m\", "
                            "0 to unload the model after this request, or -1 to keep it loaded.", "keep_alive")
