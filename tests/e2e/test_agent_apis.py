"""The APIs agents speak, on the real model through the official SDKs: OpenAI's Responses API (plain, streamed,
tools, text.format, stored responses), Anthropic's Messages API (plain, streamed, tools, count_tokens, errors),
/tokenize and /detokenize, and llama-server's per-request timings."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from .helpers import MODEL

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def claude(base_url):
    c = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


# -- the Responses API ------------------------------------------------------------------------------------
def test_responses_plain_answer_and_usage(client):
    r = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 16 and u.total_tokens == u.input_tokens + u.output_tokens
    assert r.status in ("completed", "incomplete")
    assert (r.status == "incomplete") == (r.incomplete_details is not None)


def test_responses_equal_the_chat_answer(client):
    # the same conversation, greedy: the Responses API is the chat engine under another shape
    r = client.responses.create(model=MODEL, input="Name a color.", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}])
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_responses_stream_follows_the_documented_event_sequence(client):
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:-1] == tail
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text and final.usage.output_tokens > 0


def test_responses_function_tool_and_its_output_continue(client):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": WEATHER}, {"type": "web_search"}]
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert "city" in json.loads(call.arguments)
    assert r.model_extra["warnings"] == ["The web_search tool is not served here; it was ignored."]
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=tools, tool_choice="required",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 C."}], max_output_tokens=16, temperature=0)
    # the stored conversation's prompt is read from the prefix cache: its whole tiles of 64 (the rest of that turn was
    # read in rows, and this longer prompt reads it in tiles: docs/exactness.md)
    assert follow.usage.input_tokens_details.cached_tokens >= (r.usage.input_tokens - 2) // 64 * 64 > 0
    named = client.responses.create(model=MODEL, input="Weather in Rome?", tools=tools[:1], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[0].type == "function_call" and named.output[0].name == "get_weather"
    none = client.responses.create(model=MODEL, input="Weather in Rome?", tools=tools[:1], tool_choice="none",
                                   max_output_tokens=8, temperature=0)
    assert [i.type for i in none.output] == ["message"]


def test_responses_streamed_function_call_events(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas and done.name == "get_weather" and "city" in json.loads(deltas)
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].arguments == deltas


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_text_format_json_schema(client, stream):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    if stream:
        with client.responses.stream(model=MODEL, input="Invent a person.", text=fmt, temperature=0) as s:
            text = s.get_final_response().output_text
    else:
        text = client.responses.create(model=MODEL, input="Invent a person.", text=fmt, temperature=0).output_text
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    obj = client.responses.create(model=MODEL, input="A JSON object about a cat.", temperature=0,
                                  text={"format": {"type": "json_object"}}, max_output_tokens=64)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_stored_responses_get_list_and_delete(client, base_url):
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say hi."}], max_output_tokens=8)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Say hi."
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, store=False)
    assert httpx.get(f"{base_url}/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi.", previous_response_id="resp_unknown")


def test_responses_bad_input_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi.", truncation="auto")
    assert e.value.body["param"] == "truncation"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}])


# -- the Messages API -----------------------------------------------------------------------------------------
def test_messages_plain_and_count_tokens(claude):
    kw = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Say hello."}]}
    m = claude.messages.create(max_tokens=16, extra_body={"temperature": 0}, **kw)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 16
    count = claude.messages.count_tokens(**kw).input_tokens
    # Anthropic's count: input_tokens are those read, cache_read_input_tokens those the prefix cache held
    assert count == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_stream_event_sequence(claude, base_url):
    body = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": "Say hello."}],
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]  # each frame is named by its type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    with claude.messages.stream(**{k: v for k, v in body.items() if k not in ("temperature", "stream")},
                                extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    text = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert final.content[0].text == text and final.usage.output_tokens == data[-2]["usage"]["output_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_tools(claude, stream):
    kw = {"model": MODEL, "max_tokens": 64, "tool_choice": {"type": "any"},
          "tools": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}],
          "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "extra_body": {"temperature": 0}}
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kw)
    use = m.content[-1]
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input.get("city"), str) and use.id.startswith("toolu_")
    # the tool's result continues the conversation
    follow = claude.messages.create(model=MODEL, max_tokens=16, tools=kw["tools"], extra_body={"temperature": 0},
                                    messages=[kw["messages"][0], {"role": "assistant", "content": m.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": use.id,
                                                                            "content": "Sunny, 21 C."}]}])
    assert follow.usage.cache_read_input_tokens > 0


def test_messages_stop_sequence(claude):
    m = claude.messages.create(model=MODEL, max_tokens=64, stop_sequences=["."], extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "Describe Paris in two sentences."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "." and "." not in m.content[0].text


def test_messages_errors_in_anthropic_shape(claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


# -- /tokenize and /detokenize ------------------------------------------------------------------------------
def test_tokenize_counts_a_chat_as_its_usage(client, base_url):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    counted = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert counted["count"] == usage.prompt_tokens == len(counted["tokens"])
    assert counted["max_model_len"] > counted["count"]


def test_tokenize_and_detokenize_round_trip(base_url):
    vllm = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                     "return_token_strs": True}).json()
    assert vllm["count"] == len(vllm["tokens"]) == len(vllm["token_strs"]) and "".join(vllm["token_strs"]) == "Hello world"
    llama = httpx.post(f"{base_url}/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert [t["id"] for t in llama["tokens"]][-len(vllm["tokens"]):] == vllm["tokens"]
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": vllm["tokens"]}).json()
    assert back["prompt"] == back["content"] == "Hello world"
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


# -- llama-server's timings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_timings_per_request(client, stream):
    kw = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}],
          "extra_body": {"timings_per_request": True}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        timings, usage = chunks[-1].model_extra["timings"], chunks[-1].usage
    else:
        r = client.chat.completions.create(**kw)
        timings, usage = r.model_extra["timings"], r.usage
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert timings["predicted_n"] == usage.completion_tokens
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0 and timings["queue_ms"] >= 0
    assert timings["prompt_per_second"] > 0
    plain = client.chat.completions.create(**{**kw, "extra_body": {}})
    assert "timings" not in (plain.model_extra or {})
