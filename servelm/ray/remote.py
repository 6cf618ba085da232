"""The ingress's side of a model deployment: an Engine and an Embedder whose work runs on the deployment's
replicas, reached through a Ray Serve DeploymentHandle (its router picks the replica: servelm/ray/router.py).

The service and http layers see an ordinary Engine (generate / abort / stats, plus alive and admit as
LocalEngine has them), so every route, stream, error, limit and metric works as in a single process.

Faults: when the replica serving a request dies (ray.kill, a crash, its node lost), Ray Serve replaces it.
A request that had not received any output yet is sent again (to another replica: Ray Serve's router drops
the dead one at once); one that had is answered 503 `replica_unavailable` (a stream ends with that error
event), since a partial answer cannot be resumed elsewhere. Nothing else is affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import numpy as np
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError, RequestCancelledError

from servelm.config import LoraSpec
from servelm.engine.embedding import EmbeddingStats
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, SamplingParams, TenantStats
from servelm.errors import ApiError, QueueFull, ServerError, ServiceUnavailable
from servelm.ray.replica import EmbeddingInfo, ReplicaStats
from servelm.ray.served_by import end_call, note_call, note_replica
from servelm.service.registry.adapters import Adapter, AdapterNotFound, AdapterRegistry

log = logging.getLogger("servelm.ray")

ATTEMPTS = 3  # tries of a request no output of which has been seen, each on a live replica
STATS_PERIOD_S = 1.0  # how often the ingress asks every replica for its counts (/health, /metrics, admit)
CONTROL_TIMEOUT_S = 600.0  # a load, unload or adapter change on every replica (a model may take minutes to load)
_LOST = (RayActorError, ReplicaUnavailableError)


class ReplicaSet:
    """A deployment's replicas as the ingress sees them: the handle, and their counts, polled in the background
    (stats() must answer at once: /health and /metrics read it on the event loop)."""

    def __init__(self, name: str, handle: Any, slots_per_replica: int) -> None:
        self.name = name
        self.handle = handle
        self.slots_per_replica = slots_per_replica
        self.latest: list[ReplicaStats] = []
        self.polled = False
        self.adapters: ReplicaAdapters | None = None  # a text deployment's LoRA adapters, kept alike on its replicas
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            if self.adapters is not None:
                await self.adapters.sync()
            await asyncio.sleep(STATS_PERIOD_S)

    async def broadcast(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Call `method` on every replica; the first replica's error is raised (an ApiError keeps its status)."""
        answers = await self.handle.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, RayTaskError):
                raise _cause(answer)
            if isinstance(answer, ApiError):  # the replica's own error, as Ray Serve's gRPC path hands it back
                raise answer
            if isinstance(answer, BaseException):
                raise ServiceUnavailable(f"A replica of `{self.name}` did not answer {method}: {answer}",
                                         code="replica_unavailable")

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Ask every replica for its counts now (the poll does it each second; /health and /metrics on every
        read, so that they say what a single process would at that moment)."""
        try:
            answers = await self.handle.broadcast("stats").results_async(timeout_s=timeout_s, return_exceptions=True)
            self.latest = [a for a in answers if isinstance(a, ReplicaStats)]
            self.polled = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the controller restarting, a replica starting
            log.debug("stats of %r: %s", self.name, exc)

    @property
    def alive(self) -> bool:
        """At least one replica answered the latest poll (before the first poll: still starting, so yes)."""
        return bool(self.latest) or not self.polled


def own_request(handle: Any, *args: Any) -> Any:
    """`handle.remote(*args)` as a request of its own. Ray Serve (2.60) gives a call made while the ingress serves
    an HTTP request that request's internal id, and its router indexes the calls waiting for a replica by that
    id: two calls of one HTTP request waiting at once (a completions batch of two prompts) and one of them is
    never routed. The call keeps the request's other context (its x-request-id); as Ray Serve no longer cancels
    it with the HTTP request, ReplicaHeader does (note_call; the caller says end_call once it is over)."""
    context = contextvars.copy_context()
    context.run(_fresh_internal_request_id)
    call = context.run(handle.remote, *args)
    note_call(call)
    return call


def _fresh_internal_request_id() -> None:
    try:
        from ray.serve.context import _get_serve_request_context, _serve_request_context
    except ImportError:  # another Ray than the one pinned: leave its context alone
        return
    current = _get_serve_request_context()
    _serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))


S = TypeVar("S")


def _sum(items: list[Any], kind: type[S]) -> S:
    """Every replica's counts added up, field by field (all zero without replicas), a table of counts key by key; a
    size per unit (a KV cell's bytes) is the replicas' largest, not their sum."""
    def add(name: str) -> Any:
        values = [getattr(i, name) for i in items]
        if values and isinstance(values[0], dict):
            return {key: sum(v.get(key, 0) for v in values) for key in dict.fromkeys(k for v in values for k in v)}
        if values and isinstance(values[0], tuple):  # the tenants' shares, by name
            return _tenants([t for v in values for t in v])
        return max(values, default=0) if name.endswith("_bytes") else sum(values)

    return kind(**{f.name: add(f.name) for f in dataclasses.fields(kind)})  # type: ignore[arg-type]  # kind is a dataclass type


def _tenants(shares: list[TenantStats]) -> tuple[TenantStats, ...]:
    """Every replica's share of each tenant, added up by its label."""
    out: dict[str, TenantStats] = {}
    for t in shares:
        o = out.get(t.label)
        out[t.label] = t if o is None else TenantStats(t.label, o.slots + t.slots, o.waiting + t.waiting, o.tokens + t.tokens)
    return tuple(out[label] for label in sorted(out))


class RemoteEngine:
    """Engine over a deployment's replicas (Ray Serve streams GenerationOutput lists from ModelReplica.generate)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._stream = replicas.handle.options(stream=True, method_name="generate")
        self._streams: dict[str, Any] = {}  # request id → its response stream, for abort()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        seen = False
        for attempt in range(1, ATTEMPTS + 1):
            stream = own_request(self._stream, request)
            self._streams[request.request_id] = stream
            try:
                async for item in stream:
                    if isinstance(item, str):
                        note_replica(item)
                        continue
                    for out in item:
                        seen = True
                        yield out
                return
            except _LOST as exc:
                if seen:
                    raise ServiceUnavailable(
                        f"The replica of `{self.replicas.name}` serving this request stopped before it finished; "
                        "the answer is incomplete. Retry the request.", code="replica_unavailable") from None
                log.warning("request %s lost its replica before any output (%s); try %d of %d",
                            request.request_id, type(exc).__name__, attempt, ATTEMPTS)
            except RayTaskError as exc:  # the replica raised: the engine's own error (an ApiError: its status)
                raise _cause(exc) from None
            except BackPressureError:
                raise QueueFull(len(self._streams)) from None
            except RequestCancelledError:  # by abort() or as its HTTP request ended: cancelled, not failed
                raise asyncio.CancelledError from None
            finally:
                stream.cancel()  # a closed generator (the client went away): the replica aborts the request
                end_call(stream)
                self._streams.pop(request.request_id, None)
        raise ServiceUnavailable(f"No replica of `{self.replicas.name}` could serve the request ({ATTEMPTS} tries); "
                                 "retry later.", code="replica_unavailable")

    def check_params(self, params: SamplingParams) -> None:
        """The replicas run LocalEngines: every parameter the service layer lets through runs there."""

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    def stats(self) -> EngineStats:
        return _sum([s.engine for s in self.replicas.latest if s.engine is not None], EngineStats)

    @property
    def alive(self) -> bool:
        return self.replicas.alive


class RemoteEmbedder:
    """Embedder over a deployment's replicas; inputs are tokenized in the ingress (by `tokenize`)."""

    def __init__(self, replicas: ReplicaSet, info: EmbeddingInfo, tokenize: Callable[[str], list[int]],
                 tokenize_pair: Callable[[str, str], list[int]]) -> None:
        self.replicas = replicas
        self.dim = info.dim
        self.vocab_size = info.vocab_size
        self.context_window = info.context_window
        self.cross_encoder = info.cross_encoder
        self.tokenize = tokenize
        self.tokenize_pair = tokenize_pair  # a reranker's query-document input
        self._embed = replicas.handle.options(method_name="embed")

    async def embed(self, inputs: list[list[int]], caller: str = "") -> np.ndarray:
        for attempt in range(1, ATTEMPTS + 1):
            call = own_request(self._embed, inputs, caller)
            try:
                vectors: np.ndarray = await call
                return vectors
            except _LOST as exc:
                log.warning("an embedding request lost its replica (%s); try %d of %d", type(exc).__name__,
                            attempt, ATTEMPTS)
            except RayTaskError as exc:
                raise _cause(exc) from None
            except RequestCancelledError:
                raise asyncio.CancelledError from None
            finally:
                end_call(call)
        raise ServiceUnavailable(f"No replica of `{self.replicas.name}` could compute the embeddings; retry later.",
                                 code="replica_unavailable")

    def stats(self) -> EmbeddingStats:
        return _sum([s.embedder for s in self.replicas.latest if s.embedder is not None], EmbeddingStats)

    @property
    def alive(self) -> bool:
        return self.replicas.alive


class ReplicaAdapters(AdapterRegistry):
    """A deployment's LoRA adapters as the ingress sees them. Each replica keeps its own (--lora's loaded at its
    start, at most --max-loras loaded by its own LRU, loaded again when a request names one); a load or unload by
    route reaches every replica, and a replica that started since is given the ones it lacks at the next poll.
    Whether an adapter is loaded, and the requests run with it, are the replicas' together."""

    def __init__(self, replicas: ReplicaSet, loras: list[LoraSpec], max_loaded: int) -> None:
        super().__init__(max_loaded)
        self.replicas = replicas
        self._adding: set[str] = set()
        for lora in loras:
            self._register(lora.name, str(lora.path), lora.scale)

    def all(self) -> list[Adapter]:
        states = [a for s in self.replicas.latest for a in s.adapters]
        for adapter in self._by_name.values():
            adapter.loaded = any(loaded for name, loaded, _ in states if name == adapter.name)
            adapter.requests = sum(n for name, _, n in states if name == adapter.name)
        return super().all()

    async def add(self, name: str, path: str, scale: float = 1.0) -> None:
        self._register(name, path, scale)
        self._adding.add(name)
        try:
            await self.replicas.broadcast("add_adapter", name, path, scale)
            await self.replicas.refresh()  # the replicas' counts say it is loaded from now on
        except BaseException:
            del self._by_name[name]
            with contextlib.suppress(Exception):  # those that loaded it let it go
                await self.replicas.broadcast("remove_adapter", name)
            raise
        finally:
            self._adding.discard(name)

    async def remove(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise AdapterNotFound(name)
        await self.replicas.broadcast("remove_adapter", name)
        await self.replicas.refresh()

    async def sync(self) -> None:
        """Replicas that lack one of the adapters (started since it was loaded by route) are given it."""
        known = [(a.name, a.path, a.scale) for a in self._by_name.values() if a.name not in self._adding]
        lacking = [s for s in self.replicas.latest if s.engine is not None
                   and {n for n, *_ in known} - {name for name, *_ in s.adapters}]
        if lacking:
            try:
                await self.replicas.broadcast("ensure_adapters", known)
            except Exception as exc:  # noqa: BLE001 - tried again at the next poll
                log.warning("giving %r's replicas their LoRA adapters failed: %s", self.replicas.name, exc)


def _cause(exc: RayTaskError) -> BaseException:
    """The exception a replica raised, as the ingress should raise it (an ApiError keeps its status)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ApiError):
        return cause
    return ServerError(f"The model replica failed: {cause if cause is not None else exc}")
