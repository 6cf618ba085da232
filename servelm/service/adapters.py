"""LoRA adapters of a text deployment: the ones it knows (from --lora, `loras` in the config, or loaded by route),
which of them are loaded in its runner (at most --max-loras; the least recently used idle one is freed first and
loaded again when a request names it), which a request runs with (`model: NAME`, or llama-server's per-request
`lora: [{"id", "scale"}]`), and AdaptedEngine, which holds a request's adapters loaded while it runs.

AdapterRegistry is what the HTTP and service layers see: names, ids and scales, choosing a request's adapters, and
the routes' add and remove. Adapters is a local engine's; servelm/ray's ingress has its own, whose adds and removes
reach every replica."""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelm.engine.base import AdapterHost, Engine, EngineWrapper
from servelm.engine.types import GenerationOutput, GenerationRequest
from servelm.errors import InvalidParameter, NotFound, ServiceUnavailable

RETRY_AFTER_S = 2


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


class Adapters(AdapterRegistry):
    """The LoRA adapters of a deployment whose engine (an AdapterHost) runs here."""

    def __init__(self, host: AdapterHost, max_loaded: int = 8) -> None:
        super().__init__(max_loaded)
        self.host = host
        self._lock = asyncio.Lock()  # loads and frees, one at a time
        self._idle = asyncio.Event()

    def add_at_start(self, name: str, path: str, scale: float = 1.0) -> None:
        """An adapter of --lora / `loras`: loaded now (a ValueError names the file and llama.cpp's reason)."""
        adapter = self._register(name, path, scale)
        try:
            self.host.load_adapter(name, path)
        except ValueError as exc:
            del self._by_name[name]
            raise ValueError(f"LoRA adapter {name!r} ({path}): {exc}") from None
        adapter.loaded = True

    async def add(self, name: str, path: str, scale: float = 1.0) -> None:
        if not Path(path).is_file():
            raise NotFound(f"The LoRA adapter file '{path}' does not exist.", code="lora_path_not_found")
        async with self._lock:
            adapter = self._register(name, path, scale)
            try:
                await self._load(adapter)
            except InvalidParameter:
                del self._by_name[name]
                raise

    async def remove(self, name: str) -> None:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(name)
        while adapter.users:
            self._idle.clear()
            await self._idle.wait()
        async with self._lock:
            if adapter.loaded:
                await asyncio.to_thread(self.host.free_adapter, name)
                adapter.loaded = False

    async def hold(self, adapters: tuple[tuple[str, float], ...]) -> list[Adapter]:
        """The request's adapters loaded (an idle one freed first past max_loaded), each counted as in use."""
        held: list[Adapter] = []
        for name, _ in adapters:
            adapter = self._by_name.get(name)
            if adapter is None:  # unloaded by route since the request was prepared
                self.release(held)
                raise AdapterNotFound(name)
            adapter.users += 1
            adapter.requests += 1
            adapter.last_used = time.monotonic()
            held.append(adapter)
        try:
            for adapter in held:
                if not adapter.loaded:
                    async with self._lock:
                        if not adapter.loaded:
                            await self._load(adapter)
        except BaseException:
            self.release(held)
            raise
        return held

    def release(self, held: list[Adapter]) -> None:
        for adapter in held:
            adapter.users -= 1
            adapter.last_used = time.monotonic()
        self._idle.set()

    async def _load(self, adapter: Adapter) -> None:
        """Loads it, freeing the least recently used idle adapters past max_loaded first (under self._lock)."""
        loaded = [a for a in self._by_name.values() if a.loaded]
        idle = sorted((a for a in loaded if a.users == 0 and a is not adapter), key=lambda a: a.last_used)
        while len(loaded) >= self.max_loaded:
            if not idle:
                error = ServiceUnavailable(f"{self.max_loaded} LoRA adapters (--max-loras) are loaded and every one "
                                           "has requests under way; retry later.", code="lora_limit")
                error.headers = {"Retry-After": str(RETRY_AFTER_S)}
                raise error
            victim = idle.pop(0)
            await asyncio.to_thread(self.host.free_adapter, victim.name)
            victim.loaded = False
            loaded.remove(victim)
        try:
            await asyncio.to_thread(self.host.load_adapter, adapter.name, adapter.path)
        except ValueError as exc:
            raise InvalidParameter(f"The file '{adapter.path}' is not a LoRA adapter of this model: {exc}",
                                   "lora_path", code="invalid_lora") from None
        adapter.loaded = True


class AdaptedEngine(EngineWrapper):
    """Holds a request's LoRA adapters loaded (and counted in use) while it runs."""

    def __init__(self, inner: Engine, adapters: Adapters) -> None:
        super().__init__(inner)
        self.adapters = adapters

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        held = await self.adapters.hold(request.adapters)  # none for the base model
        try:
            async for out in self.inner.generate(request):
                yield out
        finally:
            self.adapters.release(held)
