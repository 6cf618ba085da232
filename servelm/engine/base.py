"""The protocols the service layer talks to: Engine (LocalEngine generates text) and Embedder
(EmbeddingEngine pools vectors)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

import numpy as np

from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, SamplingParams


class Engine(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        """Yield outputs for every choice of the request until each has finished."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop the request's sequences; their KV cells are freed at the next step."""
        ...

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidParameter for what this engine cannot take (vLLM: beam search). Called while a request is
        prepared, so that it is a 400 before any stream starts."""
        ...

    def stats(self) -> EngineStats: ...

    @property
    def alive(self) -> bool:
        """Its worker is running (what /health and SageMaker's /ping report)."""
        ...


class Embedder(Protocol):
    """What the embeddings service needs of a deployment's embedding model (EmbeddingEngine is one)."""

    dim: int  # width of one vector
    vocab_size: int
    context_window: int  # most tokens one input may have

    def tokenize(self, text: str) -> list[int]: ...

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One pooled, unnormalized vector (a row) per input; inputs share forward passes with others'."""
        ...

    def stats(self) -> Any: ...

    @property
    def alive(self) -> bool: ...
