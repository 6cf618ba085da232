"""Rerank and score over HTTP: vLLM's and Jina's POST /v1/rerank (and /rerank), Cohere's POST /v2/rerank, OpenVINO
Model Server's POST /v3/rerank and vLLM's POST /v1/score, each with its own request, answer and error shape
(http/errors.py renders Cohere's and OVMS's). The scores come from service/rerank.py."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from servelm import tracing
from servelm.http.auth import check_access
from servelm.http.openapi import doc
from servelm.http.ratelimit import charge_tokens
from servelm.http.routes import deployment_header, embedding_turn, parse_body, run_unless_disconnected
from servelm.protocol.rerank import (
    CohereRerankRequest,
    CohereRerankResponse,
    OvmsRerankRequest,
    OvmsRerankResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from servelm.service.deployments import Deployments
from servelm.service.rerank import PreparedScores, ScoreService, new_id, ranked

RERANK_PATHS = ("/v1/rerank", "/rerank")


def build_rerank_router(deployments: Deployments) -> APIRouter:
    router = APIRouter()
    service = ScoreService(deployments)

    async def score(request: Request, model: str | None, left: list[str], right: list[str], left_param: str,
                    right_param: str, max_right_tokens: int | None = None) -> tuple[PreparedScores, list[float]] | None:
        """The scores of a request for this caller (its access, its place in the queue, its tokens per minute, its
        turn in the passes); None if it went away."""
        name = model or service.default_model()
        check_access(request.scope, deployments, name)
        dep, _ = deployments.embedder(name)
        with embedding_turn(request.scope, dep) as caller:
            prepared = await asyncio.to_thread(service.prepare, dep.name, left, right, left_param=left_param,
                                               right_param=right_param, max_right_tokens=max_right_tokens,
                                               max_right_param="max_tokens_per_doc")
            charge_tokens(request.scope, prepared.tokens, 0)
            tracing.annotate(gen_ai__operation__name="rerank", gen_ai__request__model=prepared.model,
                             servelm__pairs=len(prepared.pairs), gen_ai__usage__input_tokens=prepared.tokens)
            scores = await run_unless_disconnected(request, asyncio.ensure_future(service.run(prepared, caller)))
        if scores is None:
            return None
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            kind = "cross_encoder" if prepared.embedder.cross_encoder else "cosine"
            metrics.scored.labels(prepared.model, kind).inc(len(prepared.pairs))
        return prepared, scores

    def results(texts: list[str], scores: list[float], top_n: int | None, documents: bool) -> list[RerankResult]:
        return [RerankResult(index=i, relevance_score=s, document=RerankDocument(text=texts[i]) if documents else None)
                for i, s in ranked(scores, top_n)]

    def answer(body: BaseModel, model: str) -> JSONResponse:
        return JSONResponse(body.model_dump(mode="json", exclude_none=True), headers=deployment_header(model))

    async def jina(request: Request) -> Response:
        req = await parse_body(request, RerankRequest)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        out = await score(request, req.model, [req.query], texts, "query", "documents")
        if out is None:
            return Response(status_code=499)
        p, scores = out
        return answer(RerankResponse(id=new_id("rerank"), model=p.model, results=results(
            texts, scores, req.top_n, req.return_documents), usage=RerankUsage(prompt_tokens=p.tokens,
                                                                               total_tokens=p.tokens)), p.model)

    for path in RERANK_PATHS:
        router.add_api_route(path, jina, methods=["POST"], openapi_extra=doc(request=RerankRequest,
                                                                             response=RerankResponse))

    @router.post("/v2/rerank", openapi_extra=doc(request=CohereRerankRequest, response=CohereRerankResponse))
    async def cohere(request: Request) -> Response:
        req = await parse_body(request, CohereRerankRequest)
        out = await score(request, req.model, [req.query], req.documents, "query", "documents", req.max_tokens_per_doc)
        if out is None:
            return Response(status_code=499)
        p, scores = out
        return answer(CohereRerankResponse(id=new_id("rerank"), results=results(req.documents, scores, req.top_n,
                                                                                False)), p.model)

    @router.post("/v3/rerank", openapi_extra=doc(request=OvmsRerankRequest, response=OvmsRerankResponse))
    async def ovms(request: Request) -> Response:
        req = await parse_body(request, OvmsRerankRequest)
        out = await score(request, req.model, [req.query], req.documents, "query", "documents")
        if out is None:
            return Response(status_code=499)
        p, scores = out
        return answer(OvmsRerankResponse(results=results(req.documents, scores, req.top_n, req.return_documents)),
                      p.model)

    @router.post("/v1/score", openapi_extra=doc(request=ScoreRequest, response=ScoreResponse))
    async def vllm_score(request: Request) -> Response:
        req = await parse_body(request, ScoreRequest)
        left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        out = await score(request, req.model, left, right, "text_1", "text_2")
        if out is None:
            return Response(status_code=499)
        p, scores = out
        return answer(ScoreResponse(id=new_id("score"), created=int(time.time()), model=p.model,
                                    data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                    usage=RerankUsage(prompt_tokens=p.tokens, total_tokens=p.tokens)), p.model)

    return router
