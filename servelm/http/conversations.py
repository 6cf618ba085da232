"""OpenAI's Conversations API: /v1/conversations (create, retrieve, update, delete) and its items (list, add,
retrieve, delete), each scoped to the caller's key (service/conversations.py); and GET /v1/mcp/servers, the MCP
servers the operator configured, which Responses requests name by label."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from servelm.http.openapi import doc
from servelm.http.routes import Route, app_state, check_listing, parse_body, request_context
from servelm.protocol.conversations import (
    AddItems,
    ConversationItemList,
    ConversationObject,
    CreateConversation,
    DeletedConversation,
    UpdateConversation,
)
from servelm.service.conversations import MAX_PAGE


async def _answer(request: Request, method: str, *args: Any) -> JSONResponse:
    """The conversations service's `method` for the caller's key, off the event loop, as JSON."""
    service = app_state(request).services.conversations
    result = await asyncio.to_thread(getattr(service, method), request_context(request.scope).owner, *args)
    return JSONResponse(result if isinstance(result, dict) else result.model_dump(mode="json"))


async def create_conversation(request: Request) -> JSONResponse:
    return await _answer(request, "create", await parse_body(request, CreateConversation))


async def get_conversation(conversation_id: str, request: Request) -> JSONResponse:
    return await _answer(request, "get", conversation_id)


async def update_conversation(conversation_id: str, request: Request) -> JSONResponse:
    return await _answer(request, "update", conversation_id, await parse_body(request, UpdateConversation))


async def delete_conversation(conversation_id: str, request: Request) -> JSONResponse:
    return await _answer(request, "delete", conversation_id)


async def list_items(conversation_id: str, request: Request, order: str = "desc", limit: int = 20,
                     after: str | None = None) -> JSONResponse:
    check_listing(request, order, limit, MAX_PAGE)
    return await _answer(request, "items", conversation_id, order, limit, after)


async def add_items(conversation_id: str, request: Request) -> JSONResponse:
    check_listing(request)
    return await _answer(request, "add", conversation_id, await parse_body(request, AddItems))


async def get_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    check_listing(request)
    return await _answer(request, "item", conversation_id, item_id)


async def delete_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    return await _answer(request, "remove_item", conversation_id, item_id)


_ONE = "/v1/conversations/{conversation_id}"
_ITEMS = _ONE + "/items"
ROUTES = (
    Route("POST", "/v1/conversations", create_conversation,
          doc(request=CreateConversation, response=ConversationObject)),
    Route("GET", _ONE, get_conversation, doc(response=ConversationObject)),
    Route("POST", _ONE, update_conversation, doc(request=UpdateConversation, response=ConversationObject)),
    Route("DELETE", _ONE, delete_conversation, doc(response=DeletedConversation)),
    Route("GET", _ITEMS, list_items, doc(response=ConversationItemList)),
    Route("POST", _ITEMS, add_items, doc(request=AddItems, response=ConversationItemList)),
    Route("GET", _ITEMS + "/{item_id}", get_item, doc()),
    Route("DELETE", _ITEMS + "/{item_id}", delete_item, doc(response=ConversationObject)),
)


async def list_mcp_servers(request: Request) -> JSONResponse:
    """The operator's MCP servers and their tools now (each listed within --mcp-call-timeout)."""
    responses = app_state(request).services.responses
    servers = await responses.configured.describe(responses.mcp.limits)
    return JSONResponse({"object": "list", "data": servers})


MCP_ROUTES = (Route("GET", "/v1/mcp/servers", list_mcp_servers, doc()),)
