"""The Responses API's mcp tools end to end: `servelm serve --allowed-mcp-servers` on the real model, the `mcp`
SDK's own server (over streamable HTTP, and over the earlier HTTP+SSE transport) and a hostile one on 127.0.0.1
(tests/mcp_servers.py), driven by the `openai` SDK and the Agents SDK. The 135M model does not choose tools well, so
a test that needs a call forces it with tool_choice and asserts the protocol: the listed tools, a call whose output
is the tool's real one, approvals, and the stream's events."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.mcp_servers import HostileServer, McpHttpServer

from .conftest import own_server
from .helpers import MODEL, RunningServer

pytestmark = pytest.mark.e2e
SECRET = "sk-e2e-mcp-secret-91c2"


@pytest.fixture(scope="module")
def tools_server() -> Iterator[McpHttpServer]:
    s = McpHttpServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sse_tools_server() -> Iterator[McpHttpServer]:
    """The same real server, over MCP's earlier HTTP+SSE transport only."""
    s = McpHttpServer("sse")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hanging() -> Iterator[HostileServer]:
    s = HostileServer("hang")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory, tools_server, sse_tools_server, hanging) -> Iterator[RunningServer]:
    with own_server(tmp_path_factory, "--allowed-mcp-servers", tools_server.origin, "--allowed-mcp-servers", hanging.origin,
                    "--allowed-mcp-servers", sse_tools_server.origin, "--mcp-call-timeout", "5",
                    "--mcp-max-calls", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def mcp_client(mcp_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mcp_server.base_url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def tool(server: Any, **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tests", "server_url": server.url, "require_approval": "never",
            "headers": {"X-Api-Key": SECRET}, **fields}


def forced(name: str) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tests", "name": name}


def of_type(response: Any, kind: str) -> list[Any]:
    return [item for item in response.output if item.type == kind]


def bumps(client: openai.OpenAI, server: McpHttpServer) -> int:
    """How often the server's bump tool ran (asked through a forced call of its read-only bumps tool)."""
    response = client.responses.create(model=MODEL, input="How many?", max_output_tokens=16, temperature=0,
                                       tools=[tool(server, allowed_tools=["bumps"])], tool_choice=forced("bumps"))
    return int(of_type(response, "mcp_call")[0].output)


def test_a_forced_call_runs_on_the_server_and_the_answer_follows_it(mcp_client, tools_server):
    response = mcp_client.responses.create(model=MODEL, input="Add 2 and 3.", max_output_tokens=48, temperature=0,
                                           tools=[tool(tools_server, allowed_tools=["add", "echo"])],
                                           tool_choice=forced("add"))
    listed = of_type(response, "mcp_list_tools")
    assert len(listed) == 1 and sorted(t.name for t in listed[0].tools) == ["add", "echo"]
    assert response.output[0].type == "mcp_list_tools" and response.output[-1].type == "message"
    calls = of_type(response, "mcp_call")
    assert 1 <= len(calls) <= 2 and calls[0].name == "add"
    for call in calls:
        if call.name == "add":
            args = json.loads(call.arguments)
            assert call.status == "completed" and call.output == str(args["a"] + args["b"])
    assert response.usage is not None and response.usage.output_tokens > 0
    assert SECRET not in response.model_dump_json()
    kept = mcp_client.responses.retrieve(response.id)
    assert [i.type for i in kept.output] == [i.type for i in response.output] and SECRET not in kept.model_dump_json()


def test_a_server_that_speaks_only_sse_is_reached_over_sse(mcp_client, sse_tools_server):
    """A server of MCP's earlier HTTP+SSE transport answers streamable HTTP's POST with a 405: the server falls back
    to SSE at the same URL, and the response is the same as over streamable HTTP."""
    response = mcp_client.responses.create(model=MODEL, input="Echo hello.", max_output_tokens=32, temperature=0,
                                           tools=[tool(sse_tools_server, allowed_tools=["add", "echo"])],
                                           tool_choice=forced("echo"))
    listed = of_type(response, "mcp_list_tools")
    assert len(listed) == 1 and sorted(t.name for t in listed[0].tools) == ["add", "echo"]
    call = of_type(response, "mcp_call")[0]
    assert call.name == "echo" and call.status == "completed" and call.error is None
    assert call.output == json.loads(call.arguments)["text"]  # the tool's real output
    assert SECRET not in response.model_dump_json()


def test_the_stream_says_each_mcp_step_in_order(mcp_client, tools_server):
    with mcp_client.responses.stream(model=MODEL, input="Echo hello.", max_output_tokens=48, temperature=0,
                                     tools=[tool(tools_server, allowed_tools=["echo"])],
                                     tool_choice=forced("echo")) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:6] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                         "response.output_item.done"]
    call = next(e.item for e in events if e.type == "response.output_item.added" and e.item.type == "mcp_call")
    mine = [e.type for e in events if getattr(e, "item_id", None) == call.id
            or getattr(getattr(e, "item", None), "id", None) == call.id]
    assert mine[0] == "response.output_item.added" and "response.mcp_call_arguments.delta" in mine
    assert mine[-4:] == ["response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                         "response.mcp_call.completed", "response.output_item.done"]
    ran = next(i for i in final.output if i.id == call.id)
    assert ran.output == json.loads(ran.arguments)["text"]  # the tool's real output
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_an_approved_call_runs_exactly_once_and_never_before(mcp_client, tools_server):
    before = bumps(mcp_client, tools_server)
    approved = tool(tools_server, allowed_tools=["bump"], require_approval="always")
    first = mcp_client.responses.create(model=MODEL, input="Bump it.", max_output_tokens=32, temperature=0,
                                        tools=[approved], tool_choice=forced("bump"))
    asked = of_type(first, "mcp_approval_request")
    assert len(asked) == 1 and asked[0].name == "bump" and not of_type(first, "mcp_call")
    assert bumps(mcp_client, tools_server) == before  # never before approval
    answer = {"type": "mcp_approval_response", "approval_request_id": asked[0].id, "approve": True}
    second = mcp_client.responses.create(model=MODEL, input=[answer], previous_response_id=first.id,
                                         max_output_tokens=32, temperature=0, tools=[approved])
    ran = [c for c in of_type(second, "mcp_call") if c.approval_request_id == asked[0].id]
    assert len(ran) == 1 and ran[0].status == "completed"
    assert bumps(mcp_client, tools_server) == before + 1
    with pytest.raises(openai.BadRequestError) as again:  # the same answer again runs nothing
        mcp_client.responses.create(model=MODEL, input=[answer], previous_response_id=first.id, max_output_tokens=32,
                                    tools=[approved])
    assert again.value.code == "approval_already_answered"
    assert bumps(mcp_client, tools_server) == before + 1


def test_a_call_cut_short_by_max_output_tokens_is_never_offered_for_approval(mcp_client, tools_server):
    """A forced call whose arguments max_output_tokens cut was offered as an mcp_approval_request, half written."""
    asking = tool(tools_server, allowed_tools=["echo"], require_approval="always")
    for budget, stream in ((8, False), (12, False), (16, False), (24, False), (12, True), (24, True)):
        fields = dict(model=MODEL, input="Echo a long sentence about the sea.", max_output_tokens=budget,
                      temperature=0, tools=[asking], tool_choice=forced("echo"))
        if stream:
            with mcp_client.responses.create(**fields, stream=True) as events:
                response = [e for e in events][-1].response
        else:
            response = mcp_client.responses.create(**fields)
        offered = of_type(response, "mcp_approval_request")
        assert response.status == "completed" or not offered, (budget, offered)
        assert all(isinstance(json.loads(a.arguments), dict) for a in offered), offered


def test_a_server_the_operator_did_not_allow_is_a_400(mcp_client):
    with pytest.raises(openai.BadRequestError) as caught:
        mcp_client.responses.create(model=MODEL, input="hi", tools=[{"type": "mcp", "server_label": "x",
                                                                      "server_url": "http://127.0.0.1:9/mcp"}])
    assert caught.value.body["param"] == "tools[0].server_url"


def test_a_hanging_server_fails_its_own_request_and_no_other(mcp_client, tools_server, hanging):
    def hung() -> BaseException | None:
        try:
            mcp_client.responses.create(model=MODEL, input="hi", max_output_tokens=8, tools=[tool(hanging)])
        except openai.APIStatusError as exc:
            return exc
        return None

    def neighbour() -> str:
        return mcp_client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0).output_text

    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        failed, fine = pool.submit(hung), pool.submit(neighbour)
        error, text = failed.result(), fine.result()
    assert isinstance(error, openai.APIStatusError) and error.status_code == 424
    assert error.body["type"] == "external_connector_error" and SECRET not in str(error.body)
    assert isinstance(text, str)
    assert time.monotonic() - started < 60


def test_the_agents_sdk_hosted_mcp_tool(mcp_server, tools_server):
    """The Agents SDK's HostedMCPTool: the server lists and runs the call; the SDK sees its items."""
    from agents import Agent, HostedMCPTool, ModelSettings, Runner, set_default_openai_client, set_tracing_disabled
    from agents.model_settings import MCPToolChoice

    set_tracing_disabled(True)
    agent = Agent(name="helper", model=MODEL,
                  tools=[HostedMCPTool(tool_config=tool(tools_server, allowed_tools=["add"]))],  # type: ignore[arg-type]
                  model_settings=ModelSettings(tool_choice=MCPToolChoice(server_label="tests", name="add"),
                                               temperature=0, max_tokens=32))

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{mcp_server.base_url}/v1", api_key="none", max_retries=0) as client:
            set_default_openai_client(client)  # closed with its connections before asyncio.run closes their loop
            return await Runner.run(agent, "Add 2 and 3.")

    result = asyncio.run(run())
    raw = [item.raw_item for item in result.new_items]
    calls = [r for r in raw if getattr(r, "type", None) == "mcp_call"]
    assert calls and calls[0].output == str(sum(json.loads(calls[0].arguments).values()))
    assert isinstance(result.final_output, str)


# -- servers the operator configures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def configured(tmp_path_factory, tools_server) -> Iterator[RunningServer]:
    config = tmp_path_factory.mktemp("mcp") / "servers.toml"
    config.write_text(f"""
[[mcp_servers]]
label = "calc"
description = "over HTTP"
url = "{tools_server.url}"
require_approval = "never"

[[mcp_servers]]
label = "local"
description = "a command servelm runs"
command = "{sys.executable}"
args = ["-m", "tests.mcp_servers", "stdio"]
allowed_tools = ["add", "echo"]
""")
    with own_server(tmp_path_factory, "--config", str(config), "--mcp-max-calls", "1") as srv:
        yield srv


def servers(srv: RunningServer) -> dict[str, dict[str, Any]]:
    listed = httpx.get(f"{srv.base_url}/v1/mcp/servers", timeout=60).json()["data"]
    return {s["server_label"]: s for s in listed}


def test_configured_servers_are_listed_with_their_tools(configured):
    found = servers(configured)
    assert found["calc"]["transport"] == "streamable_http" and found["calc"]["status"] == "ready"
    assert found["local"]["transport"] == "stdio" and found["local"]["status"] == "ready"
    assert sorted(t["name"] for t in found["local"]["tools"]) == ["add", "echo"]  # its allowed_tools
    assert "add" in {t["name"] for t in found["calc"]["tools"]}


@pytest.mark.parametrize("label", ["calc", "local"])
def test_a_configured_server_is_named_by_its_label_alone(configured, label):
    with openai.OpenAI(base_url=f"{configured.base_url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        response = c.responses.create(model=MODEL, input="Add 2 and 3.", max_output_tokens=32, temperature=0,
                                      tools=[{"type": "mcp", "server_label": label, "require_approval": "never"}],
                                      tool_choice={"type": "mcp", "server_label": label, "name": "add"})
        call = of_type(response, "mcp_call")[0]
        assert call.server_label == label and call.output == str(sum(json.loads(call.arguments).values()))
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model=MODEL, input="hi", tools=[{"type": "mcp", "server_label": label,
                                                                "server_url": "http://127.0.0.1:9/mcp"}])
        assert caught.value.body["param"] == "tools[0].server_url"


def test_a_configured_command_that_dies_is_started_again(configured):
    ours = [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_our_stdio_server(int(pid), configured)]
    assert len(ours) == 1
    os.kill(int(ours[0]), signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if servers(configured)["local"]["status"] == "ready" and not os.path.exists(f"/proc/{ours[0]}/cmdline"):
            break
        time.sleep(1)
    assert servers(configured)["local"]["status"] == "ready"


def _is_our_stdio_server(pid: int, srv: RunningServer) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return b"tests.mcp_servers" in cmdline and b"stdio" in cmdline and parent == srv.process.pid
