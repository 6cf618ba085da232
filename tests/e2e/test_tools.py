"""Tool calls through the client: tool_choice none/auto/required/named, parallel_tool_calls, 32 tools,
streamed call deltas (and their seeded equality with the non-streamed answer), conversations that carry
calls and results back, a chat template that renders tools natively, constraint errors, and a busy batch
that mixes constrained and unconstrained requests.

The model never calls a function by itself when it may answer in text, so where a test needs `auto` to
choose calls it pushes the first tokens toward "<tool_call>" with logit_bias; the grammar does the rest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .conftest import own_server
from .helpers import (
    MODEL,
    RunningServer,
    achat,
    assert_valid_json,
    client_for,
    gather_watching_running,
    schema_errors,
    user,
    wait_idle,
)

pytestmark = pytest.mark.e2e


def _tool(name: str, description: str, parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    fn = {"name": name, "description": description, "parameters": parameters, **extra}
    return {"type": "function", "function": fn}


WEATHER = _tool("get_weather", "Get the weather for a city", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}, strict=True)
TIME = _tool("get_time", "Get the local time in a timezone", {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 20}},
    "required": ["tz"],
    "additionalProperties": False,
})
TOOLS = [WEATHER, TIME]
ASK = user("What is the weather in Paris?")
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}
# The tokens of "<tool_call>" ("<", "tool", "_", "call", ">"): pushed, they make `auto` open a call (seeds 0
# and 2 do on both servers here); unpushed, the model always answers in text.
TOWARD_CALLS = {"44": 8, "19324": 8, "79": 5, "4350": 5, "46": 5}
CALLING_SEEDS = (0, 2)


# -- one request, folded ---------------------------------------------------------------------------
@dataclass
class Call:
    id: str
    name: str
    arguments: str


@dataclass
class ToolOutcome:
    content: str | None  # None when the answer is only calls (a stream's is then "" or None)
    calls: list[Call]
    finish_reason: str | None
    usage: Any
    message: Any = None  # the non-streamed message, as the client returned it
    chunks: list[ChatCompletionChunk] = field(default_factory=list)

    def assistant_message(self) -> Any:
        """What a client appends to the conversation after this answer."""
        if self.message is not None:
            return self.message
        return {
            "role": "assistant",
            "content": self.content or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in self.calls],
        }


def _fold_completion(resp: ChatCompletion) -> ToolOutcome:
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    msg = choice.message
    assert msg.role == "assistant"
    calls = []
    for c in msg.tool_calls or []:
        assert c.type == "function", c
        assert isinstance(c.id, str) and c.id, c
        calls.append(Call(c.id, c.function.name, c.function.arguments))
    if calls:
        assert msg.content is None, f"content {msg.content!r} beside tool calls"
    else:
        assert msg.tool_calls is None, msg
        assert isinstance(msg.content, str)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    return ToolOutcome(msg.content, calls, choice.finish_reason, resp.usage, message=msg)


def _fold_stream(chunks: list[ChatCompletionChunk]) -> ToolOutcome:
    """Check the stream's tool-call deltas one by one: a call's first delta names it, the rest extend it."""
    assert chunks
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the stream must end with the usage chunk"
    content: str | None = None
    calls: list[Call] = []
    finish = None
    for i, chunk in enumerate(chunks[:-1]):
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id
        assert len(chunk.choices) == 1 and chunk.choices[0].index == 0, chunk
        choice = chunk.choices[0]
        assert finish is None, f"chunk {i} came after the finish_reason"
        delta = choice.delta
        assert (delta.role == "assistant") == (i == 0), f"chunk {i}: role {delta.role!r}"
        if delta.content is not None:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index == len(calls):  # a new call
                assert isinstance(d.id, str) and d.id, f"the first delta of call {d.index} has no id: {d}"
                assert d.type == "function", d
                assert d.function is not None and d.function.name, f"the first delta of call {d.index} has no name: {d}"
                assert d.function.arguments == "", f"the first delta of call {d.index} carries arguments: {d}"
                calls.append(Call(d.id, d.function.name, ""))
            else:
                assert d.index == len(calls) - 1, f"a delta for call {d.index} while call {len(calls) - 1} streams"
                assert d.id is None and d.type is None, f"a later delta repeats the call's id or type: {d}"
                assert d.function is not None and d.function.name is None, f"a later delta repeats the name: {d}"
                assert isinstance(d.function.arguments, str) and d.function.arguments, d
                calls[d.index].arguments += d.function.arguments
        finish = choice.finish_reason
    assert finish is not None, "the last choice chunk carries no finish_reason"
    if calls:
        assert not content, f"content {content!r} beside tool calls"
        content = None
    usage = chunks[-1].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return ToolOutcome(content, calls, finish, usage, chunks=chunks)


def tool_chat(client: openai.OpenAI, *, stream: bool, **kw: Any) -> ToolOutcome:
    kw.setdefault("model", MODEL)
    if not stream:
        return _fold_completion(client.chat.completions.create(**kw))
    return _fold_stream(list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)))


async def atool_chat(client: openai.AsyncOpenAI, *, stream: bool, **kw: Any) -> ToolOutcome:
    kw.setdefault("model", MODEL)
    if not stream:
        return _fold_completion(await client.chat.completions.create(**kw))
    s = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    return _fold_stream([c async for c in s])


def assert_valid_calls(out: ToolOutcome, tools: list[dict[str, Any]]) -> None:
    """The answer is only calls, it ended by itself, and every call's arguments fit its function."""
    assert out.calls, f"no tool calls; content {out.content!r}"
    assert out.finish_reason == "tool_calls", f"finish_reason {out.finish_reason!r} for {out.calls}"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in out.calls:
        assert c.name in params, f"a call to {c.name!r}, which is not among the tools"
        assert_valid_json(c.arguments, params[c.name])


# -- tool_choice and parallel_tool_calls -----------------------------------------------------------
def test_tool_choice_none_never_calls(client: openai.OpenAI, stream: bool) -> None:
    # The same push makes `auto` call (see test_tool_choice_auto); under none the answer stays text.
    for seed in CALLING_SEEDS:
        out = tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24,
                        temperature=0.8, seed=seed, logit_bias=TOWARD_CALLS)
        assert out.calls == [], out.calls
        assert isinstance(out.content, str) and out.content
        assert out.finish_reason in ("stop", "length")


def test_tool_choice_required(client: openai.OpenAI, stream: bool) -> None:
    out = tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                    temperature=0.8, seed=2)
    assert_valid_calls(out, TOOLS)
    assert len(out.calls) >= 2, "this seed calls twice when parallel calls are allowed (the next test's contrast)"
    assert len({c.id for c in out.calls}) == len(out.calls), "call ids must be distinct"


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI, stream: bool) -> None:
    out = tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=2)
    assert_valid_calls(out, TOOLS)
    assert len(out.calls) == 1, out.calls


def test_named_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    # The user asks about the weather; the named function wins anyway.
    out = tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, tool_choice=NAMED_TIME, max_tokens=80,
                    temperature=0.8, seed=2)
    assert_valid_calls(out, TOOLS)
    assert [c.name for c in out.calls] == ["get_time"]


def _auto_runs(client: openai.OpenAI, stream: bool) -> list[ToolOutcome]:
    """tool_choice auto (the default when it is left out, so the plain runs leave it out): text or valid calls."""
    kw: dict[str, Any] = {"tool_choice": "auto"} if stream else {}
    runs = [tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0.8, seed=1, **kw)]
    runs += [tool_chat(client, stream=stream, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.8, seed=seed,
                       logit_bias=TOWARD_CALLS, parallel_tool_calls=False, **kw) for seed in CALLING_SEEDS]
    for out in runs:
        if out.calls:
            assert_valid_calls(out, TOOLS)
        else:
            assert isinstance(out.content, str) and out.content
            assert not out.content.lstrip().startswith("<tool_call>"), f"an unparsed call in content: {out.content!r}"
            assert out.finish_reason in ("stop", "length")
    assert not runs[0].calls, "unpushed, the model answers this in text"
    assert any(out.calls for out in runs[1:]), [o.content for o in runs]
    return runs


def test_tool_choice_auto(client: openai.OpenAI, stream: bool) -> None:
    _auto_runs(client, stream)


# -- many tools ------------------------------------------------------------------------------------
def _param(i: int) -> dict[str, Any]:
    return [
        {"type": "integer", "minimum": i, "maximum": i + 9},
        {"type": "string", "enum": [f"a{i}", f"b{i}"]},
        {"type": "boolean"},
        {"type": "string", "maxLength": 3 + i % 5},
    ][i % 4]


MANY = [  # no descriptions: the listing alone is ~1.9k prompt tokens
    {"type": "function", "function": {"name": f"f_{i:02d}", "parameters": {
        "type": "object", "properties": {f"p{i}": _param(i)}, "required": [f"p{i}"], "additionalProperties": False}}}
    for i in range(32)
]


@pytest.mark.slow
def test_thirty_two_tools(client: openai.OpenAI, stream: bool) -> None:
    target = "f_30" if stream else "f_17"  # a 32-tool prompt is ~1.9k tokens to read: one request per mode
    out = tool_chat(client, stream=stream, messages=user("Call one of the functions."), tools=MANY,
                    tool_choice={"type": "function", "function": {"name": target}}, max_tokens=60, temperature=0)
    assert_valid_calls(out, MANY)
    assert [c.name for c in out.calls] == [target]
    i = int(target[2:])
    assert list(json.loads(out.calls[0].arguments)) == [f"p{i}"]


# -- streaming -------------------------------------------------------------------------------------
def test_streamed_calls_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.8, seed=3)
    plain = tool_chat(client, stream=False, **kw)
    streamed = tool_chat(client, stream=True, **kw)  # _fold_stream checked every delta's shape
    assert_valid_calls(plain, TOOLS)
    assert_valid_calls(streamed, TOOLS)
    assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in plain.calls]
    args_deltas = sum(1 for ch in streamed.chunks for c in ch.choices for d in c.delta.tool_calls or []
                      if d.function and d.function.arguments)
    assert args_deltas > len(streamed.calls), "the arguments should arrive in several pieces"
    assert streamed.usage.completion_tokens == plain.usage.completion_tokens


# -- conversations ---------------------------------------------------------------------------------
def _conversation(client: openai.OpenAI, stream: bool, messages: list[Any]) -> None:
    first = tool_chat(client, stream=stream, messages=messages, tools=TOOLS, tool_choice=NAMED_TIME,
                      max_tokens=80, temperature=0.8, seed=2)
    assert_valid_calls(first, TOOLS)
    call = first.calls[0]

    def answer(assistant: Any, result: str) -> ToolOutcome:
        tool_msg = {"role": "tool", "tool_call_id": call.id, "content": result}
        out = tool_chat(client, stream=stream, messages=[*messages, assistant, tool_msg], tools=TOOLS, max_tokens=1,
                        temperature=0)
        for c in out.calls:
            assert c.name in ("get_weather", "get_time")
        return out

    returned = first.assistant_message()  # the client's own message object when not streamed
    short = answer(returned, "12:00")
    assert short.usage.prompt_tokens > first.usage.prompt_tokens
    longer = answer(returned, "It is 12:00 in Paris, on a sunny Tuesday afternoon in early June.")
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens, "the tool result does not reach the prompt"
    wordier = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": json.dumps({"tz": "Europe/Paris, Central European Summer Time, France"})}}]}
    wordier_tokens = answer(wordier, "12:00").usage.prompt_tokens
    assert wordier_tokens > short.usage.prompt_tokens, "the assistant's call does not reach the prompt"


def test_conversation_with_tool_results(client: openai.OpenAI, stream: bool) -> None:
    _conversation(client, stream, ASK)


# -- errors ----------------------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
BAD_TOOLS = [
    ("parameters_of_tool_0", {"tools": [_tool("f", "bad", BAD_SCHEMA)]}, "tools[0].function.parameters"),
    ("parameters_of_tool_1", {"tools": [WEATHER, _tool("f", "bad", BAD_SCHEMA)], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ("tool_choice_unknown_function",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_function"}}}, "tool_choice"),
]


@pytest.mark.parametrize(("kwargs", "param"), [c[1:] for c in BAD_TOOLS], ids=[c[0] for c in BAD_TOOLS])
def test_bad_tools_are_400(client: openai.OpenAI, stream: bool, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        tool_chat(client, stream=stream, messages=ASK, max_tokens=4, **kwargs)
    err = info.value.response.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"], err


# -- a busy batch ----------------------------------------------------------------------------------
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0, "maximum": 50000000}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "blue", "yellow"]


async def test_constrained_and_free_requests_together(aclient: openai.AsyncOpenAI, base_url: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}

    def city(i: int) -> Any:
        return achat(aclient, stream=i % 2 == 0, messages=user(f"Describe city number {i}."), max_tokens=100,
                     temperature=0.8, seed=i, response_format=rf)

    constrained = (
        [city(i) for i in range(3)]
        + [achat(aclient, stream=i % 2 == 1, messages=user("Pick a colour."), max_tokens=10, temperature=1.0,
                 seed=i, extra_body={"guided_choice": COLOURS}) for i in range(3)]
        + [atool_chat(aclient, stream=i % 2 == 0, messages=ASK, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False, max_tokens=80, temperature=0.8, seed=i) for i in range(2)]
    )
    free = [achat(aclient, stream=i % 2 == 1, messages=user(f"Tell me fact number {i} about the sea."),
                  max_tokens=16, temperature=1.0) for i in range(8)]
    mixed = [task for pair in zip(constrained, free) for task in pair]
    results, peak = await gather_watching_running(base_url, mixed)
    assert peak > 4, f"the requests never ran together (peak {peak})"
    done, free_out = results[0::2], results[1::2]
    for out in done[:3]:
        assert out.finish_reason == "stop", out.text
        assert_valid_json(out.text, CITY)
    for out in done[3:6]:
        assert out.finish_reason == "stop" and out.text in COLOURS, out.text
    for out in done[6:]:
        assert_valid_calls(out, TOOLS)
        assert len(out.calls) == 1
    for out in free_out:
        assert out.text.strip() and out.finish_reason in ("stop", "length")
    idle, stats = await asyncio.to_thread(wait_idle, base_url, 10.0)
    assert idle, f"the server did not return to idle: {stats}"


# -- a chat template that renders tools natively ---------------------------------------------------
HERMES_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\n\n' }}
{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\nTo call a function, answer with <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}
{{- '\n' + message['content'] }}
{%- endif %}
{%- for tool_call in message['tool_calls'] or [] %}
{{- '\n<tool_call>\n{"name": ' + (tool_call['function']['name'] | tojson) + ', "arguments": ' + (tool_call['function']['arguments'] | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def native_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path: Path = tmp_path_factory.mktemp("template") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE, encoding="utf-8")
    with own_server(tmp_path_factory, "--chat-template", str(path)) as srv:
        yield srv


@pytest.fixture(scope="module")
def native(native_server: RunningServer) -> Iterator[openai.OpenAI]:
    c = client_for(native_server.base_url)
    yield c
    c.close()


def test_native_template_is_used(native: openai.OpenAI, client: openai.OpenAI) -> None:
    hi = dict(model=MODEL, messages=user("Hi"), max_tokens=1, temperature=0)
    native_tokens = native.chat.completions.create(**hi).usage.prompt_tokens
    default_tokens = client.chat.completions.create(**hi).usage.prompt_tokens
    # SmolLM2's own template adds a default system prompt; this one does not
    assert native_tokens < default_tokens


def test_native_template_tool_choices(native: openai.OpenAI, stream: bool) -> None:
    required = tool_chat(native, stream=stream, messages=ASK, tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False, max_tokens=80, temperature=0.8, seed=1)
    assert_valid_calls(required, TOOLS)
    named = tool_chat(native, stream=stream, messages=ASK, tools=TOOLS, tool_choice=NAMED_TIME, max_tokens=80,
                      temperature=0.8, seed=2)
    assert_valid_calls(named, TOOLS)
    assert [c.name for c in named.calls] == ["get_time"]
    runs = _auto_runs(native, stream)
    no_tools = tool_chat(native, stream=stream, messages=ASK, max_tokens=1, temperature=0)
    # The template frames the tools; the server adds no instructions of its own, whatever the choice.
    prompts = {o.usage.prompt_tokens for o in (required, named, *runs)}
    assert len(prompts) == 1, prompts
    assert prompts.pop() > no_tools.usage.prompt_tokens + 50, "the tools did not reach the template"


def test_native_template_conversation(native: openai.OpenAI, stream: bool) -> None:
    _conversation(native, stream, [{"role": "system", "content": "You are a terse assistant."}, *ASK])


def test_schema_errors_helper_catches_violations() -> None:
    """The hand-written validator the tests lean on rejects what it must."""
    params = WEATHER["function"]["parameters"]
    assert schema_errors({"city": "Paris", "unit": "celsius"}, params) == []
    assert schema_errors({"city": "Paris"}, params)
    assert schema_errors({"city": "Paris", "unit": "kelvin"}, params)
    assert schema_errors({"city": "x" * 21, "unit": "celsius"}, params)
    assert schema_errors({"city": "Paris", "unit": "celsius", "extra": 1}, params)
    assert schema_errors({"p0": True}, MANY[0]["function"]["parameters"])
    assert schema_errors({"p0": 10}, MANY[0]["function"]["parameters"])
    assert schema_errors([], params)
