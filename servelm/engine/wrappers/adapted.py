"""AdaptedEngine: holds a request's LoRA adapters loaded (and counted in use) while it runs (service/registry/
adapters.py's Adapters loads and frees them)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Generic, Protocol, TypeVar

from servelm.engine.base import Engine, EngineWrapper
from servelm.engine.types import GenerationOutput, GenerationRequest

H = TypeVar("H")


class AdapterHolder(Protocol[H]):
    """What AdaptedEngine needs of a deployment's adapters: a request's (name, scale) pairs held loaded while it
    runs (`H`: what was held), then let go."""

    async def hold(self, adapters: tuple[tuple[str, float], ...]) -> H: ...

    def release(self, held: H) -> None: ...


class AdaptedEngine(EngineWrapper, Generic[H]):
    """Holds a request's LoRA adapters loaded (and counted in use) while it runs."""

    def __init__(self, inner: Engine, adapters: AdapterHolder[H]) -> None:
        super().__init__(inner)
        self.adapters = adapters

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        held = await self.adapters.hold(request.adapters)  # none for the base model
        try:  # closed first, so that the engine has its abort before the adapters are let go
            async with aclosing(self.inner.generate(request)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.adapters.release(held)
