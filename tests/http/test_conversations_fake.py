"""/v1/conversations through the `openai` SDK on the fake runner: every route, its shapes (OpenAI's spec), the
`conversation` parameter of responses.create, a key's own conversations only, and bad input as a 4xx."""

from __future__ import annotations

import httpx
import openai
import pytest

from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from tests.openai_spec import assert_conforms


@pytest.fixture
def keyed(fake_server_factory):
    return fake_server_factory(security=SecurityConfig(keys=[key_spec("sk-alice"), key_spec("sk-bob")]),
                               context_window=512)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_every_route_in_openais_shapes(keyed):
    with client(keyed, "sk-alice") as alice:
        made = alice.conversations.create(metadata={"topic": "tests"},
                                          items=[{"type": "message", "role": "user", "content": "one"}])
        raw = httpx.get(f"{keyed.base_url}/v1/conversations/{made.id}", headers={"authorization": "Bearer sk-alice"})
        assert_conforms("ConversationResource", raw.json())
        assert alice.conversations.retrieve(made.id).metadata == {"topic": "tests"}
        assert alice.conversations.update(made.id, metadata={"topic": "more"}).metadata == {"topic": "more"}
        added = alice.conversations.items.create(made.id, items=[
            {"type": "message", "role": "assistant", "content": "two"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}]}])
        assert [i.type for i in added.data] == ["message", "message"]
        page = alice.conversations.items.list(made.id, order="asc", limit=2)
        raw = httpx.get(f"{keyed.base_url}/v1/conversations/{made.id}/items", headers={"authorization": "Bearer sk-alice"})
        assert_conforms("ConversationItemList", raw.json())
        texts = [i.content[0].text for i in page.data]
        assert texts == ["one", "two"] and page.has_more
        everything = [i.content[0].text for i in alice.conversations.items.list(made.id, order="asc")]
        assert everything == ["one", "two", "three"]  # the SDK's paging follows `after` to the end
        second = page.data[1].id
        assert alice.conversations.items.retrieve(second, conversation_id=made.id).content[0].text == "two"
        assert alice.conversations.items.delete(second, conversation_id=made.id).id == made.id
        assert [i.content[0].text for i in alice.conversations.items.list(made.id, order="asc")] == ["one", "three"]
        gone = httpx.delete(f"{keyed.base_url}/v1/conversations/{made.id}", headers={"authorization": "Bearer sk-alice"})
        assert_conforms("DeletedConversationResource", gone.json())
        with pytest.raises(openai.NotFoundError):
            alice.conversations.retrieve(made.id)


def test_a_response_continues_a_conversation_and_adds_to_it(keyed):
    with client(keyed, "sk-alice") as alice:
        made = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "earlier"}])
        response = alice.responses.create(model="fake-model", input="now", max_output_tokens=4,
                                          conversation=made.id)
        assert response.conversation is not None and response.conversation.id == made.id
        kinds = [(i.type, getattr(i, "role", None)) for i in alice.conversations.items.list(made.id, order="asc")]
        assert kinds == [("message", "user"), ("message", "user"), ("message", "assistant")]
        with pytest.raises(openai.BadRequestError):
            alice.responses.create(model="fake-model", input="x", conversation=made.id,
                                   previous_response_id=response.id)


def test_another_keys_conversation_is_not_found(keyed):
    with client(keyed, "sk-alice") as alice, client(keyed, "sk-bob") as bob:
        made = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "private"}])
        item = alice.conversations.items.list(made.id).data[0].id
        for call in (lambda: bob.conversations.retrieve(made.id), lambda: bob.conversations.delete(made.id),
                     lambda: bob.conversations.items.list(made.id), lambda: bob.conversations.update(made.id, metadata={}),
                     lambda: bob.conversations.items.retrieve(item, conversation_id=made.id),
                     lambda: bob.conversations.items.delete(item, conversation_id=made.id),
                     lambda: bob.responses.create(model="fake-model", input="x", conversation=made.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert alice.conversations.items.list(made.id).data[0].id == item


@pytest.mark.parametrize("path, body, param", [
    ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
    ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/conversations", {"items": [{"type": "nonsense"}]}, "items[0]"),
    ("/v1/conversations", {"surprise": 1}, "surprise"),
])
def test_bad_input_is_a_400_naming_its_field(keyed, path, body, param):
    r = httpx.post(keyed.base_url + path, json=body, headers={"authorization": "Bearer sk-alice"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_a_page_out_of_bounds_is_a_400(keyed):
    with client(keyed, "sk-alice") as alice:
        made = alice.conversations.create()
        for query in ("limit=0", "limit=101", "order=sideways"):
            r = httpx.get(f"{keyed.base_url}/v1/conversations/{made.id}/items?{query}",
                          headers={"authorization": "Bearer sk-alice"}, timeout=10)
            assert r.status_code == 400, (query, r.text)


def test_health_says_that_a_restart_loses_them(fake_server):
    kept = httpx.get(fake_server.base_url + "/health", timeout=10).json()["kept"]
    assert kept == {"responses": "memory", "conversations": "memory", "survives_restart": False}
