"""The translation services on the fake runner, without HTTP: OpenAI's Responses and Anthropic's Messages over the
chat service (their event order, what they keep, whose it is), and the platform dialects' request rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.errors import InvalidParameter, NotFound
from servelm.protocol.anthropic import CountTokensRequest, MessagesRequest
from servelm.protocol.responses import ResponsesRequest
from servelm.runners.fake import FakeRunner
from servelm.service import dialects
from servelm.service.anthropic import MessagesService
from servelm.service.chat import ChatService
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import Deployments
from servelm.service.responses import ResponsesService
from servelm.service.store import MemoryStore

ALICE, BOB = RequestContext(owner="a" * 64), RequestContext(owner="b" * 64)


@pytest.fixture
def chat() -> Iterator[ChatService]:
    deployment, engine = build_deployment("fake-model", FakeRunner(context_window=256), DeploymentOptions(prefix_cache=False))
    engine.start()
    try:
        yield ChatService(Deployments([deployment]))
    finally:
        engine.stop()


def responses_request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "fake-model", "input": "hello there", "max_output_tokens": 12,
                                            "temperature": 1.0, **fields})


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


# -- Responses ---------------------------------------------------------------------------------------------------

async def test_a_streamed_response_is_the_whole_one_event_by_event(chat):
    service = ResponsesService(chat, MemoryStore())
    whole = (await service.complete(service.prepare(responses_request(seed=5), ALICE))).model_dump(mode="json")
    events = [e.model_dump(mode="json", exclude_none=True)
              async for e in service.stream(service.prepare(responses_request(seed=5, stream=True), ALICE))]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole['status']}" == "response.incomplete"  # cut by max_output_tokens
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.output_text.delta") < kinds.index("response.output_text.done") \
        < kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    last = events[-1]["response"]
    assert deltas == output_text(last) == output_text(whole) != ""
    assert last["incomplete_details"] == whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 12


async def test_a_stored_response_is_its_owners_and_carries_the_conversation_on(chat):
    store = MemoryStore()
    service = ResponsesService(chat, store)
    first = await service.complete(service.prepare(responses_request(input="first question"), ALICE))
    assert service.stored(ALICE.owner, first.id).response == first.model_dump(mode="json")
    with pytest.raises(NotFound):
        service.stored(BOB.owner, first.id)  # another key never reads it, nor learns that it exists
    with pytest.raises(NotFound):
        service.prepare(responses_request(previous_response_id=first.id), BOB)
    follow = service.prepare(responses_request(input="second question", previous_response_id=first.id), ALICE)
    fresh = service.prepare(responses_request(input="second question"), ALICE)
    history = str([item.get("content") for item in follow.history])
    assert "first question" in history and output_text(first.model_dump(mode="json")) in history
    assert len(follow.chat.generation.prompt_token_ids) > len(fresh.chat.generation.prompt_token_ids)
    unstored = await service.complete(service.prepare(responses_request(store=False), ALICE))
    with pytest.raises(NotFound):
        service.stored(ALICE.owner, unstored.id)
    service.delete(ALICE.owner, first.id)
    with pytest.raises(NotFound):
        service.stored(ALICE.owner, first.id)


# -- Messages ----------------------------------------------------------------------------------------------------

def messages_request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "fake-model", "max_tokens": 10, "temperature": 1.0, "seed": 9,
                                           "messages": [{"role": "user", "content": "hello"}], **fields})


async def test_a_streamed_message_follows_anthropics_event_order_and_says_the_whole_message(chat):
    service = MessagesService(chat)
    whole = (await service.complete(service.prepare(messages_request(), ALICE))).model_dump(mode="json")
    events = [e.model_dump(mode="json", exclude_none=True)
              async for e in service.stream(service.prepare(messages_request(stream=True), ALICE))]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"] != ""
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 10
    assert events[0]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_count_tokens_is_what_the_request_reads(chat):
    service = MessagesService(chat)
    body = {"model": "fake-model", "system": "be brief", "messages": [{"role": "user", "content": "hello"}]}
    counted = service.count_tokens(CountTokensRequest.model_validate(body), ALICE).input_tokens
    prepared = service.prepare(MessagesRequest.model_validate({**body, "max_tokens": 4}), ALICE)
    assert counted == len(prepared.chat.generation.prompt_token_ids) > 0


# -- the dialects' rules -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["2024-05-01-preview", "2024-10-21", "2000-02-29"])
def test_an_api_version_is_a_real_date(value):
    assert dialects.check_api_version(value) == value


@pytest.mark.parametrize("value", [None, "", "2024-02-30", "2023-02-29", "2024-5-01", "2024-05-01-beta", "latest"])
def test_an_api_version_that_is_no_date_is_a_400_naming_it(value):
    with pytest.raises(InvalidParameter) as err:
        dialects.check_api_version(value)
    assert err.value.param == "api-version"


def test_extra_parameters_error_names_every_one_ignore_drops_them_pass_through_keeps_them():
    body = {"messages": [], "temperature": 0.5, "top_k": 3, "min_p": 0.1}
    with pytest.raises(dialects.ExtraParametersRejected) as err:
        dialects.azure_chat_body(body, "error")
    assert err.value.names == ["top_k", "min_p"] and err.value.status == 422
    for mode in ("ignore", None):
        kept, dropped = dialects.azure_chat_body(body, mode)
        assert kept == {"messages": [], "temperature": 0.5} and dropped == ["top_k", "min_p"]
    assert dialects.azure_chat_body(body, "pass-through") == (body, [])
    assert dialects.azure_chat_body({"messages": []}, "error") == ({"messages": []}, [])
    with pytest.raises(InvalidParameter) as bad:
        dialects.azure_chat_body(body, "discard")
    assert bad.value.param == "extra-parameters"


def test_embeddings_take_azures_input_types_and_no_other():
    kept, dropped = dialects.azure_embeddings_body({"input": "x", "input_type": "query", "user": "u"}, None)
    assert kept == {"input": "x"} and dropped == ["user"]
    with pytest.raises(InvalidParameter):
        dialects.azure_embeddings_body({"input": "x", "input_type": "passage"}, None)


def test_a_sagemaker_target_names_the_model_without_its_archive_suffix():
    assert dialects.sagemaker_target("chat.tar.gz") == "chat"
    assert dialects.sagemaker_target("chat") == "chat"
    assert dialects.sagemaker_target(None) is None and dialects.sagemaker_target("") is None


def test_ovms_fills_in_its_own_defaults_only_where_the_body_leaves_them_out():
    assert dialects.ovms_body({"model": "m"}) == {"model": "m", "temperature": 0.0, "seed": 0}
    assert dialects.ovms_body({"temperature": 0.7, "seed": None}) == {"temperature": 0.7, "seed": 0}


@pytest.mark.parametrize(("body", "kind"), [({"messages": []}, "chat"), ({"prompt": "x"}, "completion"),
                                            ({"inputs": "x"}, "native")])
def test_an_invocation_is_known_by_its_fields(body, kind):
    assert dialects.invocation_kind(body) == kind


def test_an_invocation_with_none_of_them_is_a_400():
    with pytest.raises(InvalidParameter):
        dialects.invocation_kind({"text": "x"})
