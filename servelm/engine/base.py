"""The protocols the service layer talks to: Engine (LocalEngine generates text), Embedder (EmbeddingEngine
pools vectors) and MediaReader (a runner's vision projector reads images); EngineWrapper, an Engine around
another."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

import numpy as np

from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, MediaChunk, SamplingParams


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


class AdapterHost(Protocol):
    """An engine whose model takes LoRA adapters (LocalEngine over llama.cpp). Both calls block: run them off the
    event loop."""

    def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter under `name`; a ValueError says why a file is not one of this model's adapters."""
        ...

    def free_adapter(self, name: str) -> None:
        """Free it, between two steps; AdapterInUse while scheduled work (running, or waiting in the engine) still
        names it."""
        ...


class AdapterInUse(RuntimeError):
    """A LoRA adapter that scheduled work still names: it stays loaded."""


class EngineWrapper:
    """An Engine around another (engine/wrappers/admission.py's QueuedEngine, engine/wrappers/metered.py's MeteredEngine): a
    subclass makes generate its own; the rest is the inner engine's."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        return self.inner.generate(request)

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def check_params(self, params: SamplingParams) -> None:
        self.inner.check_params(params)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    @property
    def alive(self) -> bool:  # /health and /ping ask
        return self.inner.alive


class Embedder(Protocol):
    """What the embeddings service needs of a deployment's embedding model (EmbeddingEngine is one)."""

    dim: int  # width of one vector
    vocab_size: int
    context_window: int  # most tokens one input may have
    cross_encoder: bool  # a reranker: an input is a query and a document together, its row the head's scores

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        """A cross-encoder's input for a query and a document (only a cross-encoder has one)."""
        ...

    async def embed(self, inputs: list[list[int]], caller: str = "") -> np.ndarray:
        """One pooled, unnormalized vector (a row) per input; inputs share forward passes with others', taken from
        each caller (an API key or a client's address) in turn."""
        ...

    def stats(self) -> Any: ...

    @property
    def alive(self) -> bool: ...


class MediaReader(Protocol):
    """What a prompt holds in an image's place, from a deployment's vision projector (runners/media.py)."""

    def read(self, data: bytes) -> list[tuple[int, ...] | MediaChunk]:
        """The image's tokens and media chunks in order (its markers' token ids, then its embedding positions).
        Raises ValueError for bytes that are not an image it can decode, or one it cannot take."""
        ...
