"""The Conversations API's service on the fake runner: items kept in order with ids, pages, a key's own only,
bounds that refuse (never drop what was accepted), and responses.create continuing a conversation and adding to
it. Each runs on both stores: in memory, and in the state directory's database (service/durable.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from servelm.batch.store import BatchStore
from servelm.compose import DeploymentOptions, build_deployment
from servelm.errors import InvalidParameter, NotFound
from servelm.protocol.conversations import AddItems, CreateConversation, UpdateConversation
from servelm.protocol.responses import ResponsesRequest
from servelm.runners.fake import FakeRunner
from servelm.service.chat import ChatService
from servelm.service.conversations import (
    ConversationLimits,
    ConversationsService,
    ConversationStore,
    LimitReached,
    MemoryConversations,
)
from servelm.service.durable import SqlConversations, SqlResponses
from servelm.service.registry.deployments import Deployments
from servelm.service.responses import ResponsesService
from servelm.service.store import MemoryStore

ALICE, BOB = "a" * 64, "b" * 64
Make = Callable[..., ConversationStore]


@pytest.fixture(params=["memory", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A store of either kind, with these limits."""
    opened: list[BatchStore] = []

    def build(limits: ConversationLimits = ConversationLimits()) -> ConversationStore:
        if request.param == "memory":
            return MemoryConversations(limits)
        opened.append(BatchStore(tmp_path / f"state{len(opened)}"))
        return SqlConversations(opened[-1], limits)

    yield build
    for db in opened:
        db.close()


def message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def create(service: ConversationsService, owner: str = ALICE, *items: dict[str, Any], **metadata: str) -> str:
    return service.create(owner, CreateConversation.model_validate({"items": list(items), "metadata": metadata})).id


def test_items_keep_their_order_and_ids_and_page_both_ways(make):
    service = ConversationsService(make())
    cid = create(service, ALICE, message("one"), message("two", "assistant"), topic="tests")
    assert service.get(ALICE, cid).metadata == {"topic": "tests"}
    service.add(ALICE, cid, AddItems.model_validate({"items": [message("three")]}))
    oldest = service.items(ALICE, cid, order="asc", limit=100)
    assert [i["content"][0]["text"] for i in oldest.data] == ["one", "two", "three"]
    assert [i["content"][0]["type"] for i in oldest.data] == ["input_text", "output_text", "input_text"]
    assert all(i["id"].startswith("msg_") and i["status"] == "completed" for i in oldest.data)
    newest = service.items(ALICE, cid, limit=2)  # desc by default, as OpenAI's
    assert [i["content"][0]["text"] for i in newest.data] == ["three", "two"] and newest.has_more
    rest = service.items(ALICE, cid, limit=2, after=newest.last_id)
    assert [i["content"][0]["text"] for i in rest.data] == ["one"] and not rest.has_more
    second = oldest.data[1]["id"]
    assert service.item(ALICE, cid, second)["content"][0]["text"] == "two"
    service.remove_item(ALICE, cid, second)
    assert [i["content"][0]["text"] for i in service.items(ALICE, cid, order="asc").data] == ["one", "three"]
    assert service.update(ALICE, cid, UpdateConversation(metadata={"topic": "done"})).metadata == {"topic": "done"}
    assert service.delete(ALICE, cid).deleted
    with pytest.raises(NotFound):
        service.get(ALICE, cid)


def test_another_keys_conversation_is_not_found_by_any_route(make):
    service = ConversationsService(make())
    cid = create(service, ALICE, message("secret"))
    item = service.items(ALICE, cid).data[0]["id"]
    for call in (lambda: service.get(BOB, cid), lambda: service.items(BOB, cid), lambda: service.item(BOB, cid, item),
                 lambda: service.delete(BOB, cid), lambda: service.remove_item(BOB, cid, item),
                 lambda: service.add(BOB, cid, AddItems.model_validate({"items": [message("x")]})),
                 lambda: service.update(BOB, cid, UpdateConversation(metadata={}))):
        with pytest.raises(NotFound):
            call()
    assert service.items(ALICE, cid).data[0]["content"][0]["text"] == "secret"


def test_a_bound_refuses_the_write_and_keeps_what_was_accepted(make):
    service = ConversationsService(make(ConversationLimits(max_conversations=2, max_items=3, max_bytes=2000)))
    first = create(service, ALICE, message("a"), message("b"))
    with pytest.raises(LimitReached):  # all or none: the conversation keeps its two
        service.add(ALICE, first, AddItems.model_validate({"items": [message("c"), message("d")]}))
    assert len(service.items(ALICE, first).data) == 2
    create(service)
    with pytest.raises(LimitReached) as caught:
        create(service)
    assert caught.value.status == 400 and caught.value.code == "conversation_limit_reached"
    create(service, BOB)  # another key's own bound
    with pytest.raises(LimitReached):  # bytes, per key
        service.add(ALICE, first, AddItems.model_validate({"items": [message("x" * 3000)]}))
    assert len(service.items(ALICE, first).data) == 2


@pytest.fixture(params=["memory", "sqlite"])
def responses(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponsesService]:
    deployment, engine = build_deployment("fake-model", FakeRunner(context_window=512), DeploymentOptions(prefix_cache=False))
    engine.start()
    db = BatchStore(tmp_path) if request.param == "sqlite" else None
    try:
        yield ResponsesService(ChatService(Deployments([deployment])), MemoryStore() if db is None else SqlResponses(db),
                               conversations=ConversationsService(MemoryConversations() if db is None else
                                                                  SqlConversations(db)))
    finally:
        engine.stop()
        if db is not None:
            db.close()


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "fake-model", "input": "hello", "max_output_tokens": 8, **fields})


async def test_a_response_continues_its_conversation_and_adds_its_items(responses):
    conversations = responses.conversations
    cid = create(conversations, ALICE, message("earlier"))
    from servelm.service.params import RequestContext

    ctx = RequestContext(owner=ALICE)
    response = await responses.complete(responses.prepare(request(conversation=cid), ctx))
    assert response.conversation == {"id": cid}
    kept = conversations.items(ALICE, cid, order="asc").data
    assert [i["type"] for i in kept] == ["message", "message", "message"]
    assert kept[1]["content"][0]["text"] == "hello" and kept[2]["id"] == response.output[0].id
    again = await responses.complete(responses.prepare(request(conversation={"id": cid}, input="more", store=False), ctx))
    assert len(conversations.items(ALICE, cid).data) == 5 and again.conversation == {"id": cid}
    with pytest.raises(NotFound) as caught:  # another key's conversation
        responses.prepare(request(conversation=cid), RequestContext(owner=BOB))
    assert caught.value.param == "conversation"
    with pytest.raises(InvalidParameter):
        responses.prepare(request(conversation=cid, previous_response_id=response.id), ctx)


def test_ids_given_twice_are_kept_under_ids_of_ours_and_answered_as_kept(make):
    service = ConversationsService(make())
    cid = create(service, ALICE, {**message("one"), "id": "mine"}, {**message("two"), "id": "mine"})
    ids = [i["id"] for i in service.items(ALICE, cid, order="asc").data]
    assert ids[0] == "mine" and ids[1] != "mine" and ids[1].startswith("msg_")
    added = service.add(ALICE, cid, AddItems.model_validate({"items": [{**message("three"), "id": "mine"}]}))
    assert added.data[0]["id"] not in ids and service.item(ALICE, cid, added.data[0]["id"])["content"][0]["text"] == "three"


def test_a_page_after_an_id_it_does_not_hold_is_a_400_naming_after(make):
    service = ConversationsService(make())
    cid = create(service, ALICE, message("one"))
    with pytest.raises(InvalidParameter) as caught:
        service.items(ALICE, cid, after="msg_unknown")
    assert caught.value.param == "after"
    with pytest.raises(NotFound):  # another key's conversation is not found before its cursor is read
        service.items(BOB, cid, after="msg_unknown")


def test_a_removed_items_bytes_are_the_keys_again(make):
    service = ConversationsService(make(ConversationLimits(max_bytes=600)))
    cid = create(service, ALICE, message("x" * 300))
    with pytest.raises(LimitReached):
        service.add(ALICE, cid, AddItems.model_validate({"items": [message("y" * 300)]}))
    service.remove_item(ALICE, cid, service.items(ALICE, cid).data[0]["id"])
    service.add(ALICE, cid, AddItems.model_validate({"items": [message("y" * 300)]}))
    service.delete(ALICE, cid)
    create(service, ALICE, message("z" * 300))  # a deleted conversation's bytes too
