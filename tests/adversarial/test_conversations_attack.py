"""The black-box attack on conversations and the configured MCP servers, each finding a test: an item id a client
chooses again never overwrites an earlier item, and one no route could name is replaced; a config file's error
never shows an MCP server's secrets, and its headers are checked as a request's are; the MCP servers' listing asks
them all at once."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from servelm.config import load_config_file
from servelm.protocol.conversations import AddItems, CreateConversation
from servelm.service.conversations import ConversationsService, MemoryConversations
from servelm.service.hosted_mcp import Configured
from servelm.service.mcp import McpLimits
from tests.mcp_servers import hostile


def message(text: str, **fields: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, **fields}


def test_an_id_chosen_again_never_overwrites_an_item():
    service = ConversationsService(MemoryConversations())
    cid = service.create("k", CreateConversation.model_validate({"items": [message("first", id="msg_mine")]})).id
    service.add("k", cid, AddItems.model_validate({"items": [message("second", id="msg_mine"),
                                                             message("third", id="msg_A/../x y")]}))
    items = service.items("k", cid, order="asc").data
    assert [i["content"][0]["text"] for i in items] == ["first", "second", "third"]
    assert len({i["id"] for i in items}) == 3 and items[0]["id"] == "msg_mine"
    assert all("/" not in i["id"] and " " not in i["id"] for i in items)
    for item in items:  # each can be read and deleted by its id
        assert service.item("k", cid, item["id"]) == item


def test_a_config_error_never_shows_an_mcp_servers_secrets(tmp_path):
    path = tmp_path / "secret.toml"
    path.write_text('[[mcp_servers]]\nlabel = "a"\ncommand = "x"\nurl = "http://127.0.0.1:1/mcp"\n'
                    'headers = {Authorization = "Bearer HDRSECRET-validation"}\nenv = {TOKEN = "ENVSECRET"}\n')
    with pytest.raises(ValueError) as caught:
        load_config_file(path)
    assert "HDRSECRET" not in str(caught.value) and "ENVSECRET" not in str(caught.value)
    assert "either url" in str(caught.value)


@pytest.mark.parametrize("headers", ['{"Bad Name" = "v"}', '{X-Key = "a\\r\\nInjected: 1"}'])
def test_a_configured_servers_headers_are_checked(tmp_path, headers):
    path = tmp_path / "headers.toml"
    path.write_text(f'[[mcp_servers]]\nlabel = "a"\nurl = "http://127.0.0.1:1/mcp"\nheaders = {headers}\n')
    with pytest.raises(ValueError, match="header"):
        load_config_file(path)


async def test_the_listing_asks_every_server_at_once(tmp_path):
    with hostile("hang") as a, hostile("hang") as b, hostile("hang") as c:
        path = tmp_path / "servers.toml"
        path.write_text("".join(f'[[mcp_servers]]\nlabel = "{n}"\nurl = "{s.url}"\n' for n, s in
                                (("a", a), ("b", b), ("c", c))))
        configured = Configured(load_config_file(path).mcp_servers)
        started = time.monotonic()
        listed = await configured.describe(McpLimits(connect_s=2.0, list_s=2.0))
        assert time.monotonic() - started < 5  # one bound, not three
        assert [s["status"] for s in listed] == ["unavailable"] * 3


@pytest.mark.parametrize("item", [
    {"type": "function_call_output", "call_id": "call_x", "output": "y"},  # an answer to no call
    {"type": "function_call", "call_id": "call_x", "name": "f", "arguments": "{}"},  # a call never answered
    {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
])
def test_an_item_a_response_cannot_read_is_named_where_the_client_put_it(fake_server, item):
    """A conversation took an item a response could not read, and the response's 400 named a chat field
    (messages.[0].tool_call_id) that the client never sent."""
    base = fake_server.base_url
    conversation = httpx.post(f"{base}/v1/conversations", json={"items": [item]}).json()["id"]
    answer = httpx.post(f"{base}/v1/responses", json={"model": "fake-model", "input": "hi", "conversation": conversation})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "conversation", answer.text
    direct = httpx.post(f"{base}/v1/responses", json={"model": "fake-model",
                                                         "input": [item, {"role": "user", "content": "hi"}]})
    assert direct.status_code == 400 and direct.json()["error"]["param"].startswith("input[0]"), direct.text
