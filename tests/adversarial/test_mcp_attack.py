"""The black-box attack on the Responses API's MCP tools, each finding a test: a server that fails after connecting
(a listing or an answer past the byte bound, a dropped connection) fails its own step as a 424 or a failed call,
never the request's task; header values and names a client could smuggle are a 400; the SDK's HTTP client logs no
header; an MCP tool_choice needs an mcp tool; tool names stay unique across servers; --mcp-timeout counts the MCP
work, not the generation around it; a server's schema the model cannot use is the server's fault (424); and a
schema nested past the bound is refused. A server of MCP's earlier HTTP+SSE transport (reached by falling back to it)
may name only its own origin as its endpoint, may not flood its event stream or the log, and its stream outlives
the generation between two steps."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.errors import InvalidParameter
from servelm.protocol.responses import ResponsesRequest
from servelm.runners.fake import FakeRunner
from servelm.service import hosted_mcp, mcp
from servelm.service.chat import ChatService
from servelm.service.hosted_mcp import McpServer, McpSettings
from servelm.service.mcp import McpBudget, McpLimits, McpSession, McpTool, McpUnavailable, StdioServer, parse_allowed
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import Deployments
from servelm.service.responses import ResponsesService
from servelm.service.store import MemoryStore
from tests.mcp_servers import McpHttpServer, hostile

ALICE = RequestContext(owner="a" * 64)


@pytest.fixture(scope="module")
def server() -> Iterator[McpHttpServer]:
    s = McpHttpServer()
    yield s
    s.stop()


def session(url: str, limits: McpLimits) -> McpSession:
    return McpSession("tests", url, {}, limits, McpBudget(limits.total_s))


async def test_a_listing_past_the_byte_bound_is_a_424_not_a_cancelled_request(mcp_either):
    """The server answers its handshake, then a listing longer than max_message_bytes: the cut fails the step."""
    limits = McpLimits(max_message_bytes=600, connect_s=5, list_s=5)
    started = time.monotonic()
    with pytest.raises(McpUnavailable):
        async with session(mcp_either.url, limits) as s:
            assert s.transport == mcp_either.transport
            await s.list_tools()
    assert time.monotonic() - started < 10
    await asyncio.sleep(0)  # the request's task is not cancelled: it goes on
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_an_answer_past_the_byte_bound_is_a_failed_call_and_the_request_goes_on(mcp_either):
    limits = McpLimits(max_message_bytes=64 << 10, call_s=10)
    async with session(mcp_either.url, limits) as s:
        flood = await s.call("large", {"size": 5 << 20})
        assert flood.output is None and flood.server_failed
        assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]
    async with session(mcp_either.url, limits) as s:  # and the next session is fine
        assert (await s.call("echo", {"text": "after"})).output == "after"


async def test_the_mcp_budget_counts_mcp_work_not_what_happens_between(mcp_either):
    """(Over SSE the server's event stream is open all along: it waits out the generation, unlike a step.)"""
    limits = McpLimits(total_s=1.5, call_s=1.5)
    async with session(mcp_either.url, limits) as s:
        await asyncio.sleep(2.0)  # the model generating between two steps
        assert (await s.call("echo", {"text": "in time"})).output == "in time"


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:{port}/messages/?session_id=0", "//127.0.0.1:{port}/messages/"])
async def test_an_sse_endpoint_on_another_origin_is_never_reached(endpoint, caplog):
    """An SSE server names the URL its client POSTs to: one on another origin (which the operator may not allow,
    or an address inside the network) is refused unsent, within the connect bound, and not logged."""
    caplog.set_level(logging.DEBUG)
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen(4)
        named = endpoint.format(port=elsewhere.getsockname()[1])
        with hostile("sse-elsewhere", endpoint=named) as bad:
            limits = McpLimits(connect_s=2.0, list_s=2.0)
            started = time.monotonic()
            with pytest.raises(McpUnavailable):
                async with session(bad.url, limits) as s:
                    await s.list_tools()
            assert time.monotonic() - started < limits.connect_s + 2
        elsewhere.setblocking(False)
        with pytest.raises(BlockingIOError):
            elsewhere.accept()  # nothing came
    assert named not in caplog.text and "127.0.0.1:" + named.split(":")[-1] not in caplog.text


async def test_an_sse_stream_that_never_stops_is_cut_at_its_bound_and_floods_no_log(caplog):
    """Endless small events, each within the bound: the stream, which carries a session's every answer, is cut
    past what those answers may take (max_calls + 4 of max_message_bytes), long before the connect bound; and the
    SDK's warning for each event it does not know stays out of the log."""
    caplog.set_level(logging.DEBUG)
    limits = McpLimits(connect_s=30.0, list_s=30.0, max_message_bytes=64 << 10)
    with hostile("sse-chatter") as bad:
        started = time.monotonic()
        with pytest.raises(McpUnavailable):
            async with session(bad.url, limits) as s:
                await s.list_tools()
        assert time.monotonic() - started < 5
    assert len(caplog.records) < 10, caplog.records[:10]


@pytest.fixture
def chat() -> Iterator[ChatService]:
    deployment, engine = build_deployment("fake-model", FakeRunner(context_window=4096), DeploymentOptions(prefix_cache=False))
    engine.start()
    try:
        yield ChatService(Deployments([deployment]))
    finally:
        engine.stop()


def request(server: Any, tool: dict[str, Any] | None = None, **fields: Any) -> ResponsesRequest:
    tools = [{"type": "mcp", "server_label": "tests", "server_url": server.url, "require_approval": "never",
              **(tool or {})}]
    return ResponsesRequest.model_validate({"model": "fake-model", "input": "hi", "max_output_tokens": 8,
                                            "tools": tools, **fields})


@pytest.mark.parametrize("tool, field", [
    ({"headers": {"Host": "internal-admin.example"}}, "tools[0].headers"),
    ({"headers": {"Content-Length": "0"}}, "tools[0].headers"),
    ({"headers": {"transfer-encoding": "chunked"}}, "tools[0].headers"),
    ({"headers": {"Connection": "Upgrade", "Upgrade": "h2c"}}, "tools[0].headers"),
    ({"headers": {"Mcp-Session-Id": "someone-elses"}}, "tools[0].headers"),
    ({"headers": {"X-Key": "secret\n"}}, "tools[0].headers"),
    ({"headers": {"X-Key": "a\r\nInjected: 1"}}, "tools[0].headers"),
    ({"headers": {"Bad Name": "v"}}, "tools[0].headers"),
    ({"headers": {"": "v"}}, "tools[0].headers"),
    ({"authorization": "tok-LEAKCHECK\n"}, "tools[0].authorization"),
    ({"server_url": "http://127.0.0.1:1/mcp\r\nX: y"}, "tools[0].server_url"),
    ({"server_url": "http://127.0.0.1:1/m cp"}, "tools[0].server_url"),
])
def test_a_header_or_url_a_client_could_smuggle_is_a_400(chat, server, tool, field):
    service = ResponsesService(chat, MemoryStore(), McpSettings(parse_allowed((server.origin, "http://127.0.0.1:1"))))
    with pytest.raises(InvalidParameter) as caught:
        service.prepare(request(server, tool), ALICE)
    assert caught.value.param == field
    assert "secret" not in caught.value.message and "LEAKCHECK" not in caught.value.message


def test_the_sdks_http_client_logs_no_request_at_debug():
    assert mcp  # imported: its loggers are set
    for name in ("httpx2", "httpcore2"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name


def test_an_mcp_tool_choice_needs_an_mcp_tool(chat):
    service = ResponsesService(chat, MemoryStore())
    req = ResponsesRequest.model_validate({"model": "fake-model", "input": "hi", "tools": [],
                                           "tool_choice": {"type": "mcp", "server_label": "x", "name": "y"}})
    with pytest.raises(InvalidParameter) as caught:
        service.prepare(req, ALICE)
    assert caught.value.param == "tool_choice"


def test_exposed_names_stay_unique_whatever_the_labels():
    def server(label: str) -> McpServer:
        return McpServer(label, "", "tools[0]", None, "never")

    def tool(name: str) -> McpTool:
        return McpTool(name, "", {"type": "object"})

    exposed = hosted_mcp.expose([(server("a"), [tool("b__echo"), tool("echo")]), (server("a__b"), [tool("echo")]),
                                 (server("h"), [tool("echo2")])], {"h__echo2", "echo2"})
    names = [e.function for e in exposed]
    assert len(set(names)) == len(names) and "h__echo2" not in names and "echo2" not in names
    assert all(len(n) <= 64 for n in names)


async def test_a_schema_the_model_cannot_use_is_the_servers_fault(chat, server):
    """The fake model spells no JSON, so no tool schema of the server compiles: a 424 naming the server, not a 400
    blaming tools[0].function.parameters, which the client never sent."""
    service = ResponsesService(chat, MemoryStore(), McpSettings(parse_allowed((server.origin,))))
    with pytest.raises(McpUnavailable) as caught:
        await service.complete(service.prepare(request(server), ALICE))
    assert caught.value.status == 424 and "tests" in caught.value.message


def test_a_schema_nested_past_the_bound_is_refused():
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(mcp.MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    assert mcp.schema_depth(deep) > mcp.MAX_SCHEMA_DEPTH
    assert mcp.schema_depth({"type": "object", "properties": {"a": {"type": "integer"}}}) <= mcp.MAX_SCHEMA_DEPTH


def _children(*markers: str) -> list[int]:
    """This process's child processes whose command line holds every one of `markers`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and all(m.encode() in cmdline for m in markers):
            found.append(int(entry.name))
    return found


async def test_a_configured_command_that_hangs_at_start_is_started_again_and_stops_with_the_app():
    marker = "servelm-mcp-hang-at-start"
    server = StdioServer("hangs", sys.executable, ["-c", f"import time; time.sleep(10**6)  # {marker}"], {})
    server.START_S = 1.0
    server.start()
    try:
        deadline = time.monotonic() + 60
        while server.restarts < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert server.restarts >= 2 and server.status in ("restarting", "starting")
    finally:
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 25  # the app's stop is never held up
    await asyncio.sleep(1)
    assert len(_children(marker)) <= 1  # every hung start but at most the last one given up was killed


async def test_a_configured_command_that_stops_answering_is_replaced():
    server = StdioServer("stopped", sys.executable, ["-m", "tests.mcp_servers", "stdio"], {})
    server.CHECK_EVERY_S = 1.0
    server.start()
    try:
        await asyncio.wait_for(server.ready.wait(), 60)
        first = _children("tests.mcp_servers", "stdio")
        assert len(first) == 1
        os.kill(first[0], signal.SIGSTOP)  # alive, and answering nothing
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = _children("tests.mcp_servers", "stdio")
            if server.status == "ready" and first[0] not in now and len(now) == 1:
                break
            await asyncio.sleep(0.5)
        assert server.status == "ready" and first[0] not in _children("tests.mcp_servers", "stdio")
        async with server.session(McpLimits(), McpBudget(30)) as s:
            assert (await s.call("echo", {"text": "back"})).output == "back"
    finally:
        await server.stop()


async def test_a_configured_command_that_prints_junk_floods_no_log_and_still_serves(caplog):
    """A command that wrote lines other than JSON-RPC on its stdout logged a traceback for each one: a command
    printing in a loop filled the server's log."""
    junk = ("import sys, runpy; [print('not json-rpc', i) for i in range(200)]; sys.stdout.flush(); "
            "sys.argv = ['x', 'stdio']; runpy.run_module('tests.mcp_servers', run_name='__main__')")
    server = StdioServer("junk", sys.executable, ["-c", junk], {})
    with caplog.at_level(logging.DEBUG):
        server.start()
        try:
            await asyncio.wait_for(server.ready.wait(), 60)
            async with server.session(McpLimits(), McpBudget(30)) as s:
                assert (await s.call("echo", {"text": "back"})).output == "back"
        finally:
            await server.stop()
    assert not [r for r in caplog.records if r.exc_info], "no traceback for what a command printed"
    assert len(caplog.records) < 20, [r.getMessage() for r in caplog.records][:20]


@pytest.mark.parametrize("loosened", ["never", {"never": {"tool_names": ["bump"]}}, {"always": {"tool_names": ["x"]}}])
def test_a_request_cannot_loosen_the_approvals_an_operator_requires(chat, loosened):
    """A request's require_approval "never" ran the calls of a configured server whose operator asked for approval
    of every call."""
    from servelm.config import McpServerSpec

    spec = McpServerSpec(label="guarded", url="http://127.0.0.1:1/mcp", require_approval="always")
    service = ResponsesService(chat, MemoryStore(), McpSettings(configured=(spec,)))
    tool = {"type": "mcp", "server_label": "guarded", "require_approval": loosened}
    with pytest.raises(InvalidParameter) as caught:
        service.prepare(ResponsesRequest.model_validate({"model": "fake-model", "input": "x", "tools": [tool]}))
    assert caught.value.param == "tools[0].require_approval"
    for kept in ("always", None):  # as strict, or the operator's own
        plan = service.prepare(ResponsesRequest.model_validate({"model": "fake-model", "input": "x", "tools": [
            {k: v for k, v in {**tool, "require_approval": kept}.items() if v is not None}]})).mcp
        assert plan is not None and plan.servers[0].approval == "always"
