"""The routes agent frameworks and coding tools speak: OpenAI's Responses API (and its stored responses),
Anthropic's Messages API, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.errors import ApiError
from servelm.http.auth import check_access
from servelm.http.errors import anthropic_error
from servelm.http.openapi import doc
from servelm.http.routes import Route, app_state, check_listing, generate, parse_body, request_context
from servelm.http.streams import named_sse
from servelm.protocol.anthropic import CountTokensRequest, MessageResponse, MessagesRequest, TokenCount
from servelm.protocol.responses import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from servelm.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def _responses_error(exc: ApiError, sequence: int) -> dict[str, Any]:
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": sequence}


RESPONSES_SSE = named_sse(_responses_error)
MESSAGES_SSE = named_sse(lambda exc, _: anthropic_error(exc))


async def create_response(request: Request) -> Response:
    services = app_state(request).services
    return await generate(request, await parse_body(request, ResponsesRequest), services.responses, RESPONSES_SSE)


async def get_response(response_id: str, request: Request) -> JSONResponse:
    owner = request_context(request.scope).owner
    found = await asyncio.to_thread(app_state(request).services.responses.stored, owner, response_id)
    return JSONResponse(found.response)


async def delete_response(response_id: str, request: Request) -> JSONResponse:
    await asyncio.to_thread(app_state(request).services.responses.delete, request_context(request.scope).owner,
                            response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))


async def list_input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                           after: str | None = None) -> JSONResponse:
    check_listing(request, order, limit)
    page = await asyncio.to_thread(app_state(request).services.responses.input_item_list,
                                   request_context(request.scope).owner, response_id, order, limit, after)
    return JSONResponse(page.model_dump(mode="json"))


async def create_message(request: Request) -> Response:
    services = app_state(request).services
    return await generate(request, await parse_body(request, MessagesRequest), services.messages, MESSAGES_SSE)


async def count_tokens(request: Request) -> JSONResponse:
    req = await parse_body(request, CountTokensRequest)
    state = app_state(request)
    check_access(request.scope, state.deployments, req.model)
    count = await asyncio.to_thread(state.services.messages.count_tokens, req, request_context(request.scope, state))
    return JSONResponse(count.model_dump(mode="json"))


async def tokenize(request: Request) -> JSONResponse:
    req = await parse_body(request, TokenizeRequest)
    state = app_state(request)
    check_access(request.scope, state.deployments, req.model)
    result = await asyncio.to_thread(state.services.tokens.tokenize, req, request_context(request.scope, state))
    return JSONResponse(result.model_dump(mode="json", exclude_none=True))


async def detokenize(request: Request) -> JSONResponse:
    req = await parse_body(request, DetokenizeRequest)
    state = app_state(request)
    check_access(request.scope, state.deployments, req.model)
    result = await asyncio.to_thread(state.services.tokens.detokenize, req)
    return JSONResponse(result.model_dump(mode="json"))


_RESPONSE = "/v3/responses", "/v1/responses"
_STORED = "/v3/responses/{response_id}", "/v1/responses/{response_id}"
_ITEMS = "/v3/responses/{response_id}/input_items", "/v1/responses/{response_id}/input_items"
ROUTES = (
    *(Route("POST", path, create_response,
            doc(request=ResponsesRequest, response=ResponseObject, streams="text/event-stream")) for path in _RESPONSE),
    *(Route("GET", path, get_response, doc(response=ResponseObject)) for path in _STORED),
    *(Route("DELETE", path, delete_response, doc(response=DeletedResponse)) for path in _STORED),
    *(Route("GET", path, list_input_items, doc(response=InputItemList)) for path in _ITEMS),
    Route("POST", "/v1/messages", create_message,
          doc(request=MessagesRequest, response=MessageResponse, streams="text/event-stream")),
    Route("POST", "/v1/messages/count_tokens", count_tokens, doc(request=CountTokensRequest, response=TokenCount)),
    Route("POST", "/tokenize", tokenize, doc(request=TokenizeRequest, response=TokenizeResponse)),
    Route("POST", "/detokenize", detokenize, doc(request=DetokenizeRequest, response=DetokenizeResponse)),
)
