"""Rerank and score over HTTP: vLLM's and Jina's POST /v1/rerank (and /rerank), Cohere's POST /v2/rerank, OpenVINO
Model Server's POST /v3/rerank and vLLM's POST /v1/score, each with its own request, answer and error shape
(http/errors.py renders Cohere's and OVMS's). service/rerank.py reads each request, scores it and shapes its answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from servelm import tracing
from servelm.http.auth import check_access
from servelm.http.openapi import doc
from servelm.http.ratelimit import charge_tokens
from servelm.http.routes import deployment_header, embedding_turn, parse_body, run_unless_disconnected
from servelm.http.state import AppState
from servelm.protocol.rerank import (
    CohereRerankRequest,
    CohereRerankResponse,
    OvmsRerankRequest,
    OvmsRerankResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from servelm.service.rerank import (
    PreparedScores,
    ScoreQuery,
    cohere_answer,
    jina_answer,
    ovms_answer,
    rerank_query,
    score_answer,
    score_query,
)

R = TypeVar("R", bound=BaseModel)


def build_rerank_router(state: AppState) -> APIRouter:
    router = APIRouter()
    service, deployments, metrics = state.services.scores, state.deployments, state.metrics

    async def score(request: Request, q: ScoreQuery) -> tuple[PreparedScores, list[float]] | None:
        """The scores of a request for this caller (its access, its place in the queue, its tokens per minute, its
        turn in the passes); None if it went away."""
        name = q.model or service.default_model()
        check_access(request.scope, deployments, name)
        dep, _ = deployments.embedder(name)
        with embedding_turn(request.scope, dep) as caller:
            prepared = await asyncio.to_thread(service.prepare, dep.name, q)
            charge_tokens(request.scope, prepared.tokens, 0)
            tracing.annotate(gen_ai__operation__name="rerank", gen_ai__request__model=prepared.model,
                             servelm__pairs=len(prepared.pairs), gen_ai__usage__input_tokens=prepared.tokens)
            scores = await run_unless_disconnected(request, asyncio.ensure_future(service.run(prepared, caller)))
        if scores is None:
            return None
        kind = "cross_encoder" if prepared.embedder.cross_encoder else "cosine"
        metrics.scored.labels(prepared.model, kind).inc(len(prepared.pairs))
        return prepared, scores

    def add(paths: tuple[str, ...], name: str, model: type[R], query: Callable[[R], ScoreQuery],
            answer: Callable[[R, PreparedScores, list[float]], BaseModel], response: type[BaseModel]) -> None:
        """One API's route: `name` is its OpenAPI operation's."""
        async def handle(request: Request) -> Response:
            req = await parse_body(request, model)
            out = await score(request, query(req))
            if out is None:
                return Response(status_code=499)
            body = answer(req, *out).model_dump(mode="json", exclude_none=True)
            return JSONResponse(body, headers=deployment_header(out[0].model))

        for path in paths:
            router.add_api_route(path, handle, methods=["POST"], name=name,
                                 openapi_extra=doc(request=model, response=response))

    add(("/v1/rerank", "/rerank"), "jina", RerankRequest, rerank_query, jina_answer, RerankResponse)
    add(("/v2/rerank",), "cohere", CohereRerankRequest, rerank_query, cohere_answer, CohereRerankResponse)
    add(("/v3/rerank",), "ovms", OvmsRerankRequest, rerank_query, ovms_answer, OvmsRerankResponse)
    add(("/v1/score",), "vllm_score", ScoreRequest, score_query, score_answer, ScoreResponse)
    return router
