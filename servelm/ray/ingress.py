"""The ingress: one Ray Serve deployment that runs servelm's own ASGI app (servelm.http.app.create_app), so
every route, stream, error, key, limit and metric is the one a single-process server has. Its deployments'
engines are RemoteEngines: generation runs on the model deployments' replicas.

Prompts are rendered and tokenized here, in the ingress, on a tokenizer-only copy of each model (llama.cpp
loads the GGUF's vocabulary and metadata without its weights: tens of MB, whatever the model's size). So
the service layer runs unchanged, a request's 4xx (unknown model, a prompt too long, a bad schema) is
answered without a replica, grammars for constrained output are compiled once here, and the router sees
the prompt's token ids, which prefix-affine routing needs. What only a replica knows (its context window,
sequence slots, fingerprint, embedding width) is asked of one replica at start.

Models loaded on demand (--models-dir, `load = "on-demand"`) are the ingress's ModelCatalog, a Fleet whose
load broadcasts `load` to the model deployment's replicas (each starts without its model), asks one of them to
describe it and builds the ingress's side; its unload broadcasts `unload`. The catalog's bounds (--models-max,
--models-memory-mib, keep_alive) are the ingress's, over all replicas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ray import serve

from servelm.compose import Built, Closer, check_guards
from servelm.config import DeploymentSpec
from servelm.fleet import Fleet, FleetLimits
from servelm.http.app import AppOptions
from servelm.http.state import STATE_KEY
from servelm.models import resolve_model_source
from servelm.ray.remote import RemoteEmbedder, RemoteEngine, ReplicaAdapters, ReplicaSet
from servelm.ray.replica import ReplicaInfo
from servelm.ray.served_by import ReplicaHeader
from servelm.service.registry.deployments import Deployment, Deployments
from servelm.tracing import TraceSettings, Tracing

if TYPE_CHECKING:
    from servelm.http.asgi import ASGIApp, Receive, Scope, Send

log = logging.getLogger("servelm.ray")
T = TypeVar("T")


@dataclass(frozen=True)
class IngressPlan:
    """What the ingress needs, sent to it by value (the keys in `app.security` are SHA-256 digests only)."""

    specs: list[dict[str, Any]]  # DeploymentSpec, as JSON-ready dicts
    aliases: dict[str, str] = field(default_factory=dict)
    endpoints: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    app: AppOptions = field(default_factory=AppOptions)  # its batches' state lives on the ingress's node
    log_level: str = "info"
    on_demand: list[dict[str, Any]] = field(default_factory=list)  # DeploymentSpecs whose models load on demand
    models: FleetLimits = field(default_factory=FleetLimits)
    tracing: TraceSettings | None = None  # OpenTelemetry: a span per request here, joined by the replica's


class Ingress:
    async def __init__(self, plan: IngressPlan, handles: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        logging.basicConfig(level=plan.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._plan = plan
        self._handles = handles
        self._sets: list[ReplicaSet] = []
        self._runners: list[Closer] = []  # tokenizer-only llama.cpp models, closed at shutdown
        self._loop = asyncio.get_running_loop()
        deployments = []
        for raw in plan.specs:
            spec = DeploymentSpec.model_validate(raw)
            replicas = ReplicaSet(spec.name, handles[spec.name], spec.engine.max_num_seqs)
            info = await _describe(replicas)  # waits for the first replica to be up
            deployments.append(await asyncio.to_thread(self._deployment, spec, replicas, info, self._runners))
            self._sets.append(replicas)
        self._deployments = Deployments(deployments, aliases=plan.aliases, endpoints=plan.endpoints)
        check_guards(self._deployments)
        on_demand = [DeploymentSpec.model_validate(raw) for raw in plan.on_demand]
        self._catalog = Fleet(on_demand, plan.models, builder=self._load) if on_demand else None
        log.info("ingress ready for %s", ", ".join([repr(d.name) for d in deployments]
                                                   + [f"{s.name!r} (on demand)" for s in on_demand]))

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from servelm.http.app import create_app
        from servelm.ray.store import RayConversations, RayStore

        tracing = Tracing(self._plan.tracing) if self._plan.tracing is not None else None
        options = self._plan.app
        # with a state directory (on this one ingress's node) they are kept in its database; else in Ray actors
        durable = options.batches is not None
        app = create_app(self._deployments, options, on_start=self._start, on_stop=self._stop,
                         store=None if durable else RayStore(options.responses),
                         conversations=None if durable else RayConversations(options.conversations),
                         catalog=self._catalog, tracing=tracing)
        getattr(app.state, STATE_KEY).metrics.watch_replicas(self._replica_gc)
        return ReplicaHeader(FreshStats(app, self._sets))

    def _replica_gc(self) -> list[tuple[str, int, list[float]]]:
        """Each deployment's replicas' garbage-collector figures, added up (as last polled: /metrics refreshes them)."""
        return [(s.name, sum(r.gc_frozen for r in s.latest), [sum(g) for g in zip(*(r.gc_pause_seconds for r in s.latest))])
                for s in self._sets]

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for s in self._sets:
            s.start()

    def _stop(self) -> None:
        for s in self._sets:
            s.stop()
        for r in self._runners:
            r.close()
        self._runners = []

    def _load(self, spec: DeploymentSpec) -> Built:
        """An on-demand model loaded on every replica of its deployment, and the ingress's side of it (the catalog
        calls it on a worker thread; the replicas are reached from the app's event loop)."""
        def on_loop(coro: Coroutine[Any, Any, T]) -> T:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

        replicas = ReplicaSet(spec.name, self._handles[spec.name], spec.engine.max_num_seqs)
        on_loop(replicas.broadcast("load"))
        info = on_loop(_describe(replicas))
        runners: list[Closer] = []
        deployment = self._deployment(spec, replicas, info, runners)  # its memory unsaid: the catalog's
        # --models-memory-mib counts the model's files and KV budget instead
        return Built(Deployments([deployment]), workers=[_Loaded(replicas, self._sets, on_loop)], closers=runners)

    def _deployment(self, spec: DeploymentSpec, replicas: ReplicaSet, info: ReplicaInfo,
                    runners: list[Closer]) -> Deployment:
        from servelm.compose import DeploymentOptions, Serving, grammars_of, text_deployment
        from servelm.runners.llamacpp import LlamaModel

        path = resolve_model_source(spec.model, spec.kind)
        model = LlamaModel(path, vocab_only=True)  # the replicas compute: the ingress tokenizes, and needs no weights
        runners.append(model)

        def tokenize_input(text: str) -> list[int]:  # an embedding input: the model's own special tokens, none parsed
            return model.tokenize(text, add_special=True, parse_special=False)

        embedder = RemoteEmbedder(replicas, info.embedding, tokenize_input, model.tokenize_pair) if info.embedding else None
        options = DeploymentOptions.of(spec)
        if spec.kind in ("embedding", "rerank"):
            assert embedder is not None and info.embedding is not None  # an embedding replica always has one
            return Deployment(name=spec.name, context_window=info.context_window, fingerprint=info.fingerprint,
                              embedder=embedder, placement=info.placement, max_waiting=options.max_waiting,
                              min_priority=options.min_priority)
        replicas.adapters = ReplicaAdapters(replicas, spec.loras, spec.engine.max_loras)
        serving = Serving(  # the replicas' context window (their KV cache's), slots, self-check and placement
            RemoteEngine(replicas), info.fingerprint, info.context_window, info.max_choices, facts=info.facts,
            placement=info.placement, adapters=replicas.adapters, embedder=embedder)
        return text_deployment(spec.name, model, grammars_of(model, options.grammar_limits), options, serving)


async def _describe(replicas: ReplicaSet) -> ReplicaInfo:
    info: ReplicaInfo = await replicas.handle.describe.remote()
    return info


class _Loaded:
    """An on-demand model's replicas while it is loaded (a worker of its Built): their counts polled, and joined to
    /health's and /metrics' fresh reads; stopping it unloads the model on every replica."""

    def __init__(self, replicas: ReplicaSet, sets: list[ReplicaSet],
                 on_loop: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.replicas, self.sets, self.on_loop = replicas, sets, on_loop

    def start(self) -> None:
        self.on_loop(self._start())

    def stop(self) -> None:
        self.on_loop(self._stop())

    async def _start(self) -> None:
        self.sets.append(self.replicas)
        self.replicas.start()

    async def _stop(self) -> None:
        self.replicas.stop()
        if self.replicas in self.sets:
            self.sets.remove(self.replicas)
        await self.replicas.broadcast("unload")


class FreshStats:
    """GET /health and /metrics ask every replica for its counts before they answer (pure ASGI), so they say
    what a single process would say at that moment, not what the once-a-second poll last saw."""

    PATHS = ("/health", "/metrics")
    TIMEOUT_S = 2.0  # replicas slower than this to answer: the counts last polled are kept

    def __init__(self, app: ASGIApp, sets: list[ReplicaSet]) -> None:
        self.app = app
        self.sets = sets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET" and scope.get("path") in self.PATHS:
            await asyncio.gather(*(s.refresh(self.TIMEOUT_S) for s in self.sets))
        await self.app(scope, receive, send)


IngressDeployment = serve.ingress()(Ingress)
