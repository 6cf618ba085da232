"""The ingress: one Ray Serve deployment that runs servelm's own ASGI app (servelm.http.app.create_app), so
every route, stream, error, key, limit and metric is the one a single-process server has. Its deployments'
engines are RemoteEngines: generation runs on the model deployments' replicas.

Prompts are rendered and tokenized here, in the ingress, on a tokenizer-only copy of each model (llama.cpp
loads the GGUF's vocabulary and metadata without its weights: tens of MB, whatever the model's size). So
the service layer runs unchanged, a request's 4xx (unknown model, a prompt too long, a bad schema) is
answered without a replica, grammars for constrained output are compiled once here, and the router sees
the prompt's token ids, which prefix-affine routing needs. What only a replica knows (its context window,
sequence slots, fingerprint, embedding width) is asked of one replica at start.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from servelm.compose import check_guards, content_filter_of
from servelm.config import DeploymentSpec
from servelm.http.batches import BatchConfig
from servelm.http.limits import SecurityConfig
from servelm.models import resolve_model_source
from servelm.ray.remote import RemoteEmbedder, RemoteEngine, ReplicaSet
from servelm.ray.replica import ReplicaInfo
from servelm.ray.served_by import ReplicaHeader
from servelm.service.deployments import Deployment, Deployments
from servelm.service.store import StoreLimits

log = logging.getLogger("servelm.ray")


@dataclass(frozen=True)
class IngressPlan:
    """What the ingress needs, sent to it by value (the keys in `security` are SHA-256 digests only)."""

    specs: list[dict[str, Any]]  # DeploymentSpec, as JSON-ready dicts
    aliases: dict[str, str] = field(default_factory=dict)
    endpoints: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log_level: str = "info"
    store: StoreLimits = field(default_factory=StoreLimits)  # the Responses API's stored answers (a Ray actor)
    timings: bool = False
    playground: bool = True
    batches: BatchConfig | None = None  # the Batch API's state (on the ingress's node; its lines go to the replicas)


class Ingress:
    async def __init__(self, plan: IngressPlan, handles: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        logging.basicConfig(level=plan.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._plan = plan
        self._sets: list[ReplicaSet] = []
        self._runners: list[Any] = []  # tokenizer-only llama.cpp models, closed at shutdown
        deployments = []
        for raw in plan.specs:
            spec = DeploymentSpec.model_validate(raw)
            handle = handles[spec.name]
            replicas = ReplicaSet(spec.name, handle, spec.engine.max_num_seqs)
            info: ReplicaInfo = await handle.describe.remote()  # waits for the first replica to be up
            deployment = await asyncio.to_thread(self._deployment, spec, replicas, info)
            deployment.max_waiting = spec.limits.max_waiting
            deployments.append(deployment)
            self._sets.append(replicas)
        self._deployments = Deployments(deployments, aliases=plan.aliases, endpoints=plan.endpoints)
        check_guards(self._deployments)
        log.info("ingress ready for %s", ", ".join(repr(d.name) for d in deployments))

    def __serve_build_asgi_app__(self) -> Any:
        from servelm.http.app import create_app
        from servelm.ray.store import RayStore

        app = create_app(self._deployments, on_start=self._start, on_stop=self._stop, security=self._plan.security,
                         store=RayStore(self._plan.store), timings=self._plan.timings,
                         playground=self._plan.playground, batches=self._plan.batches)
        return ReplicaHeader(FreshStats(app, self._sets))

    def _start(self) -> None:
        for s in self._sets:
            s.start()

    def _stop(self) -> None:
        for s in self._sets:
            s.stop()
        for r in self._runners:
            r.close()
        self._runners = []

    def _deployment(self, spec: DeploymentSpec, replicas: ReplicaSet, info: ReplicaInfo) -> Deployment:
        from servelm.compose import build_deployment, grammar_limits
        from servelm.runners.llamacpp import LlamaCppRunner

        path = resolve_model_source(spec.model, spec.kind)
        runner = LlamaCppRunner(path, num_slots=spec.engine.max_num_seqs, vocab_only=True)
        self._runners.append(runner)

        def tokenize_input(text: str) -> list[int]:  # an embedding input: the model's own special tokens, none parsed
            return runner.tokenize(text, add_special=True, parse_special=False)

        embedder = RemoteEmbedder(replicas, info.embedding, tokenize_input) if info.embedding else None
        if spec.kind == "embedding":
            assert embedder is not None and info.embedding is not None  # an embedding replica always has one
            return Deployment(name=spec.name, context_window=info.context_window, fingerprint=info.fingerprint,
                              embedder=embedder)
        template = spec.chat_template.read_text(encoding="utf-8") if spec.chat_template else None
        deployment, _ = build_deployment(spec.name, runner, chat_template=template, engine=RemoteEngine(replicas),
                                         grammar_limits=grammar_limits(spec.engine),
                                         special_tokens_in_content=spec.special_tokens_in_content,
                                         reasoning_markers=spec.reasoning_markers)
        deployment.context_window = info.context_window  # the replicas' (their KV cache bounds it)
        deployment.facts = info.facts  # and their self-check's finding
        deployment.max_choices = info.max_choices
        deployment.fingerprint = info.fingerprint
        deployment.embedder = embedder
        deployment.content_filter = content_filter_of(spec.content_filter)
        return deployment


class FreshStats:
    """GET /health and /metrics ask every replica for its counts before they answer (pure ASGI), so they say
    what a single process would say at that moment, not what the once-a-second poll last saw."""

    PATHS = ("/health", "/metrics")
    TIMEOUT_S = 2.0  # replicas slower than this to answer: the counts last polled are kept

    def __init__(self, app: Any, sets: list[ReplicaSet]) -> None:
        self.app = app
        self.sets = sets

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET" and scope.get("path") in self.PATHS:
            await asyncio.gather(*(s.refresh(self.TIMEOUT_S) for s in self.sets))
        await self.app(scope, receive, send)


IngressDeployment = serve.ingress()(Ingress)
