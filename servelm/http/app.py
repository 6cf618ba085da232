"""The ASGI application: routes, error rendering, and the engines' lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from servelm import __version__
from servelm.batch.runner import BatchRunner
from servelm.batch.store import BatchStore
from servelm.engine.base import Engine
from servelm.engine.wrappers.admission import QueuedEngine
from servelm.engine.wrappers.metered import MeteredEngine
from servelm.engine.wrappers.traced import TracedEngine
from servelm.http import agents, conversations, dialects, errors, limits, metrics_route, models, openapi, rerank, routes
from servelm.http.asgi import ErrorBoundary
from servelm.http.auth import OPENAPI_PATH
from servelm.http.batches import BatchConfig, batch_runner, build_batch_router, build_no_batch_router
from servelm.http.limits import SecurityConfig
from servelm.http.metrics_route import engine_gauges
from servelm.http.middleware import RequestLog
from servelm.http.models import LoadOnDemand
from servelm.http.playground import build_playground_router
from servelm.http.ratelimit import BatchPacer
from servelm.http.routes import router_of
from servelm.http.state import STATE_KEY, AppState, Services
from servelm.http.tracing import Traced
from servelm.keys import KeySpec
from servelm.metrics import Metrics
from servelm.service.conversations import ConversationLimits, ConversationStore, MemoryConversations
from servelm.service.durable import SqlConversations, SqlResponses
from servelm.service.hosted_mcp import McpSettings, ServerSpec
from servelm.service.registry.catalog import ModelCatalog
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.store import MemoryStore, ResponseStore, StoreLimits
from servelm.tracing import FLUSH_TIMEOUT, Tracing


@dataclass(frozen=True)
class AppOptions:
    """The app's settings: `security` (keys, limits, CORS), `timings` (every answer carries llama-server's timings),
    `playground` (the web page at /), `batches` (the Files and Batches API's state directory and bounds; None: those
    routes answer 404)."""

    security: SecurityConfig = field(default_factory=SecurityConfig)
    timings: bool = False
    playground: bool = True
    batches: BatchConfig | None = None
    mcp: McpSettings = field(default_factory=McpSettings)  # the MCP servers Responses requests may reach
    responses: StoreLimits = field(default_factory=StoreLimits)  # each key's stored responses
    conversations: ConversationLimits = field(default_factory=ConversationLimits)  # each key's conversations

    @classmethod
    def from_settings(cls, settings: Any, keys: Sequence[KeySpec] = (),
                      mcp_servers: Sequence[ServerSpec] = ()) -> AppOptions:
        """From ServerSettings, the keys load_keys(settings, …) read and the config file's MCP servers."""
        return cls(SecurityConfig.from_settings(settings, keys), settings.timings, settings.playground,
                   BatchConfig.from_settings(settings), McpSettings.from_settings(settings, mcp_servers),
                   StoreLimits.from_settings(settings), ConversationLimits.from_settings(settings))


# every route table but the Batch API's and the playground's (which depend on the options), in matching order
ROUTE_TABLES = (
    routes.ROUTES,  # the OpenAI routes (chat, completions, models, embeddings) and /health
    models.MODELS_ROUTES,  # POST /models/load, /models/unload, /models/refresh
    models.LORA_ROUTES,  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    agents.ROUTES,  # Responses, Messages, /tokenize
    conversations.ROUTES, conversations.MCP_ROUTES,  # /v1/conversations, /v1/mcp/servers
    dialects.ROUTES,  # Azure ML, SageMaker / DJL, OVMS
    rerank.ROUTES,  # /v1/rerank, /rerank, /v2/rerank, /v3/rerank, /v1/score
    metrics_route.ROUTES,  # /metrics
)


def _kept(store: ResponseStore, conversations: ConversationStore) -> dict[str, Any]:
    """/health's `kept`: where the stored responses and the conversations are kept, and whether a restart of the
    server keeps them (only the state directory's database does)."""
    responses, talks = getattr(store, "kept", "memory"), getattr(conversations, "kept", "memory")
    return {"responses": responses, "conversations": talks,  # (a damaged database keeps nothing more)
            "survives_restart": all(k.startswith("sqlite") and not k.endswith("damaged") for k in (responses, talks))}


def create_app(deployments: Deployments, options: AppOptions | None = None, *,
               on_start: Callable[[], None] | None = None, on_stop: Callable[[], None] | None = None,
               store: ResponseStore | None = None, conversations: ConversationStore | None = None,
               catalog: ModelCatalog | None = None, tracing: Tracing | None = None,
               state_store: BatchStore | None = None) -> FastAPI:
    """The app over these deployments, as `options` say; `on_start` and `on_stop` start and stop their engines; `store`
    keeps the Responses API's stored answers and `conversations` its conversations (default: the state directory's
    database with options.batches, else this process's memory); `catalog`: models loaded when a request names them (servelm/fleet.py); `tracing`: an OpenTelemetry span
    per request."""
    options = options or AppOptions()
    security, batches = options.security, options.batches
    runner: BatchRunner | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncGenerator[None, None]:
        lag = asyncio.create_task(metrics.watch_loop())  # the event loop's lag, in /metrics
        if on_start is not None:
            on_start()
        if catalog is not None:
            await catalog.start()
        if runner is not None:
            runner.start()
        mcp.start()
        try:
            yield
        finally:
            await mcp.stop()
            if runner is not None:
                await runner.stop()
                runner.store.close()
            if catalog is not None:
                await catalog.stop()
            if on_stop is not None:
                on_stop()
            if tracing is not None:  # the spans still buffered go out, within what is left of the shutdown's timeout
                await asyncio.to_thread(tracing.shutdown, drain.left(FLUSH_TIMEOUT))
            lag.cancel()

    metrics = Metrics(lambda: engine_gauges(deployments))
    # time every generation (TTFT, inter-token and end-to-end latency, tokens), and free its place in the waiting
    # queue at its first output; the deployments given stay as they are
    def wrap(d: TextDeployment) -> Engine:
        metered = MeteredEngine(QueuedEngine(d.engine, d.queue), metrics.meter(d.name))
        return TracedEngine(metered) if tracing is not None else metered

    deployments = deployments.with_engines(wrap)
    app = FastAPI(title="servelm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=OPENAPI_PATH)
    openapi.install(app)
    errors.install(app)
    drain = limits.Drain()  # the server's shutdown, for requests in flight (http/server.py)
    if batches is not None:
        runner = batch_runner(app, deployments, batches, state_store)
    if store is None:
        store = SqlResponses(runner.store, options.responses) if runner is not None else \
            MemoryStore(options.responses.max_entries, options.responses.max_bytes, options.responses.max_age_s)
    if conversations is None:
        conversations = SqlConversations(runner.store, options.conversations) if runner is not None else \
            MemoryConversations(options.conversations)
    services = Services.build(deployments, store, options.mcp, conversations)
    mcp = services.responses.configured  # the operator's MCP servers: a command's runs with the app
    reports: dict[str, Callable[[], dict[str, Any]]] = {"kept": lambda: _kept(store, conversations)}
    if runner is not None:
        reports["batch_store"] = runner.store.health  # what start-up found (no I/O)
    state = AppState(deployments, services, metrics, drain, timings=options.timings, catalog=catalog, health_reports=reports,
                     store_damaged=(lambda: runner.store.damage is not None) if runner is not None else lambda: False)
    setattr(app.state, STATE_KEY, state)
    for table in ROUTE_TABLES:  # their handlers read the state of the app that takes each request
        app.include_router(router_of(table))
    metrics.watch_adapters(lambda: [(d.name, a.name, a.loaded, a.requests) for d in deployments.generators()
                                    for a in (d.adapters.all() if d.adapters is not None else ())])
    if runner is not None and batches is not None:
        app.include_router(build_batch_router(runner.store, runner, batches))
        metrics.watch_batches(runner.store.totals)
    else:
        app.include_router(build_no_batch_router())
    if options.playground:
        app.include_router(build_playground_router())
    app.add_middleware(ErrorBoundary)  # innermost: a bug is a 500 in the envelope, and the connection stays usable
    if catalog is not None:  # inside auth and the body limits: a request waits here while its model loads
        catalog.attach(deployments)
        metrics.watch_models(catalog.counts)
        app.add_middleware(LoadOnDemand, catalog=catalog)
    limiter = limits.install(app, security, drain)  # auth 401, rate limits 429, body 413, deadline
    if runner is not None:  # a batch's lines wait for their key's rate limits, before they take a place in flight
        runner.pacer = BatchPacer(limiter, security.keys)
    app.add_middleware(RequestLog, metrics=metrics)  # it sees every answer, 401/429 included
    if tracing is not None:  # around the access log, which writes the span's trace id
        app.add_middleware(Traced, tracing=tracing)
    limits.install_cors(app, security)  # outermost: preflights need no key
    return app
