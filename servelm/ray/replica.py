"""ModelReplica: one replica of one deployment under Ray Serve, holding one engine.

The replica builds its deployment with servelm.compose (the same llama.cpp runner, LocalEngine and embedding
context a single-process server builds) and starts it. The ingress reaches it only through a
DeploymentHandle:

- `generate(request)` streams: first the replica's id (a str, so the ingress can say who served the request
  before any token exists), then lists of GenerationOutput, one list per hand-off (every output the engine had
  ready when the stream asked: a slow reader gets fewer, larger items).
- `embed(inputs)` answers one array of pooled vectors; `stats()` and `describe()` are small snapshots.

Ray Serve calls `check_health` periodically: an engine thread that died fails it, and the replica is replaced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from ray import serve

from servelm.config import DeploymentSpec
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest
from servelm.service.deployments import ModelFacts, TextDeployment, all_alive

if TYPE_CHECKING:
    from servelm.compose import Built

log = logging.getLogger("servelm.ray")


@dataclass(frozen=True)
class EmbeddingInfo:
    dim: int
    vocab_size: int
    context_window: int


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to know of a deployment that only its replicas can tell (they hold the model)."""

    fingerprint: str
    context_window: int
    max_choices: int
    embedding: EmbeddingInfo | None
    facts: ModelFacts = ModelFacts()  # its exactness, as the replica's self-check found it


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    engine: EngineStats | None
    embedder: Any | None  # EmbeddingStats


def replica_id() -> str:
    """This replica's short id (Ray Serve's unique id; `x-servelm-replica` carries it)."""
    return str(serve.get_replica_context().replica_id.unique_id)


class ModelReplica:
    def __init__(self, spec: dict[str, Any], verbose_llama: bool = False) -> None:
        from servelm.compose import build

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._spec = DeploymentSpec.model_validate(spec)
        built = build([self._spec], [], verbose_llama)
        built.start()
        self._built: Built | None = built
        self._deployment = built.deployments.all()[0]
        self._id = replica_id()
        log.info("replica %s of %r is ready", self._id, self._spec.name)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[str | list[GenerationOutput], None]:
        d = self._deployment
        if not isinstance(d, TextDeployment):
            raise RuntimeError(f"the deployment {self._spec.name!r} does not generate text")
        engine = d.engine
        yield self._id
        ready: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.ensure_future(_pump(engine.generate(request), ready))
        try:
            while True:
                item = await ready.get()
                batch = [item]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                outputs = [o for o in batch if isinstance(o, GenerationOutput)]
                if outputs:
                    yield outputs
                ends = [o for o in batch if not isinstance(o, GenerationOutput)]
                if ends:
                    if isinstance(ends[0], BaseException):
                        raise ends[0]
                    return
        finally:
            pump.cancel()  # a cancelled stream (the client went away) closes the engine's generator: abort

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        embedder = self._deployment.embedder
        if embedder is None:
            raise RuntimeError(f"the deployment {self._spec.name!r} does not embed")
        return await embedder.embed(inputs)

    def stats(self) -> ReplicaStats:
        d = self._deployment
        return ReplicaStats(self._id, d.engine.stats() if isinstance(d, TextDeployment) else None,
                            d.embedder.stats() if d.embedder is not None else None)

    def describe(self) -> ReplicaInfo:
        d = self._deployment
        emb = d.embedder
        info = EmbeddingInfo(emb.dim, emb.vocab_size, emb.context_window) if emb is not None else None
        if isinstance(d, TextDeployment):
            return ReplicaInfo(d.fingerprint, d.context_window, d.max_choices, info, d.facts)
        return ReplicaInfo(d.fingerprint, d.context_window, 0, info)

    def check_health(self) -> None:
        if not all_alive([self._deployment]):
                raise RuntimeError(f"an engine thread of {self._spec.name!r} has stopped")

    def __del__(self) -> None:  # Ray Serve's graceful shutdown of the replica
        built = getattr(self, "_built", None)
        if built is not None:
            built.stop()
            built.close()
            self._built = None


_END = object()


async def _pump(outputs: AsyncGenerator[GenerationOutput, None], ready: asyncio.Queue[Any]) -> None:
    """Move the engine's outputs into `ready`, then _END (or the exception that stopped them)."""
    try:
        async with aclosing(outputs) as it:
            async for out in it:
                ready.put_nowait(out)
        ready.put_nowait(_END)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the stream, which raises it to the ingress
        ready.put_nowait(exc)
