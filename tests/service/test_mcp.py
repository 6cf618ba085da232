"""service/mcp.py against real MCP servers on 127.0.0.1: the `mcp` SDK's own server (tests/mcp_servers.py), over
streamable HTTP and over MCP's earlier HTTP+SSE transport (reached by falling back to it), and hostile ones that hang,
flood, answer malformed JSON-RPC or drop the connection. Each failure is that request's alone (a 424 in OpenAI's
shape), bounded in time, and never shows the request's headers."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator

import httpx2
import pytest

from servelm.errors import InvalidParameter
from servelm.service import mcp
from servelm.service.mcp import McpBudget, McpLimits, McpSession, McpUnavailable, check_server_url, parse_allowed
from tests.mcp_servers import McpHttpServer, hostile

SECRET = "Bearer sk-never-shown-4d1f"
FAST = McpLimits(connect_s=2.0, list_s=2.0, call_s=2.0, total_s=10.0, max_output_bytes=1000,
                 max_message_bytes=256 << 10)


@pytest.fixture(scope="module")
def server() -> Iterator[McpHttpServer]:
    s = McpHttpServer()
    yield s
    s.stop()


def session(url: str, limits: McpLimits = FAST) -> McpSession:
    return McpSession("tests", url, {"authorization": SECRET}, limits, McpBudget(limits.total_s))


@pytest.mark.slow
async def test_a_real_server_lists_its_tools_and_runs_a_call(mcp_either):
    async with session(mcp_either.url) as s:
        assert s.transport == mcp_either.transport
        tools = await s.list_tools()
        assert {"add", "echo", "fail"} <= {t.name for t in tools}
        add = next(t for t in tools if t.name == "add")
        assert add.input_schema["required"] == ["a", "b"] and add.description == "Add two integers."
        assert await s.list_tools(("echo",)) == [next(t for t in tools if t.name == "echo")]
        assert await s.call("add", {"a": 2, "b": 40}) == mcp.McpResult("42", None)
        failed = await s.call("fail", {"why": "no such order"})
        assert failed.output is None and failed.error is not None and "no such order" in failed.error
        unknown = await s.call("nope", {})
        assert unknown.output is None and unknown.error


async def test_a_large_output_is_cut_at_its_bound_and_says_so(mcp_either):
    async with session(mcp_either.url) as s:
        result = await s.call("large", {"size": 5000})
    assert result.output is not None and result.output.startswith("x" * 1000)
    assert result.output.endswith(f"[output cut at {FAST.max_output_bytes} bytes]") and len(result.output) < 1100


async def test_a_slow_call_fails_at_its_bound_and_the_session_stays_usable(mcp_either):
    async with session(mcp_either.url) as s:
        started = time.monotonic()
        slow = await s.call("slow", {"seconds": 30})
        assert slow.output is None and slow.error is not None and "timed out" in slow.error
        assert time.monotonic() - started < FAST.call_s + 1.5


@pytest.mark.parametrize("kind", ["hang", "flood", "malformed", "drop", "sse-hang", "sse-flood", "sse-chatter"])
async def test_a_hostile_server_fails_only_its_own_request(server, kind, caplog):
    caplog.set_level(logging.DEBUG)
    with hostile(kind) as bad:
        async def named_the_bad_one() -> BaseException | None:
            try:
                async with session(bad.url) as s:
                    await s.list_tools()
            except McpUnavailable as exc:
                return exc
            return None

        async def a_neighbour() -> str | None:
            async with session(server.url) as s:
                return (await s.call("echo", {"text": "fine"})).output

        started = time.monotonic()
        failure, neighbour = await asyncio.gather(named_the_bad_one(), a_neighbour())
        took = time.monotonic() - started
    assert isinstance(failure, McpUnavailable) and failure.status == 424
    assert failure.body()["error"]["type"] == "external_connector_error"
    assert neighbour == "fine"
    assert took < FAST.connect_s + FAST.list_s + 3
    assert SECRET not in caplog.text and SECRET not in str(failure.body())


async def test_the_responses_budget_bounds_every_step(server):
    with hostile("hang") as bad:
        s = McpSession("tests", bad.url, {}, McpLimits(connect_s=30.0), McpBudget(1.0))
        started = time.monotonic()
        with pytest.raises(McpUnavailable, match="timed out"):
            async with s:
                pass
        assert time.monotonic() - started < 3


async def test_no_request_of_a_session_leaves_its_servers_origin():
    """Whatever would send one elsewhere (a redirect the SDK follows from http to https on the default ports, an SSE
    server's endpoint): refused unsent, with the request's headers."""
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen(4)
        http, _ = session("http://127.0.0.1:1/mcp")._http()
        async with http:
            with pytest.raises(httpx2.ConnectError):
                await http.get(f"http://127.0.0.1:{elsewhere.getsockname()[1]}/mcp")
        elsewhere.setblocking(False)
        with pytest.raises(BlockingIOError):
            elsewhere.accept()


async def test_only_allowed_origins_are_reached():
    allowed = parse_allowed(("http://127.0.0.1:8931", "https://tools.example.com"))
    await check_server_url("http://127.0.0.1:8931/mcp", allowed, "tools[0].server_url")
    await check_server_url("http://127.0.0.1:8931/any/path?x=1", allowed, "tools[0].server_url")
    for url in ("http://127.0.0.1:8932/mcp", "https://127.0.0.1:8931/mcp", "http://localhost:8931/mcp",
                "http://user:pw@127.0.0.1:8931/mcp", "file:///etc/passwd", "ftp://127.0.0.1:8931/", "not a url",
                "http://127.0.0.1:99999/"):
        with pytest.raises(InvalidParameter) as caught:
            await check_server_url(url, allowed, "tools[0].server_url")
        assert caught.value.param == "tools[0].server_url"
    with pytest.raises(InvalidParameter):
        await check_server_url("http://127.0.0.1:8931/mcp", frozenset(), "tools[0].server_url")  # default: none


@pytest.mark.parametrize("text", ["127.0.0.1:8931", "http://127.0.0.1:8931/mcp", "ws://127.0.0.1:1", "http://",
                                  "http://127.0.0.1:8931/?q=1"])
def test_an_allowed_server_must_be_an_origin(text):
    with pytest.raises(ValueError, match="not an origin"):
        parse_allowed((text,))


@pytest.mark.slow
async def test_an_allowed_name_that_resolves_inside_the_network_is_refused(monkeypatch):
    """An allowed public name whose DNS answer is a private address (a rebinding) is not reached."""
    loop = asyncio.get_running_loop()

    async def private(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port))]

    monkeypatch.setattr(loop, "getaddrinfo", private)
    allowed = parse_allowed(("https://tools.example.com",))
    with pytest.raises(InvalidParameter, match="private address"):
        await check_server_url("https://tools.example.com/mcp", allowed, "tools[0].server_url")
