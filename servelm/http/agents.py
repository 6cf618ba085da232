"""The routes agent frameworks and coding tools speak: OpenAI's Responses API (and its stored responses),
Anthropic's Messages API, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelm.errors import ApiError, InvalidParameter
from servelm.http.auth import check_access
from servelm.http.errors import anthropic_error
from servelm.http.openapi import doc
from servelm.http.routes import generate, parse_body, request_context
from servelm.http.state import AppState
from servelm.http.streams import named_sse
from servelm.protocol.anthropic import CountTokensRequest, MessageResponse, MessagesRequest, TokenCount
from servelm.protocol.responses import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from servelm.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def _responses_error(exc: ApiError, sequence: int) -> dict[str, Any]:
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": sequence}


RESPONSES_SSE = named_sse(_responses_error)
MESSAGES_SSE = named_sse(lambda exc, _: anthropic_error(exc))


def build_agent_router(state: AppState) -> APIRouter:
    router = APIRouter()
    services = state.services
    responses, messages, tokens = services.responses, services.messages, services.tokens

    @router.post("/v1/responses", openapi_extra=doc(request=ResponsesRequest, response=ResponseObject,
                                                    streams="text/event-stream"))
    @router.post("/v3/responses", openapi_extra=doc(request=ResponsesRequest, response=ResponseObject,
                                                    streams="text/event-stream"))
    async def create_response(request: Request) -> Response:
        return await generate(state, request, await parse_body(request, ResponsesRequest), responses, RESPONSES_SSE)

    @router.get("/v1/responses/{response_id}", openapi_extra=doc(response=ResponseObject))
    @router.get("/v3/responses/{response_id}", openapi_extra=doc(response=ResponseObject))
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        owner = request_context(request.scope).owner
        found = await asyncio.to_thread(responses.stored, owner, response_id)
        return JSONResponse(found.response)

    @router.delete("/v1/responses/{response_id}", openapi_extra=doc(response=DeletedResponse))
    @router.delete("/v3/responses/{response_id}", openapi_extra=doc(response=DeletedResponse))
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        await asyncio.to_thread(responses.delete, request_context(request.scope).owner, response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))

    @router.get("/v1/responses/{response_id}/input_items", openapi_extra=doc(response=InputItemList))
    @router.get("/v3/responses/{response_id}/input_items", openapi_extra=doc(response=InputItemList))
    async def list_input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                               after: str | None = None) -> JSONResponse:
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise InvalidParameter("order must be asc or desc, and limit between 1 and 100.",
                                   "order" if order not in ("asc", "desc") else "limit")
        page = await asyncio.to_thread(responses.input_item_list, request_context(request.scope).owner, response_id,
                                       order, limit, after)
        return JSONResponse(page.model_dump(mode="json"))

    @router.post("/v1/messages", openapi_extra=doc(request=MessagesRequest, response=MessageResponse,
                                                   streams="text/event-stream"))
    async def create_message(request: Request) -> Response:
        return await generate(state, request, await parse_body(request, MessagesRequest), messages, MESSAGES_SSE)

    @router.post("/v1/messages/count_tokens", openapi_extra=doc(request=CountTokensRequest, response=TokenCount))
    async def count_tokens(request: Request) -> JSONResponse:
        req = await parse_body(request, CountTokensRequest)
        check_access(request.scope, state.deployments, req.model)
        count = await asyncio.to_thread(messages.count_tokens, req, request_context(request.scope, state))
        return JSONResponse(count.model_dump(mode="json"))

    @router.post("/tokenize", openapi_extra=doc(request=TokenizeRequest, response=TokenizeResponse))
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest)
        check_access(request.scope, state.deployments, req.model)
        result = await asyncio.to_thread(tokens.tokenize, req, request_context(request.scope, state))
        return JSONResponse(result.model_dump(mode="json", exclude_none=True))

    @router.post("/detokenize", openapi_extra=doc(request=DetokenizeRequest, response=DetokenizeResponse))
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        check_access(request.scope, state.deployments, req.model)
        result = await asyncio.to_thread(tokens.detokenize, req)
        return JSONResponse(result.model_dump(mode="json"))

    return router
