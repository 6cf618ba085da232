"""ModelReplica: one replica of one deployment under Ray Serve, holding one engine.

The replica builds its deployment with servelm.compose (the same llama.cpp runner, LocalEngine and embedding
context a single-process server builds) and starts it. The ingress reaches it only through a
DeploymentHandle:

- `generate(request)` streams: first the replica's id (a str, so the ingress can say who served the request
  before any token exists), then lists of GenerationOutput, one list per hand-off (every output the engine had
  ready when the stream asked: a slow reader gets fewer, larger items).
- `embed(inputs)` answers one array of pooled vectors; `stats()` and `describe()` are small snapshots.
- `add_adapter`, `remove_adapter` and `ensure_adapters` act on its LoRA adapters (the ingress broadcasts them).
- An on-demand deployment's replica starts with no model: `load()` loads it (the ingress broadcasts it when a
  request names the model, and `generate`/`embed` load it if this replica joined since), `unload()` unloads it
  (its prefix cache written to its --prefix-cache-dir first).
- `record_routing_stats()` tells the router (servelm/ray/router.py) whether the model and which adapters are
  loaded here, so a request goes where they already are.

Ray Serve calls `check_health` periodically: an engine thread that died fails it, and the replica is replaced.

What a replica builds (Ray's and servelm's modules, its model, the vocabulary tables) lives as long as the model:
it is frozen out of the garbage collector's way, so that a full collection reads only what came since instead of
holding the engine thread's GIL for a tenth of a second. Ray Serve freezes what a replica's start built; a model
loaded on demand is frozen once loaded, and an unload thaws everything first, so that the model's cycles go with
it. `stats()` tells the ingress the replica's collector figures (/metrics: servelm_replica_gc_*).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from ray import serve

from servelm.config import DeploymentSpec
from servelm.engine.embedding import EmbeddingStats
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest
from servelm.errors import InvalidParameter, ServiceUnavailable
from servelm.fleet import free
from servelm.metrics import GC_PAUSE_SECONDS
from servelm.service.registry.adapters import Adapters
from servelm.service.registry.deployments import Deployment, ModelFacts, TextDeployment, all_alive
from servelm.tracing import RequestTrace, TraceSettings, Tracing

if TYPE_CHECKING:
    from servelm.compose import Built

log = logging.getLogger("servelm.ray")


@dataclass(frozen=True)
class EmbeddingInfo:
    dim: int
    vocab_size: int
    context_window: int
    cross_encoder: bool = False  # a reranker's rank pooling: its inputs are query-document pairs


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to know of a deployment that only its replicas can tell (they hold the model)."""

    fingerprint: str
    context_window: int
    max_choices: int
    embedding: EmbeddingInfo | None
    facts: ModelFacts = ModelFacts()  # its exactness, as the replica's self-check found it
    placement: str = ""  # where the replica's model runs


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    engine: EngineStats | None
    embedder: EmbeddingStats | None
    adapters: tuple[tuple[str, bool, int], ...] = ()  # its LoRA adapters: (name, loaded, requests run with it)
    gc_frozen: int = 0  # objects frozen out of the garbage collector's way (what it built), still alive
    gc_pause_seconds: tuple[float, ...] = ()  # seconds in the collector by generation, since the replica started


def replica_id() -> str:
    """This replica's short id (Ray Serve's unique id; `x-servelm-replica` carries it)."""
    return str(serve.get_replica_context().replica_id.unique_id)


class ModelReplica:
    def __init__(self, spec: dict[str, Any], verbose_llama: bool = False, on_demand: bool = False,
                 tracing: TraceSettings | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._spec = DeploymentSpec.model_validate(spec)
        self._tracing = Tracing(tracing) if tracing is not None else None
        self._verbose = verbose_llama
        self._built: Built | None = None
        self._loading = asyncio.Lock()
        self._id = replica_id()
        if not on_demand:
            self._build()
        log.info("replica %s of %r is ready%s", self._id, self._spec.name, " (its model loads on demand)" if on_demand else "")

    def _build(self) -> None:
        from servelm.compose import Builder

        built = Builder(self._verbose).one(self._spec)
        try:
            built.start()
        except BaseException:
            built.close()
            raise
        self._built = built

    @property
    def _deployment(self) -> Deployment:
        if self._built is None:
            raise ServiceUnavailable(f"The model `{self._spec.name}` is not loaded on this replica.", code="model_not_loaded")
        return self._built.deployments.all()[0]

    async def load(self) -> None:
        """Its model loaded (at once when it is)."""
        async with self._loading:
            if self._built is None:
                await asyncio.to_thread(self._build)
                await asyncio.to_thread(gc.collect)  # then frozen, as Ray Serve froze what the replica's start built
                gc.freeze()
                log.info("replica %s loaded %r", self._id, self._spec.name)

    async def unload(self) -> None:
        """Its model unloaded (the ingress's catalog asks once the model's requests have ended)."""
        async with self._loading:
            built, self._built = self._built, None
            if built is not None:
                gc.unfreeze()  # the model's objects, its cycles too, go with free()'s collection
                await asyncio.to_thread(free, built)
                gc.freeze()  # what is left, collected just now
                log.info("replica %s unloaded %r", self._id, self._spec.name)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[str | list[GenerationOutput], None]:
        if self._built is None:
            await self.load()
        d = self._deployment
        if not isinstance(d, TextDeployment):
            raise RuntimeError(f"the deployment {self._spec.name!r} does not generate text")
        engine = d.engine
        yield self._id
        trace = self._trace(request)
        ready: asyncio.Queue[object] = asyncio.Queue()  # outputs, then _END or the exception that ended them
        pump = asyncio.ensure_future(_pump(engine.generate(request), ready))
        try:
            while True:
                item = await ready.get()
                batch = [item]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                outputs = [o for o in batch if isinstance(o, GenerationOutput)]
                if trace is not None:
                    for o in outputs:
                        trace.output(request.request_id, o, len(request.prompt_token_ids))
                if outputs:
                    yield outputs
                ends = [o for o in batch if not isinstance(o, GenerationOutput)]
                if ends:
                    if isinstance(ends[0], BaseException):
                        raise ends[0]
                    return
        finally:
            pump.cancel()  # a cancelled stream (the client went away) closes the engine's generator: abort
            if trace is not None:
                trace.finish()
                trace.span.end()

    def _trace(self, request: GenerationRequest) -> RequestTrace | None:
        """The replica's span of a traced request: a child of the ingress's (its traceparent came with it)."""
        if self._tracing is None or not request.traceparent:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({"traceparent": request.traceparent})
        span = self._tracing.tracer.start_span(f"generate {self._spec.name}", context=parent, attributes={
            "servelm.replica": self._id, "gen_ai.request.model": self._spec.name})
        return RequestTrace(span)

    async def embed(self, inputs: list[list[int]], caller: str = "") -> np.ndarray:
        if self._built is None:
            await self.load()
        embedder = self._deployment.embedder
        if embedder is None:
            raise RuntimeError(f"the deployment {self._spec.name!r} does not embed")
        return await embedder.embed(inputs, caller)

    def stats(self) -> ReplicaStats:
        frozen, pauses = gc.get_freeze_count(), tuple(GC_PAUSE_SECONDS)
        if self._built is None:
            return ReplicaStats(self._id, None, None, gc_frozen=frozen, gc_pause_seconds=pauses)
        d = self._deployment
        held = d.adapters.all() if isinstance(d, TextDeployment) and d.adapters is not None else []
        adapters = tuple((a.name, a.loaded, a.requests) for a in held)
        return ReplicaStats(self._id, d.engine.stats() if isinstance(d, TextDeployment) else None,
                            d.embedder.stats() if d.embedder is not None else None, adapters, frozen, pauses)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing stats, read by the router: whether the model is loaded, and its loaded adapters."""
        if self._built is None:
            return {"loaded": False, "adapters": []}
        d = self._deployment
        held = d.adapters.all() if isinstance(d, TextDeployment) and d.adapters is not None else []
        return {"loaded": True, "adapters": [a.name for a in held if a.loaded]}

    async def describe(self) -> ReplicaInfo:
        await self.load()
        d = self._deployment
        emb = d.embedder
        info = EmbeddingInfo(emb.dim, emb.vocab_size, emb.context_window, emb.cross_encoder) if emb is not None else None
        if isinstance(d, TextDeployment):
            return ReplicaInfo(d.fingerprint, d.context_window, d.max_choices, info, d.facts, d.placement)
        return ReplicaInfo(d.fingerprint, d.context_window, 0, info, placement=d.placement)

    def _adapters(self) -> Adapters:
        d = self._deployment
        if not isinstance(d, TextDeployment) or not isinstance(d.adapters, Adapters):
            raise InvalidParameter(f"The model `{self._spec.name}` takes no LoRA adapters.", "model")
        return d.adapters

    async def add_adapter(self, name: str, path: str, scale: float) -> None:
        await self.load()
        await self._adapters().add(name, path, scale)

    async def remove_adapter(self, name: str) -> None:
        if self._built is not None:
            await self._adapters().remove(name)

    async def ensure_adapters(self, adapters: list[tuple[str, str, float]]) -> None:
        """Adds those of the ingress's adapters this replica lacks (it started after they were loaded by route)."""
        if self._built is None:
            return
        registry = self._adapters()
        for name, path, scale in adapters:
            if name not in registry:
                await registry.add(name, path, scale)

    def check_health(self) -> None:
        if self._built is not None and not all_alive(self._built.deployments.all()):
                raise RuntimeError(f"an engine thread of {self._spec.name!r} has stopped")

    def __del__(self) -> None:  # Ray Serve's graceful shutdown of the replica
        built = getattr(self, "_built", None)
        if built is not None:
            self._built = None
            free(built)
        tracing = getattr(self, "_tracing", None)
        if tracing is not None:
            tracing.shutdown()  # its buffered spans go out, or are dropped past the bound


_END = object()


async def _pump(outputs: AsyncGenerator[GenerationOutput, None], ready: asyncio.Queue[object]) -> None:
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
