"""LoRA adapters of a text deployment: the ones it knows (from --lora, `loras` in the config, or loaded by route),
which of them are loaded in its runner (at most --max-loras; the least recently used idle one is freed first and
loaded again when a request names it), which a request runs with (`model: NAME`, or llama-server's per-request
`lora: [{"id", "scale"}]`); engine/wrappers/adapted.py's AdaptedEngine holds a request's adapters loaded while it
runs.

AdapterRegistry is what the HTTP and service layers see: names, ids and scales, choosing a request's adapters, and
the routes' add and remove. Adapters is a local engine's; servelm/ray's ingress has its own, whose adds and removes
reach every replica."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from servelm.engine.base import AdapterHost, AdapterInUse
from servelm.errors import InvalidParameter, NotFound, ServiceUnavailable

RETRY_AFTER_S = 2
SCALE_BOUND = 10.0  # an adapter's scale, by route or per request (protocol/common.py's LoraChoice): at most this, ±
MAX_NAME_BYTES = 200  # an adapter's name, as a models directory's model name (servelm/fleet.py)
WAIT_POLL_S = 0.5  # a request waiting for a --max-loras place looks again at least this often

log = logging.getLogger("servelm.adapters")
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    scale: float
    id: int  # llama-server's: its place among the deployment's adapters, in the order they came
    loaded: bool = False
    users: int = 0  # requests running with it
    last_used: float = field(default_factory=time.monotonic)
    requests: int = 0  # requests that ran with it (/metrics)
    drained_by: object | None = None  # a waiting request's turn: no new request starts on it until it is freed


class AdapterNotFound(NotFound):
    def __init__(self, name: str) -> None:
        super().__init__(f"The LoRA adapter '{name}' cannot be found.", code="lora_not_found")


class AdapterRegistry(abc.ABC):
    """One deployment's LoRA adapters by name: which a request runs with, and the routes that add and remove them."""

    def __init__(self, max_loaded: int = 8) -> None:
        self.max_loaded = max_loaded
        self._by_name: dict[str, Adapter] = {}
        self._next_id = 0

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def all(self) -> list[Adapter]:
        return list(self._by_name.values())

    def _register(self, name: str, path: str, scale: float) -> Adapter:
        try:
            size = len(name.encode())
        except UnicodeEncodeError:  # a lone surrogate
            size = MAX_NAME_BYTES + 1
        if size > MAX_NAME_BYTES or not name.isprintable() or name != name.strip():
            raise InvalidParameter(f"`lora_name` must be at most {MAX_NAME_BYTES} bytes of UTF-8, of printable "
                                   "characters (no control characters), without spaces at either end.", "lora_name")
        if name in self._by_name:
            raise InvalidParameter(f"The lora adapter '{name}' has already been loaded.", "lora_name",
                                   code="lora_already_loaded")
        adapter = Adapter(name, path, scale, self._next_id)
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    @abc.abstractmethod
    async def add(self, name: str, path: str, scale: float = 1.0) -> None:
        """vLLM's POST /v1/load_lora_adapter: 400 for a name loaded already or a file that is not one of this
        model's adapters (llama.cpp's reason quoted), 404 for a path that does not exist."""

    @abc.abstractmethod
    async def remove(self, name: str) -> None:
        """vLLM's POST /v1/unload_lora_adapter: gone for new requests at once, freed once its requests end."""

    def select(self, model: str, lora: Sequence[Any] | None) -> tuple[tuple[str, float], ...]:
        """The adapters a request runs with: the one `model` names, and those llama-server's `lora` list names by
        id (scale 0: not applied); a 400 naming `lora` for an id this deployment does not have."""
        chosen: dict[str, float] = {}
        if model in self._by_name:
            chosen[model] = self._by_name[model].scale
        by_id = {a.id: a for a in self._by_name.values()}
        for i, item in enumerate(lora or ()):
            adapter = by_id.get(item.id)
            if adapter is None:
                raise InvalidParameter(f"lora[{i}].id {item.id} names no LoRA adapter of this model (its adapters' "
                                       f"ids: {sorted(by_id)}).", "lora")
            scale = adapter.scale if item.scale is None else item.scale
            if scale:
                chosen[adapter.name] = scale
            else:
                chosen.pop(adapter.name, None)
        if len(chosen) > self.max_loaded:
            raise InvalidParameter(f"A request may use at most {self.max_loaded} LoRA adapters at once (--max-loras); "
                                   f"this one names {len(chosen)}.", "lora")
        return tuple(sorted(chosen.items()))


def uninterrupted(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A load or free runs to its end, and records what it did, even if the request that asked is cancelled
    meanwhile (the engine's state and the record must agree); the lock stays held until then."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        task = asyncio.ensure_future(fn(*args, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: whoever asked is gone
            raise

    return run


class Adapters(AdapterRegistry):
    """The LoRA adapters of a deployment whose engine (an AdapterHost) runs here.

    An adapter is loaded, evicted or freed only while no request holds it (and the engine refuses to free one that
    scheduled work names). A request whose adapters are not all loaded, when every place of --max-loras is held by
    running requests, waits for its turn: it drains the least used of them (no new request starts on an adapter
    being drained; those wait in turn), and takes its place once that one's requests end."""

    def __init__(self, host: AdapterHost, max_loaded: int = 8) -> None:
        super().__init__(max_loaded)
        self.host = host
        self._lock = asyncio.Lock()  # loads and frees, one at a time
        self._changed = asyncio.Event()  # a request let its adapters go, or adapters were loaded or freed
        self._resident: set[Adapter] = set()  # loaded in the engine (a removed one too, until its requests end)

    def add_at_start(self, name: str, path: str, scale: float = 1.0) -> None:
        """An adapter of --lora / `loras`: loaded now (a ValueError names the file and llama.cpp's reason)."""
        adapter = self._register(name, path, scale)
        try:
            self.host.load_adapter(name, path)
        except ValueError as exc:
            del self._by_name[name]
            raise ValueError(f"LoRA adapter {name!r} ({path}): {exc}") from None
        adapter.loaded = True
        self._resident.add(adapter)

    async def add(self, name: str, path: str, scale: float = 1.0) -> None:
        await asyncio.to_thread(check_file, path)
        async with self._lock:
            adapter = self._register(name, path, scale)
            try:
                if not await self._make_room([adapter], None):
                    error = ServiceUnavailable(f"{self.max_loaded} LoRA adapters (--max-loras) are loaded and every "
                                               "one has requests under way; retry later.", code="lora_limit")
                    error.headers = {"Retry-After": str(RETRY_AFTER_S)}
                    raise error
            except BaseException:
                del self._by_name[name]
                raise

    async def remove(self, name: str) -> None:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(name)
        while True:
            async with self._lock:
                if adapter.users == 0 and (not adapter.loaded or await self._free(adapter)):
                    return
                self._changed.clear()
            await self._wait()

    async def hold(self, adapters: tuple[tuple[str, float], ...]) -> list[Adapter]:
        """The request's adapters loaded and counted as in use; it waits for its turn while --max-loras' places
        are all held (a 404 should one be removed meanwhile)."""
        turn = object()  # what this request drains while it waits
        try:
            while True:
                wanted = self._resolve(adapters)
                if all(a.loaded and a.drained_by is None for a in wanted):
                    return self._take(wanted)
                async with self._lock:
                    wanted = self._resolve(adapters)
                    if await self._make_room(wanted, turn):
                        return self._take(wanted)
                    self._changed.clear()
                await self._wait()
        finally:
            self._undrain(turn)

    def release(self, held: list[Adapter]) -> None:
        for adapter in held:
            adapter.users -= 1
            adapter.last_used = time.monotonic()
        self._changed.set()

    def _resolve(self, adapters: tuple[tuple[str, float], ...]) -> list[Adapter]:
        wanted = [self._by_name.get(name) for name, _ in adapters]
        for (name, _), adapter in zip(adapters, wanted):
            if adapter is None:  # unloaded by route since the request was prepared
                raise AdapterNotFound(name)
        return [a for a in wanted if a is not None]

    def _take(self, held: list[Adapter]) -> list[Adapter]:
        for adapter in held:
            adapter.users += 1
            adapter.requests += 1
            adapter.last_used = time.monotonic()
        return held

    async def _wait(self) -> None:
        """Until something changes (or a while, should the engine have refused a free)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), WAIT_POLL_S)

    def _undrain(self, turn: object) -> None:
        for adapter in self._resident:
            if adapter.drained_by is turn:
                adapter.drained_by = None
                self._changed.set()

    async def _make_room(self, wanted: list[Adapter], turn: object | None) -> bool:
        """Under self._lock: loads the wanted adapters not loaded, freeing idle ones first (the least recently used
        first) past max_loaded. False when there is no room yet; then, for a request (`turn`), busy adapters are
        drained until their requests end, enough to make room."""
        if any(a.drained_by not in (None, turn) for a in wanted):  # another request's turn: it goes first
            self._undrain(turn)  # and one that waits for another holds none (no two wait for each other)
            return False
        missing = [a for a in wanted if not a.loaded]
        others = [a for a in self._resident if a not in wanted and a.drained_by in (None, turn)]
        idle = sorted((a for a in others if a.users == 0), key=lambda a: (a.drained_by is not turn, a.last_used))
        short = len(missing) - (self.max_loaded - len(self._resident))  # places to free
        if short > len(idle):
            if turn is not None:
                busy = sorted((a for a in others if a.users), key=lambda a: (a.drained_by is not turn, a.users,
                                                                                a.last_used))
                for adapter in busy[:short - len(idle)]:
                    adapter.drained_by = turn
            return False
        for victim in idle[:max(short, 0)]:
            if not await self._free(victim):
                return False
        for adapter in missing:
            await self._load(adapter)
        return True

    @uninterrupted
    async def _load(self, adapter: Adapter) -> None:
        try:
            await asyncio.to_thread(self.host.load_adapter, adapter.name, adapter.path)
        except ValueError as exc:
            raise InvalidParameter(f"The file '{adapter.path}' is not a LoRA adapter of this model: {exc}",
                                   "lora_path", code="invalid_lora") from None
        adapter.loaded = True
        self._resident.add(adapter)
        self._changed.set()

    @uninterrupted
    async def _free(self, adapter: Adapter) -> bool:
        """Frees an idle adapter (under self._lock); False if a request holds it, or the engine still has work
        that names it."""
        if adapter.users:
            return False
        adapter.loaded = False  # no request starts on it meanwhile: they wait for the lock
        try:
            await asyncio.to_thread(self.host.free_adapter, adapter.name)
        except AdapterInUse:
            log.warning("LoRA adapter %r: the engine still has work that names it; kept loaded", adapter.name)
            adapter.loaded = True
            return False
        self._resident.discard(adapter)
        adapter.drained_by = None
        self._changed.set()
        return True


def check_file(path: str) -> None:
    """A 404 for an adapter file that does not exist, a 400 naming lora_path for a path the system refuses (a
    name over NAME_MAX, ...) or that is not a regular file."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(f"The LoRA adapter file '{path}' does not exist.", code="lora_path_not_found") from None
    except (OSError, ValueError) as exc:
        raise InvalidParameter(f"`lora_path` cannot be read: {getattr(exc, 'strerror', None) or exc}.",
                               "lora_path") from None
    if not regular:
        raise InvalidParameter(f"`lora_path` '{path}' is not a regular file.", "lora_path")


def check_scale(scale: object) -> float:
    """An adapter's scale: a finite number within ±SCALE_BOUND (llama-server's per-request bound), else a 400."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or abs(scale) > SCALE_BOUND:
        raise InvalidParameter(f"`scale` must be a number from {-SCALE_BOUND} to {SCALE_BOUND}.", "scale")
    return float(scale)
