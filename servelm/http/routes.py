"""The routes: parse the body (400 on anything malformed), hand it to a service, write the answer."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from servelm import tracing
from servelm.engine.types import Tenant
from servelm.errors import InvalidParameter, ModelNotFound
from servelm.http.asgi import Scope
from servelm.http.auth import can_use, check_access, current_key, sees_counters
from servelm.http.errors import validation_error
from servelm.http.limits import OFF_LOOP_BYTES, admit, bounded, check_json_containers, limits_of, streamed
from servelm.http.middleware import FILTERED_NOTE
from servelm.http.openapi import doc
from servelm.http.ratelimit import caller_of, charge_tokens
from servelm.http.state import STATE_KEY, AppState
from servelm.http.streams import SSE, Framing, frames
from servelm.http.tracing import describe_generation
from servelm.metrics import Metrics
from servelm.protocol.chat import ChatCompletion, ChatCompletionRequest
from servelm.protocol.common import ModelCard, ModelList
from servelm.protocol.completions import Completion, CompletionRequest
from servelm.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from servelm.service.base import GeneratingService, P, Req
from servelm.service.embeddings import EmbeddingService
from servelm.service.params import RequestContext
from servelm.service.registry.catalog import ModelCatalog, ModelStatus
from servelm.service.registry.deployments import Deployment, Deployments, TextDeployment
from servelm.service.safety.content_filter import FilterEvents

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
DEPLOYMENT_HEADER = "x-servelm-deployment"


@dataclass(frozen=True)
class Route:
    """One entry of a route table: `method` (or several, one route answering each), `path`, and its plain handler,
    whose signature FastAPI reads for path and query parameters; `doc` is its OpenAPI (openapi.doc), `name` its
    operation's (default: the handler's), `schema` whether /openapi.json lists it."""

    method: str | tuple[str, ...]
    path: str
    handler: Callable[..., Any]
    doc: dict[str, Any] | None = None
    name: str | None = None
    schema: bool = True


def router_of(table: Iterable[Route]) -> APIRouter:
    """A route table as a router, in the table's order (the order requests are matched in): the one place routes
    are registered."""
    router = APIRouter()
    for r in table:
        router.add_api_route(r.path, r.handler, methods=[r.method] if isinstance(r.method, str) else list(r.method),
                             openapi_extra=r.doc, name=r.name, include_in_schema=r.schema)
    return router


def app_state(request: Request) -> AppState:
    """The typed state of the app that took the request (http/app.py's create_app sets it before it serves)."""
    state = getattr(request.app.state, STATE_KEY)
    if not isinstance(state, AppState):
        raise TypeError(f"app.state.{STATE_KEY} is a {type(state).__name__}, not the AppState create_app sets")
    return state


# what OpenAI's include may name (IncludeEnum): a stored item is answered whole, so each adds nothing here
INCLUDABLE = frozenset({"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                        "message.input_image.image_url", "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"})


def check_listing(request: Request, order: str | None = None, limit: int | None = None, most: int = 100) -> None:
    """A 400 naming the query parameter of a list or item route that is not OpenAI's: `order` (asc or desc),
    `limit` (1 to `most`), `include` (IncludeEnum's values)."""
    if order is not None and order not in ("asc", "desc"):
        raise InvalidParameter("order must be asc or desc.", "order")
    if limit is not None and not 1 <= limit <= most:
        raise InvalidParameter(f"limit must be between 1 and {most}.", "limit")
    for value in [*request.query_params.getlist("include"), *request.query_params.getlist("include[]")]:
        if value not in INCLUDABLE:
            raise InvalidParameter(f"include may name {', '.join(sorted(INCLUDABLE))}; not {value[:64]!r}.",
                                   "include")


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as the typed request (a 400 in the envelope otherwise); a long one counted and validated on a worker
    thread, so that the event loop goes on serving the others meanwhile."""
    body = await request.body()
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse, body, model)
    return _parse(body, model)


def _parse(body: bytes, model: type[M]) -> M:
    check_json_containers(body)  # before pydantic builds a model of each
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc, model) from None


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: asyncio.Future[T]) -> T | None:
    """Await work; if the client goes away first, cancel it (freeing its sequences) and return None; past
    the request's deadline (504), or when the server's shutdown cuts requests off (503), cancel it and raise."""
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:  # the server may cancel this request too (Ray Serve does on a disconnect)
        pending: set[asyncio.Future[Any]] = {work, watcher}
        await bounded(request.scope, asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
    except BaseException:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    return None


async def generate(request: Request, req: Req, service: GeneratingService[Req, P], framing: Framing = SSE) -> Response:
    """A text-generating request: prepared off the event loop, then streamed (SSE, or DJL's jsonlines) or answered
    whole."""
    check_access(request.scope, service.deployments, req.model)  # a key's deployments: else 404
    prepared = await asyncio.to_thread(service.prepare, req, request_context(request.scope, app_state(request)))
    gens = prepared.generations
    # the deployment's queue and the caller's share of it (429 queue_full), the key's tokens per minute (429 tokens)
    dep = prepared.deployment
    admission = admit(request.scope, dep.queue, [g.request_id for g in gens], sum(len(g.prompt_token_ids) for g in gens),
                      sum(g.params.max_tokens * g.params.num_seqs for g in gens), dep.max_waiting)
    trace = tracing.current()
    if trace is not None:
        describe_generation(trace, req, service.operation, prepared)
        trace.event("servelm.admitted", servelm__waiting=dep.queue.total)
    if prepared.screening is not None:  # the deployment's content policy on the prompt: a 400 before anything runs
        try:
            await bounded(request.scope, prepared.screening.check_prompt())
        except BaseException:
            admission.close()  # nothing generated: the key's tokens per minute get the reservation back
            raise
        tracing.annotate(servelm__content_filter="passed")  # the answer's block, if any, says so at the end
    if prepared.stream:
        return StreamingResponse(
            frames(streamed(request.scope, admission, service.stream(prepared)), framing),
            media_type=framing.media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **deployment_header(dep.name)},
        )
    try:
        result = await run_unless_disconnected(request, asyncio.ensure_future(service.complete(prepared)))
    finally:
        admission.close()
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result.model_dump(mode="json"), headers=deployment_header(prepared.deployment.name))


def request_context(scope: Scope, state: AppState | None = None) -> RequestContext:
    """Who sent the request, as the services see it: the API key's digest (nothing of the key itself), and the
    app's settings from its state (without one, a caller that reads only the owner: no timings, no filter counts)."""
    key = current_key(scope)
    limits = limits_of(scope)
    return RequestContext(owner=key.digest.hex() if key is not None else "",
                          max_batch_prompts=limits.max_batch_prompts if limits is not None else 128,
                          timings=state is not None and state.timings,
                          on_filtered=_filtered(scope, state.metrics if state is not None else None),
                          min_priority=key.priority_floor if key is not None else None,
                          tenant=tenant_of(scope))


def tenant_of(scope: Scope) -> Tenant:
    """Who a request counts against in the engine's fair share: its API key (its weight and share of the slots), or
    its client's address on a server without keys, as the waiting queue counts it (caller_of)."""
    key = current_key(scope)
    caller = caller_of(scope)
    if key is None:
        return Tenant(caller, caller)
    return Tenant(caller, key.label, key.weight, key.max_share)


def _filtered(scope: Scope, metrics: Metrics | None) -> FilterEvents:
    """What a content filter's block leaves: a count in /metrics, and a note (never the content) for the access
    log (http/middleware.py)."""

    def note(deployment: str, direction: str, categories: Sequence[str]) -> None:
        if metrics is not None:
            metrics.content_filtered(deployment, direction, categories)
        scope.setdefault("state", {})[FILTERED_NOTE] = f"{direction}:{','.join(categories)}"

    return note


def deployment_header(name: str) -> dict[str, str]:
    """Which deployment answered (an alias or a weighted endpoint names several). A header is Latin-1: a name with
    anything but printable ASCII, or a `%`, is percent-encoded (UTF-8), as URLs are."""
    return {DEPLOYMENT_HEADER: quote(name, safe=_HEADER_SAFE)}


_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # printable ASCII, kept as it is


def _card(name: str, d: Deployment | None) -> ModelCard:
    """A model id: a deployment, an alias (root: its deployment), or a weighted endpoint (root: null)."""
    if d is None:
        return ModelCard(id=name, created=0, root=None)
    if not isinstance(d, TextDeployment):
        return ModelCard(id=name, created=d.created, max_model_len=d.context_window, root=d.name,
                         placement=d.placement or None, embeddings_exact=False if d.embedder is not None else None)
    f, style = d.facts, d.tool_style
    return ModelCard(
        id=name, created=d.created, max_model_len=d.context_window, root=d.name,
        modalities={"vision": d.images is not None, "audio": False},
        quantization=f.quantization, trained_context_length=f.trained_context, chat_template=d.template.origin,
        tool_call_format=style.format.name + ("" if style.native else " (prompted)"),
        reasoning_markers=[d.reasoning.open, d.reasoning.close] if d.reasoning is not None else None,
        exact=f.exact, exactness=f.exactness or None, prompt_tiles=f.prompt_tiles or None, placement=d.placement or None,
        embeddings_exact=False if d.embedder is not None else None,
    )


def _cards(deployments: Deployments, catalog: ModelCatalog | None) -> list[tuple[str, ModelCard]]:
    """Every model id with its card: the loaded ones, and the catalog's others with their status."""
    statuses = catalog.statuses() if catalog is not None else {}
    cards = []
    for name, d in deployments.model_ids():
        card = _card(name, d)
        if d is not None:
            card.status = (statuses.get(d.name) or ModelStatus("loaded")).wire()
        cards.append((name, card))
    for d in deployments.generators():  # LoRA adapters, as vLLM lists them
        for a in d.adapters.all() if d.adapters is not None else ():
            cards.append((a.name, ModelCard(id=a.name, created=d.created, max_model_len=d.context_window, root=a.path,
                                            parent=d.name, status=ModelStatus("loaded" if a.loaded else "unloaded").wire())))
    listed = {d.name for _, d in deployments.model_ids() if d is not None}
    cards += [(name, ModelCard(id=name, created=0, root=name, status=s.wire()))
              for name, s in statuses.items() if name not in listed]
    return cards


# prepared off the event loop: rendering, tokenizing and compiling a grammar may take milliseconds
async def chat_completions(request: Request) -> Response:
    return await generate(request, await parse_body(request, ChatCompletionRequest), app_state(request).services.chat)


async def legacy_completions(request: Request) -> Response:
    return await generate(request, await parse_body(request, CompletionRequest), app_state(request).services.completions)


async def list_models(request: Request) -> JSONResponse:
    state = app_state(request)
    cards = [card for name, card in _cards(state.deployments, state.catalog)
             if can_use(request.scope, state.deployments, name)]
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


async def get_model(model_id: str, request: Request) -> JSONResponse:
    state = app_state(request)
    for name, card in _cards(state.deployments, state.catalog):
        if name == model_id and can_use(request.scope, state.deployments, name):
            return JSONResponse(card.model_dump(mode="json"))
    raise ModelNotFound(model_id)


async def create_embeddings(request: Request) -> Response:
    return await embed(request, await parse_body(request, EmbeddingRequest), app_state(request).services.embeddings)


async def health(request: Request) -> JSONResponse:
    state = app_state(request)
    deployments = state.deployments
    ok = deployments.all_alive()
    # degraded: generation goes on, but the state store is damaged (nothing more is stored; a monitoring key sees why)
    body: dict[str, Any] = {"status": "unavailable" if not ok else "degraded" if state.store_damaged() else "ok"}
    load, cache = sees_counters(request.scope)
    if load:  # a key's own deployments (a monitoring key: all)
        body["deployments"] = {d.name: _deployment_stats(d, cache) for d in deployments.all()
                               if cache or can_use(request.scope, deployments, d.name)}
    if cache:  # the most memory the server may take, part by part (docs/robustness.md)
        parts = {d.name: d.memory for d in deployments.all() if d.memory}
        body["memory"] = {"budget_bytes": RUNTIME_BYTES + sum(sum(p.values()) for p in parts.values()),
                          "runtime_bytes": RUNTIME_BYTES, "deployments": parts}
        for name, report in state.health_reports.items():  # e.g. the batch store's
            body[name] = report()
    return JSONResponse(body, status_code=200 if ok else 503)


ROUTES = (
    Route("POST", "/v1/chat/completions", chat_completions,
          doc(request=ChatCompletionRequest, response=ChatCompletion, streams="text/event-stream")),
    Route("POST", "/v1/completions", legacy_completions,
          doc(request=CompletionRequest, response=Completion, streams="text/event-stream")),
    *(Route("GET", path, list_models, doc(response=ModelList)) for path in ("/models", "/v3/models", "/v1/models")),
    *(Route("GET", path, get_model, doc(response=ModelCard)) for path in ("/v3/models/{model_id:path}",
                                                                           "/v1/models/{model_id:path}")),
    Route("POST", "/v1/embeddings", create_embeddings, doc(request=EmbeddingRequest, response=EmbeddingResponse)),
    Route("GET", "/health", health),
)


@contextmanager
def embedding_turn(scope: Scope, dep: Deployment) -> Iterator[str]:
    """An embeddings, rerank or score request's place in its deployment's waiting queue, taken before its texts are
    read and held until it is answered: 429 queue_full when the queue (--max-waiting, the deployment's
    max_waiting), or the caller's share of it, has no room. Yields the caller whose turn its inputs take in the
    embedding engine's passes."""
    admission = admit(scope, dep.queue, [f"embd-{uuid.uuid4().hex}"], 0, 0, dep.max_waiting)
    try:
        yield caller_of(scope)
    finally:
        admission.close()


async def embed(request: Request, req: EmbeddingRequest, embeddings: EmbeddingService) -> Response:
    """Run a validated embeddings request for this caller (its access, its place in the queue, its tokens per
    minute, its turn in the passes)."""
    check_access(request.scope, embeddings.deployments, req.model)
    dep, _ = embeddings.deployments.embedder(req.model)
    with embedding_turn(request.scope, dep) as caller:
        prepared = await asyncio.to_thread(embeddings.prepare, req, dep.name)  # tokenizing many texts takes a while
        charge_tokens(request.scope, sum(len(i) for i in prepared.inputs), 0)  # the key's tokens per minute
        result = await run_unless_disconnected(request, asyncio.ensure_future(embeddings.run(prepared, caller)))
    if result is None:
        return Response(status_code=499)
    body = await asyncio.to_thread(result.model_dump_json)  # thousands of floats: off the event loop
    return Response(body, media_type="application/json", headers=deployment_header(prepared.model))


RUNTIME_BYTES = 256 << 20  # the interpreter, its libraries, the vocabularies' tables and the HTTP server's buffers
# what the prefix cache did, added up over every key, and every tenant's share by name: told to a monitoring key only
# when keys are on
_CACHE_COUNTERS = ("kv_cells_cached", "cache_hits", "cached_tokens", "spill_ram_bytes", "spill_disk_bytes",
                   "spill_entries", "spill_restored", "spill_restore_failures", "tenants")


def _deployment_stats(d: Deployment, cache: bool = True) -> dict[str, Any]:
    """The engine's counts; an embedder's under "embeddings", or at the top for an embedding-only model. Without
    `cache`, none of the prefix cache's counters, nor the tenants' shares."""
    embedder = dataclasses.asdict(d.embedder.stats()) if d.embedder is not None else None
    if embedder is not None:
        embedder["embeddings_exact"] = False  # batched with what else waits (docs/exactness.md), as /v1/models says
    if not isinstance(d, TextDeployment):
        return {**(embedder or {}), "placement": d.placement or None}
    stats = dataclasses.asdict(d.engine.stats())
    if not cache:
        for name in _CACHE_COUNTERS:
            stats.pop(name, None)
    stats["exact"], stats["exactness"] = d.facts.exact, d.facts.exactness or None
    stats["prompt_tiles"] = d.facts.prompt_tiles or None
    stats["placement"] = d.placement or None
    if embedder is not None:
        stats["embeddings"] = embedder
    return stats
