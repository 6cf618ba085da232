"""Stored responses, conversations and answered MCP approvals kept in the --state-dir database: what a client was
told was kept (a response returned, a stream's response.completed, a conversation's items answered) is served
after a SIGKILL and a restart, `previous_response_id` and the conversation go on from it, a pending approval can
be answered after it and runs once (one answered before it runs no more), and each key still sees only its own."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.mcp_servers import McpHttpServer

from .conftest import own_server
from .helpers import MODEL, RunningServer, client_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # two starts of the server, a few minutes on a busy machine
ONE, TWO, MONITOR = "sk-state-one", "sk-state-two", "sk-state-monitor"


@pytest.fixture(scope="module")
def tools_server() -> Iterator[McpHttpServer]:
    s = McpHttpServer()
    yield s
    s.stop()


def killed(srv: RunningServer) -> None:
    srv.process.kill()  # no graceful stop: what was committed is all there is
    srv.process.wait(timeout=10)


def bumps(client: openai.OpenAI, tool: dict) -> int:
    response = client.responses.create(model=MODEL, input="How many?", max_output_tokens=16, temperature=0,
                                       tools=[{**tool, "allowed_tools": ["bumps"], "require_approval": "never"}],
                                       tool_choice={"type": "mcp", "server_label": "tests", "name": "bumps"})
    return int(next(i for i in response.output if i.type == "mcp_call").output)


@pytest.mark.slow
def test_what_was_kept_survives_a_kill_and_goes_on(tmp_path_factory, tools_server) -> None:
    state = str(tmp_path_factory.mktemp("state"))
    flags = ("--state-dir", state, "--api-key", ONE, "--api-key", TWO, "--monitor-key", MONITOR,
             "--allowed-mcp-servers", tools_server.origin)
    tool = {"type": "mcp", "server_label": "tests", "server_url": tools_server.url, "allowed_tools": ["bump"],
            "require_approval": "always"}
    with own_server(tmp_path_factory, *flags) as srv:
        health = httpx.get(f"{srv.base_url}/health", headers={"authorization": f"Bearer {MONITOR}"}, timeout=10).json()
        assert health["kept"]["survives_restart"] is True and health["kept"]["responses"].startswith("sqlite")
        one = client_for(srv.base_url, ONE)
        first = one.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
        first_items = [i.id for i in one.responses.input_items.list(first.id).data]
        with one.responses.create(model=MODEL, input="Count to three.", max_output_tokens=8, temperature=0,
                                  stream=True) as events:
            streamed = [e for e in events][-1].response  # kept before response.completed (or .incomplete) was sent
        conversation = one.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
        turn = one.responses.create(model=MODEL, input="What is my name?", conversation=conversation.id,
                                    max_output_tokens=8, temperature=0, store=False)
        items = one.conversations.items.list(conversation.id, order="asc").data

        def ask() -> tuple[str, dict]:
            asking = one.responses.create(model=MODEL, input="Bump it.", max_output_tokens=32, temperature=0,
                                          tools=[tool], tool_choice={"type": "mcp", "server_label": "tests", "name": "bump"})
            asked = next(i for i in asking.output if i.type == "mcp_approval_request")
            return asking.id, {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}

        answered, pending = ask(), ask()
        one.responses.create(model=MODEL, input=[answered[1]], previous_response_id=answered[0], max_output_tokens=32,
                             temperature=0, tools=[tool])
        before = bumps(one, tool)
        killed(srv)
    with own_server(tmp_path_factory, *flags) as srv:
        one, two = client_for(srv.base_url, ONE), client_for(srv.base_url, TWO)
        for kept in (first, streamed):
            again = one.responses.retrieve(kept.id)
            assert again.output_text == kept.output_text and again.status == kept.status
            with pytest.raises(openai.NotFoundError):
                two.responses.retrieve(kept.id)  # another key's, after the restart as before it
        assert [i.id for i in one.responses.input_items.list(first.id).data] == first_items
        following = one.responses.create(model=MODEL, input="And again.", previous_response_id=first.id,
                                         max_output_tokens=8, temperature=0)
        assert following.status in ("completed", "incomplete")
        assert one.responses.retrieve(following.id).previous_response_id == first.id
        assert [(i.id, i.type) for i in one.conversations.items.list(conversation.id, order="asc").data] == \
            [(i.id, i.type) for i in items]
        assert items[-1].id == turn.output[-1].id
        one.responses.create(model=MODEL, input="Thanks.", conversation=conversation.id, max_output_tokens=8,
                             temperature=0)
        assert len(one.conversations.items.list(conversation.id, limit=100).data) == len(items) + 2
        with pytest.raises(openai.NotFoundError):
            two.conversations.retrieve(conversation.id)
        with pytest.raises(openai.BadRequestError) as refused:  # answered before the restart: it runs no more
            one.responses.create(model=MODEL, input=[answered[1]], previous_response_id=answered[0],
                                 max_output_tokens=32, tools=[tool])
        assert refused.value.code == "approval_already_answered"
        ran = one.responses.create(model=MODEL, input=[pending[1]], previous_response_id=pending[0],
                                   max_output_tokens=32, temperature=0, tools=[tool])
        assert [c.status for c in ran.output if c.type == "mcp_call"] == ["completed"]
        assert bumps(one, tool) == before + 1, "the approval asked for before the restart ran once, after it"
