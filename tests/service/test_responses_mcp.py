"""The Responses API's mcp tools on the fake runner (whose letters-only vocabulary spells no JSON, so no call: those
run on the real model in tests/e2e/test_mcp.py), against the `mcp` SDK's own server and hostile ones on 127.0.0.1
(tests/mcp_servers.py): every refusal a 4xx naming its field, a failing server a 424 for its own response alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.errors import InvalidParameter
from servelm.protocol.responses import ResponsesRequest
from servelm.runners.fake import FakeRunner
from servelm.service.chat import ChatService
from servelm.service.hosted_mcp import McpSettings
from servelm.service.mcp import McpLimits, McpUnavailable, parse_allowed
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import Deployments
from servelm.service.responses import ResponsesService
from servelm.service.store import MemoryStore
from tests.mcp_servers import McpHttpServer, hostile

ALICE, BOB = RequestContext(owner="a" * 64), RequestContext(owner="b" * 64)
LIMITS = McpLimits(connect_s=3.0, list_s=3.0, call_s=3.0, total_s=20.0, max_calls=3)
SECRET = "sk-mcp-secret-7f3a"


@pytest.fixture(scope="module")
def server() -> Iterator[McpHttpServer]:
    s = McpHttpServer()
    yield s
    s.stop()


@pytest.fixture
def chat() -> Iterator[ChatService]:
    deployment, engine = build_deployment("fake-model", FakeRunner(context_window=4096, num_slots=4),
                                          DeploymentOptions(prefix_cache=False))
    engine.start()
    try:
        yield ChatService(Deployments([deployment]))
    finally:
        engine.stop()


def service_for(chat: ChatService, *origins: str, store: MemoryStore | None = None) -> ResponsesService:
    return ResponsesService(chat, store or MemoryStore(), McpSettings(parse_allowed(origins), LIMITS))


def mcp_tool(server: Any, **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tests", "server_url": server.url, "require_approval": "never",
            "headers": {"X-Api-Key": SECRET}, **fields}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "fake-model", "input": "add 2 and 3", "max_output_tokens": 64,
                                            "seed": 7, **fields})


def of_type(response: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == kind]


@pytest.mark.parametrize("tool, choice, field", [
    ({"server_url": "http://127.0.0.1:1/mcp"}, None, "tools[0].server_url"),  # not an allowed origin
    ({"server_url": "file:///etc/passwd"}, None, "tools[0].server_url"),
    ({"server_url": None, "connector_id": "connector_gmail"}, None, "tools[0].connector_id"),
    ({"server_url": None}, None, "tools[0].server_url"),
    ({}, {"type": "mcp", "server_label": "elsewhere"}, "tool_choice"),
])
def test_a_request_the_server_will_not_run_is_a_400_naming_its_field(chat, server, tool, choice, field):
    service = service_for(chat, server.origin)
    fields: dict[str, Any] = {"tools": [{k: v for k, v in {**mcp_tool(server), **tool}.items() if v is not None}]}
    if choice is not None:
        fields["tool_choice"] = choice
    with pytest.raises(InvalidParameter) as caught:
        service.prepare(request(**fields), ALICE)
    assert caught.value.param == field


def test_servers_are_refused_unless_the_operator_allows_them(chat, server):
    with pytest.raises(InvalidParameter, match="--allowed-mcp-servers"):
        ResponsesService(chat, MemoryStore()).prepare(request(tools=[mcp_tool(server)]), ALICE)


def test_an_approval_must_answer_a_request_of_the_previous_response(chat, server):
    service = service_for(chat, server.origin)
    answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_nothing", "approve": True}
    with pytest.raises(InvalidParameter) as caught:
        service.prepare(request(tools=[mcp_tool(server)], input=[answer]), ALICE)
    assert caught.value.param == "input[0].approval_request_id"
    with pytest.raises(InvalidParameter):  # an answer without its server's tool
        service.prepare(request(input=[answer]), ALICE)


async def test_a_hanging_server_fails_its_own_response_and_no_other(chat, server):
    with hostile("hang") as bad:
        service = service_for(chat, server.origin, bad.origin)
        hung = request(tools=[mcp_tool(bad)])
        fine = request()  # a neighbour's plain response, meanwhile
        started = time.monotonic()
        results = await asyncio.gather(service.complete(service.prepare(hung, ALICE)),
                                       service.complete(service.prepare(fine, BOB)), return_exceptions=True)
        assert isinstance(results[0], McpUnavailable) and results[0].status == 424
        assert results[0].body()["error"]["type"] == "external_connector_error"
        assert not isinstance(results[1], BaseException) and of_type(results[1].model_dump(mode="json"), "message")
        assert time.monotonic() - started < LIMITS.connect_s + 5


async def test_a_listing_that_fails_is_said_in_the_stream_before_the_error(chat, server):
    with hostile("malformed") as bad:
        service = service_for(chat, bad.origin)
        events = []
        with pytest.raises(McpUnavailable):
            async for event in service.stream(service.prepare(request(stream=True, tools=[mcp_tool(bad)]), ALICE)):
                events.append(event.model_dump(mode="json", exclude_none=True))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.mcp_list_tools.in_progress", "response.mcp_list_tools.failed",
                     "response.output_item.done"]
    assert events[-1]["item"]["error"] and SECRET not in json.dumps(events)
