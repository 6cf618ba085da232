"""The Engine protocol that the service layer talks to; LocalEngine is the one implementation today."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest


class Engine(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield outputs for every choice of the request until each has finished."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop the request's sequences; their KV cells are freed at the next step."""
        ...

    def stats(self) -> EngineStats: ...
