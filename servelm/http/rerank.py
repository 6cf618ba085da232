"""Rerank and score over HTTP: vLLM's and Jina's POST /v1/rerank (and /rerank), Cohere's POST /v2/rerank, OpenVINO
Model Server's POST /v3/rerank and vLLM's POST /v1/score, each with its own request, answer and error shape
(http/errors.py renders Cohere's and OVMS's). service/rerank.py reads each request, scores it and shapes its answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from servelm import tracing
from servelm.http.auth import check_access
from servelm.http.openapi import doc
from servelm.http.ratelimit import charge_tokens
from servelm.http.routes import Route, app_state, deployment_header, embedding_turn, parse_body, run_unless_disconnected
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


async def _score(request: Request, q: ScoreQuery) -> tuple[PreparedScores, list[float]] | None:
    """The scores of a request for this caller (its access, its place in the queue, its tokens per minute, its turn
    in the passes); None if it went away."""
    state = app_state(request)
    service, deployments = state.services.scores, state.deployments
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
    state.metrics.scored.labels(prepared.model, kind).inc(len(prepared.pairs))
    return prepared, scores


async def _answer(request: Request, model: type[R], query: Callable[[R], ScoreQuery],
                  answer: Callable[[R, PreparedScores, list[float]], BaseModel]) -> Response:
    """One API's answer: its request read, scored, and its answer shaped (499 if the caller went away)."""
    req = await parse_body(request, model)
    out = await _score(request, query(req))
    if out is None:
        return Response(status_code=499)
    body = answer(req, *out).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, headers=deployment_header(out[0].model))


async def jina(request: Request) -> Response:
    return await _answer(request, RerankRequest, rerank_query, jina_answer)


async def cohere(request: Request) -> Response:
    return await _answer(request, CohereRerankRequest, rerank_query, cohere_answer)


async def ovms(request: Request) -> Response:
    return await _answer(request, OvmsRerankRequest, rerank_query, ovms_answer)


async def vllm_score(request: Request) -> Response:
    return await _answer(request, ScoreRequest, score_query, score_answer)


ROUTES = (
    *(Route("POST", path, jina, doc(request=RerankRequest, response=RerankResponse)) for path in ("/v1/rerank", "/rerank")),
    Route("POST", "/v2/rerank", cohere, doc(request=CohereRerankRequest, response=CohereRerankResponse)),
    Route("POST", "/v3/rerank", ovms, doc(request=OvmsRerankRequest, response=OvmsRerankResponse)),
    Route("POST", "/v1/score", vllm_score, doc(request=ScoreRequest, response=ScoreResponse)),
)
