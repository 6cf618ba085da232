"""The HTTP layer over the fake runner: a real uvicorn server, the official openai client, and httpx."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from servelm.runners.fake import FakeRunner

MSG = [{"role": "user", "content": "hi"}]


def letters(tokens):
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def expected_tokens(runner: FakeRunner, prompt_text: str, n: int) -> list[int]:
    last = runner.model.tokenize(prompt_text, add_special=True, parse_special=True)[-1]
    out = []
    for _ in range(n):
        last = runner.next_token(last)
        out.append(last)
    return out


@pytest.fixture
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="none", max_retries=0)


def test_non_streamed_completion_has_the_contract_fields(fake_server, client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, temperature=0)
    prompt = "<user>hi<assistant>"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "fake-model"
    assert r.system_fingerprint and r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == letters(expected_tokens(fake_server.runner, prompt, 5))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 5, len(prompt) + 5)


def test_stream_sends_role_then_content_then_finish_then_usage(client):
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    full = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=4, temperature=0)
    assert content == full.choices[0].message.content


def test_raw_stream_ends_with_done(fake_server):
    with httpx.stream("POST", fake_server.base_url + "/v1/chat/completions",
                      json={"model": "fake-model", "messages": MSG, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_string_never_leaks_into_a_stream(fake_server, client):
    text = letters(expected_tokens(fake_server.runner, "<user>hi<assistant>", 8))
    stop = text[3:5]
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=8, temperature=0, stream=True, stop=[stop, "zzz"]
    ))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text[:3]
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0]
    assert final.finish_reason == "stop" and final.model_extra["stop_reason"] == stop


def test_n_choices_streamed_and_not(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, n=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, n=3, stream=True))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]


def test_models_and_health(fake_server, client):
    assert [m.id for m in client.models.list()] == ["fake-model"]
    h = httpx.get(fake_server.base_url + "/health").json()
    assert h["status"] == "ok" and h["deployments"]["fake-model"]["kv_cells_used"] == 0


BAD = [
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 99}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0]"),
    ({"foo": 1}, "foo"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 99}, "best_of"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"use_beam_search": True, "best_of": 2, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "best_of": 3, "num_beam_groups": 2}, "num_beam_groups"),
    ({"use_beam_search": True, "best_of": 2, "diversity_penalty": 1.0, "num_beam_groups": 1}, "diversity_penalty"),
    ({"use_beam_search": True, "best_of": 2, "response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0]"),
    ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"priority": "high"}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "and?"}]}, "messages.[0].role"),
]

# They describe the request to the platform, or ask for the defaults: accepted, and the answer is the same.
ANNOTATIONS = {"store": True, "metadata": {"team": "a", "run": "7"}, "service_tier": "auto", "user": "u-1",
               "prompt_cache_key": "user-7", "safety_identifier": "hash-1", "verbosity": "medium",
               "modalities": ["text"], "reasoning_effort": "low"}


def test_annotations_are_accepted_and_change_nothing(fake_server, client):
    plain = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, temperature=0)
    annotated = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, temperature=0,
                                               **{k: v for k, v in ANNOTATIONS.items() if k != "prompt_cache_key"},
                                               extra_body={"prompt_cache_key": ANNOTATIONS["prompt_cache_key"]})
    assert annotated.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_parameters_are_400_naming_the_parameter(fake_server, extra, param):
    body = {"model": "fake-model", "messages": MSG, **extra}
    r = httpx.post(fake_server.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_priority_is_taken_by_every_generating_api(fake_server):
    url = fake_server.base_url
    chat = {"model": "fake-model", "messages": MSG, "max_tokens": 3, "temperature": 0}
    plain = httpx.post(url + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    for priority in (-5, 0, 7):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "priority": priority})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2, "priority": 3})
    assert r.status_code == 200
    r = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": "hi", "max_output_tokens": 2,
                                               "priority": 3})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/messages", json={"model": "fake-model", "max_tokens": 2, "priority": 3,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/messages", json={"model": "fake-model", "max_tokens": 2, "priority": "x",
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "priority" in r.text


def test_a_deployment_may_bound_the_priority_a_request_asks_for(fake_server_factory):
    url = fake_server_factory(min_priority=0).base_url
    chat = {"model": "fake-model", "messages": MSG, "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "priority": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "priority": 0}).status_code == 200


def test_malformed_json_and_non_object_bodies(fake_server):
    url = fake_server.base_url + "/v1/chat/completions"
    for body in (b"{bad", b"[1,2]", b"", b"null"):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_and_unknown_route_are_404_envelopes(fake_server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSG)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(fake_server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_context_length_exceeded(fake_server, client):
    window = fake_server.runner.context_window
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=window)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x" * window}])
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens == 2, "the server is fine afterwards"


def test_absent_max_tokens_runs_to_the_context_window(fake_server, client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0,
                                       logit_bias={"0": -100})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == fake_server.runner.context_window


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(fake_server_factory):
    server = fake_server_factory(step_delay=0.02, context_window=400)
    body = {"model": "fake-model", "messages": MSG, "max_tokens": 300, "stream": True, "logit_bias": {"0": -100}}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 5:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = httpx.get(server.base_url + "/health").json()["deployments"]["fake-model"]
        if h["running"] == 0 and h["kv_cells_used"] == 0 and server.runner.cells_in_use() == 0:
            break
        time.sleep(0.05)
    assert h["running"] == 0 and h["kv_cells_used"] == 0 and server.runner.cells_in_use() == 0
    steps_then = len(server.runner.steps)
    time.sleep(0.2)
    assert len(server.runner.steps) == steps_then, "no more steps run for the departed client"


def test_a_non_streamed_client_that_gives_up_frees_its_sequence(fake_server_factory):
    server = fake_server_factory(step_delay=0.02, context_window=400)
    body = {"model": "fake-model", "messages": MSG, "max_tokens": 300, "logit_bias": {"0": -100}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.engine.stats().running:
        time.sleep(0.05)
    assert server.engine.stats().running == 0 and server.runner.cells_in_use() == 0


def test_error_envelope_mid_stream_is_json(fake_server):
    # an engine failure after the stream started travels as an error event, then [DONE]
    runner = fake_server.runner
    runner.step = lambda plan: (_ for _ in ()).throw(RuntimeError("boom"))
    with httpx.stream("POST", fake_server.base_url + "/v1/chat/completions",
                      json={"model": "fake-model", "messages": MSG, "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "error" in events[-1] and lines[-1] == "data: [DONE]"
