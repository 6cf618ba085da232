"""The Responses and Messages routes over the fake model: stored responses are per API key, x-api-key is a key,
Anthropic's paths answer errors in Anthropic's shape (401s included), and cache_control pins the prompt's slot."""

from __future__ import annotations

import httpx
import pytest

from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from tests.conftest import wait_engine_idle

ALICE, BOB = "sk-alice", "sk-bob"


@pytest.fixture
def keyed(fake_server_factory):
    return fake_server_factory(security=SecurityConfig(keys=[key_spec(ALICE), key_spec(BOB)]))


def post(server, path, body, key=ALICE, header="authorization"):
    value = f"Bearer {key}" if header == "authorization" else key
    return httpx.post(server.base_url + path, json=body, headers={header: value}, timeout=30)


def test_a_stored_response_is_visible_to_its_key_only(keyed):
    r = post(keyed, "/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 3}).json()
    url = f"{keyed.base_url}/v1/responses/{r['id']}"
    assert httpx.get(url, headers={"authorization": f"Bearer {ALICE}"}).json()["id"] == r["id"]
    assert httpx.get(url, headers={"authorization": f"Bearer {BOB}"}).status_code == 404
    assert httpx.get(url + "/input_items", headers={"authorization": f"Bearer {BOB}"}).status_code == 404
    assert httpx.delete(url, headers={"authorization": f"Bearer {BOB}"}).status_code == 404
    other = post(keyed, "/v1/responses", {"model": "fake-model", "input": "more", "previous_response_id": r["id"]}, BOB)
    assert other.status_code == 404 and other.json()["error"]["param"] == "previous_response_id"
    mine = post(keyed, "/v1/responses", {"model": "fake-model", "input": "more", "max_output_tokens": 3,
                                          "previous_response_id": r["id"]})
    assert mine.status_code == 200 and mine.json()["previous_response_id"] == r["id"]
    # the continuation's input items are its own; its conversation holds the first turn too
    items = httpx.get(f"{keyed.base_url}/v1/responses/{mine.json()['id']}/input_items?order=asc",
                      headers={"authorization": f"Bearer {ALICE}"}).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["more"]
    assert httpx.delete(url, headers={"authorization": f"Bearer {ALICE}"}).json() == {
        "id": r["id"], "object": "response.deleted", "deleted": True}


def test_x_api_key_and_anthropic_errors(keyed):
    body = {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    ok = post(keyed, "/v1/messages", body, ALICE, header="x-api-key")
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    denied = post(keyed, "/v1/messages", body, "sk-wrong", header="x-api-key")
    assert denied.status_code == 401
    assert denied.json() == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": denied.json()["error"]["message"]}}
    bad = post(keyed, "/v1/messages", {**body, "max_tokens": "3"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert bad.json()["type"] == "error"


def test_a_stream_error_is_a_named_error_event(fake_server):
    fake_server.runner.step = lambda plan: (_ for _ in ()).throw(RuntimeError("boom"))
    body = {"model": "fake-model", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", fake_server.base_url + "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error" and '"type": "error"' in lines[-1]
    with httpx.stream("POST", fake_server.base_url + "/v1/responses",
                      json={"model": "fake-model", "input": "hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error" and '"sequence_number": 2' in lines[-1]


def test_cache_control_pins_the_prompt(fake_server_factory):
    server = fake_server_factory(prefix_cache=True, num_slots=2)
    pinned = [{"type": "text", "text": "a long shared system prompt " * 3, "cache_control": {"type": "ephemeral"}}]
    body = {"model": "fake-model", "max_tokens": 2, "system": pinned, "messages": [{"role": "user", "content": "q"}]}
    first = httpx.post(server.base_url + "/v1/messages", json=body).json()
    assert wait_engine_idle(server.engine)
    for i in range(3):  # other prompts, more recent: without the pin they would have taken its slot
        httpx.post(server.base_url + "/v1/messages", json={**body, "system": f"other prompt number {i} " * 4})
        assert wait_engine_idle(server.engine)
    again = httpx.post(server.base_url + "/v1/messages", json=body).json()
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert again["usage"]["cache_read_input_tokens"] >= first["usage"]["input_tokens"] - 1


@pytest.mark.parametrize("field", [{"chat_template_kwargs": {"enable_thinking": False}}, {"timings_per_request": True}])
def test_chat_only_fields_are_a_400_on_completions(fake_server, field):
    r = httpx.post(fake_server.base_url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", **field})
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(field))


def test_a_bad_query_parameter_names_itself_and_shows_no_source(keyed):
    """Issue 32: ?limit=abc was a 400 whose message quoted FastAPI's traceback line and a source path, param null."""
    r = post(keyed, "/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 3}).json()
    bad = httpx.get(f"{keyed.base_url}/v1/responses/{r['id']}/input_items?limit=abc",
                    headers={"authorization": f"Bearer {ALICE}"})
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["param"] == "limit" and "limit" in err["message"]
    assert ".py" not in err["message"] and "File" not in err["message"] and "\n" not in err["message"]


@pytest.mark.parametrize("content", [
    [],  # an empty content list
    [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "hi"}],  # a thinking block without its signature
    [{"type": "redacted_thinking"}, {"type": "text", "text": "hi"}],
])
def test_messages_refuse_what_anthropic_refuses(keyed, content):
    """Issue 32: these answered 200 where Anthropic's API answers 400."""
    body = {"model": "fake-model", "max_tokens": 3, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": content}, {"role": "user", "content": "more"}]}
    r = post(keyed, "/v1/messages", body, header="x-api-key")
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_a_thinking_block_resent_as_it_came_back_is_taken(keyed):
    body = {"model": "fake-model", "max_tokens": 3, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "text", "text": "hi"}]},
        {"role": "user", "content": "more"}]}
    assert post(keyed, "/v1/messages", body, header="x-api-key").status_code == 200
