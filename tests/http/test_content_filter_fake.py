"""Content filtering over HTTP on the fake model, whose answer to "hi" is the alphabet from "b" on, a letter a
token: a prompt the policy blocks (400 content_filter, no generation), an answer stopped in the middle of a stream
and across a window's edge, annotations, every dialect's shape, a guard that is down or busy (closed: 503; open:
annotated), filtered and unfiltered requests side by side, /metrics and the access log."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servelm.service.safety.blocklist import Blocklist
from servelm.service.safety.content_filter import ContentFilter, Rule
from servelm.service.safety.guard import Guard, GuardLabel
from tests.conftest import wait_engine_idle

HI = [{"role": "user", "content": "hi"}]  # answered "bcdefghijklmnopqrstuvwxyz..."
AZURE = "/chat/completions?api-version=2024-05-01-preview"


def policy(*entries: str, **kw) -> ContentFilter:
    return ContentFilter(lists=[Blocklist(entries, "words")], **kw)


def post(server, path, body):
    return httpx.post(server.base_url + path, json=body, timeout=30)


def chat(server, messages=HI, path="/v1/chat/completions", **extra):
    return post(server, path, {"model": server.model, "messages": messages, "max_tokens": 20, "temperature": 0, **extra})


def stream_chunks(server, path="/v1/chat/completions", body=None) -> list:
    body = body or {"model": server.model, "messages": HI, "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_blocked_prompt_is_a_400_naming_its_message_and_runs_nothing(fake_server_factory):
    server = fake_server_factory(content_filter=policy("forbidden words"))
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "say FORBIDDEN   words"}]
    r = chat(server, messages)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "content_filter" and error["param"] == "messages[3].content"
    assert error["type"] == "invalid_request_error" and "words" not in error["message"].replace("words)", "")
    assert error["innererror"]["content_filter_result"]["custom_blocklists"]["filtered"] is True
    assert server.runner.steps == []  # no generation started
    # the seed's ContentFilterError on Azure's path: code, message, param and status
    r = chat(server, messages, AZURE)
    body = r.json()
    assert r.status_code == 400 and r.headers["x-ms-error-code"] == "content_filter"
    assert body["code"] == "content_filter" and body["status"] == 400 and body["error"]["status"] == 400
    assert body["error"]["param"] == "messages[3].content" and body["message"]
    # a longer word holds the term: found by default (issue 32), not by a whole-word entry
    assert chat(server, [{"role": "user", "content": "forbidden wordsmith"}]).status_code == 400
    whole = fake_server_factory(content_filter=policy("word:forbidden words"))
    assert chat(whole, [{"role": "user", "content": "forbidden wordsmith"}]).status_code == 200


def test_a_clean_answer_is_annotated_as_azure_openai_does(fake_server_factory):
    server = fake_server_factory(content_filter=policy("forbidden"))
    body = chat(server).json()
    assert body["choices"][0]["message"]["content"].startswith("bcdefg")
    assert body["choices"][0]["finish_reason"] == "length"
    clean = {"custom_blocklists": {"filtered": False, "details": [{"filtered": False, "id": "words"}]}}
    assert body["prompt_filter_results"] == [{"prompt_index": 0, "content_filter_results": clean}]
    assert body["choices"][0]["content_filter_results"] == clean
    chunks = stream_chunks(server)
    assert chunks[0]["choices"] == [] and chunks[0]["prompt_filter_results"][0]["content_filter_results"] == clean
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all(c["choices"][0]["content_filter_results"] == clean for c in content)


def test_a_server_without_a_policy_answers_as_before(fake_server):
    body = chat(fake_server).json()
    assert "prompt_filter_results" not in body and "content_filter_results" not in body["choices"][0]
    assert all("prompt_filter_results" not in c for c in stream_chunks(fake_server))


def test_an_answer_flagged_mid_stream_stops_before_its_window_is_sent(fake_server_factory):
    # windows of 4 tokens: "bcde" is released, "fghi" holds the term and is withheld
    server = fake_server_factory(content_filter=policy("re:fgh", window=4, blocked_message="[removed]"),
                                 step_delay=0.02)
    body = {"model": server.model, "messages": HI, "max_tokens": 60, "temperature": 0, "stream": True}
    chunks = stream_chunks(server, body=body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "bcde[removed]"
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "content_filter"
    assert last["content_filter_results"]["custom_blocklists"]["filtered"] is True
    # the request was aborted there: its slot is free long before 60 tokens' worth of steps
    assert wait_engine_idle(server.engine, timeout=0.6)
    whole = chat(server, max_tokens=60).json()["choices"][0]
    assert whole["finish_reason"] == "content_filter" and whole["message"]["content"] == "bcde[removed]"
    assert whole["content_filter_results"]["custom_blocklists"]["filtered"] is True


def test_a_term_split_across_a_window_edge_is_caught(fake_server_factory):
    # "defg" straddles the windows "bcde" | "fghi": the second check reads the text so far as a whole
    server = fake_server_factory(content_filter=policy("re:defg", window=4))
    chunks = stream_chunks(server)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "bcde" and "defg" not in text
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"


def test_only_prompts_or_only_answers_are_checked_as_the_policy_says(fake_server_factory):
    server = fake_server_factory(content_filter=policy("re:fgh", "hello", output=False))
    assert chat(server).json()["choices"][0]["finish_reason"] == "length"
    assert chat(server, [{"role": "user", "content": "hello"}]).status_code == 400
    server = fake_server_factory(content_filter=policy("re:fgh", "hello", input=False))
    assert chat(server).json()["choices"][0]["finish_reason"] == "content_filter"
    assert "prompt_filter_results" in chat(server, [{"role": "user", "content": "hello"}]).json()


def test_annotate_reports_without_blocking_and_off_neither(fake_server_factory):
    server = fake_server_factory(content_filter=policy("re:fgh", "hi", rules={"blocklist": Rule("annotate")}))
    body = chat(server).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["prompt_filter_results"][0]["content_filter_results"]["custom_blocklists"]["details"] == [
        {"filtered": False, "id": "words"}]
    server = fake_server_factory(content_filter=policy("re:fgh", "hi", rules={"blocklist": Rule("off")}))
    body = chat(server).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["content_filter_results"] == {}


def test_each_dialect_ends_a_flagged_answer_in_its_own_shape(fake_server_factory):
    server = fake_server_factory(content_filter=policy("re:fgh", "nope", window=4))
    model = server.model
    r = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 20, "temperature": 0})
    body = r.json()
    # the raw prompt "hi" is answered "stuvwxyzabcdefgh...": released through "abcd", "efgh" withheld
    assert body["choices"][0]["finish_reason"] == "content_filter" and body["choices"][0]["text"] == "stuvwxyzabcd"
    assert body["prompt_filter_results"][0]["prompt_index"] == 0
    assert body["choices"][0]["content_filter_results"]["custom_blocklists"]["filtered"] is True
    r = post(server, "/v1/completions", {"model": model, "prompt": ["ok", "say nope"], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    for path in ("/v3/chat/completions", AZURE):
        assert chat(server, path=path).json()["choices"][0]["finish_reason"] == "content_filter", path
    r = post(server, "/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 20, "details": True}})
    assert r.json()["generated_text"] == "stuvwxyzabcd" and r.json()["details"]["finish_reason"] == "content_filter"
    assert post(server, "/invocations", {"inputs": "nope", "parameters": {}}).status_code == 400
    r = post(server, "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 20})
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "content_filter"}
    assert post(server, "/v1/responses", {"model": model, "input": "nope"}).json()["error"]["code"] == "content_filter"
    r = post(server, "/v1/messages", {"model": model, "max_tokens": 20, "messages": HI})
    assert r.json()["stop_reason"] == "refusal" and r.json()["content"][0]["text"] == "bcde"
    r = post(server, "/v1/messages", {"model": model, "max_tokens": 20, "messages": [{"role": "user", "content": "nope"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_flagged_stream_in_the_responses_and_messages_apis(fake_server_factory):
    server = fake_server_factory(content_filter=policy("re:fgh", window=4))
    body = {"model": server.model, "input": "hi", "max_output_tokens": 20, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "content_filter"}
    body = {"model": server.model, "max_tokens": 20, "messages": HI, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "refusal"
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "bcde"


def test_one_choice_of_several_is_stopped_alone(fake_server_factory):
    server = fake_server_factory(content_filter=policy("re:mno", window=2), vocab_size=64)
    # three greedy choices, each stopped where it reaches the term (their sequences run on unseen until the last)
    body = chat(server, max_tokens=16, n=3, temperature=0).json()
    for choice in body["choices"]:
        assert "mno" not in choice["message"]["content"]
        assert choice["finish_reason"] == "content_filter"
        assert choice["content_filter_results"]["custom_blocklists"]["filtered"] is True


def test_filtered_and_unfiltered_requests_side_by_side(fake_server_factory, fake_server):
    server = fake_server_factory(content_filter=policy("re:klm", window=3), step_delay=0.005)
    lengths = [30, 8, 25, 9, 30, 7, 12, 6]  # answers of 10 tokens or more reach "klm"

    def one(max_tokens: int) -> tuple[int, str | None, str]:
        r = chat(server, max_tokens=max_tokens)
        choice = r.json()["choices"][0]
        return r.status_code, choice["finish_reason"], choice["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, lengths))
    for max_tokens, (status, finish, text) in zip(lengths, results):
        alone = chat(fake_server, max_tokens=max_tokens).json()["choices"][0]
        assert status == 200
        if "klm" in alone["message"]["content"]:
            assert finish == "content_filter" and alone["message"]["content"].startswith(text) and "klm" not in text
        else:
            assert (finish, text) == (alone["finish_reason"], alone["message"]["content"])
    assert any(f == "content_filter" for _, f, _ in results) and any(f != "content_filter" for _, f, _ in results)


def test_metrics_count_filtered_requests_and_the_log_says_so_without_content(fake_server_factory, caplog):
    server = fake_server_factory(content_filter=policy("re:fgh", "secretword", window=4))
    with caplog.at_level(logging.INFO, logger="servelm.access"):
        chat(server, [{"role": "user", "content": "my secretword"}])
        chat(server)
        time.sleep(0.2)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'servelm_content_filtered_total{category="blocklist",direction="input",model="fake-model"} 1.0' in metrics
    assert 'servelm_content_filtered_total{category="blocklist",direction="output",model="fake-model"} 1.0' in metrics
    lines = [r.getMessage() for r in caplog.records if r.name == "servelm.access"]
    assert any("filtered=input:blocklist" in line for line in lines)
    assert any("filtered=output:blocklist" in line for line in lines)
    assert not any("secretword" in line or "fgh" in line for line in lines)


# -- a guard deployment that cannot answer ----------------------------------------------------------
def guarded(fake_server_factory, fail_open: bool = False, timeout: float = 5.0, **other_runner_kw):
    guard = Guard("guard", "{{ messages[-1].content }}", (GuardLabel("S1", "Bad", "violence"),), timeout=timeout)
    server = fake_server_factory(content_filter=ContentFilter(guard=guard, fail_open=fail_open, window=4),
                                 extra_deployments=("guard",), other_runner_kw=other_runner_kw or None)
    return server


def test_a_guard_that_answers_annotates_its_categories(fake_server_factory):
    server = guarded(fake_server_factory)
    body = chat(server).json()
    assert body["prompt_filter_results"][0]["content_filter_results"] == {"violence": {"filtered": False, "severity": "safe"}}
    assert body["choices"][0]["content_filter_results"] == {"violence": {"filtered": False, "severity": "safe"}}


def test_a_busy_guard_fails_closed_with_a_503_by_default(fake_server_factory):
    server = guarded(fake_server_factory, timeout=0.3, step_delay=1.0)
    started = time.monotonic()
    r = chat(server)
    assert r.status_code == 503 and r.json()["error"]["code"] == "content_filter_unavailable"
    assert time.monotonic() - started < 5
    assert server.runner.steps == []


def test_a_guard_that_is_busy_or_down_fails_open_when_the_policy_says_so(fake_server_factory):
    server = guarded(fake_server_factory, fail_open=True, timeout=0.3, step_delay=1.0)
    body = chat(server).json()
    assert body["choices"][0]["finish_reason"] == "length"
    error = body["prompt_filter_results"][0]["content_filter_results"]["error"]
    assert error["code"] == "content_filter_unavailable" and "0.3 s" in error["message"]
    gone = Guard("gone", "{{ messages[-1].content }}", (GuardLabel("S1", "Bad", "violence"),))
    for fail_open, status in ((True, 200), (False, 503)):
        server = fake_server_factory(content_filter=ContentFilter(guard=gone, fail_open=fail_open))
        r = chat(server)
        assert r.status_code == status
        if status == 503:
            assert "not deployed" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_guard_failing_on_an_answer_ends_it_with_an_error_when_closed(fake_server_factory, stream):
    guard = Guard("guard", "{{ messages[-1].content }}", (GuardLabel("S1", "Bad", "violence"),), timeout=0.3)
    server = fake_server_factory(content_filter=ContentFilter(guard=guard, input=False, window=4),
                                 extra_deployments=("guard",), other_runner_kw={"step_delay": 1.0})
    if not stream:
        assert chat(server).status_code == 503
        return
    body = {"model": server.model, "messages": HI, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(f)["error"] for f in frames[:-1] if "error" in json.loads(f)]
    assert errors and errors[0]["code"] == "content_filter_unavailable"
    sent = "".join(c["delta"].get("content") or "" for f in frames[:-1] for c in json.loads(f).get("choices", []))
    assert sent == ""  # nothing of the unchecked window went out


def test_a_blocked_prompt_gives_its_max_tokens_charge_back(fake_server_factory):
    from servelm.http.limits import SecurityConfig

    server = fake_server_factory(content_filter=policy("nope"), security=SecurityConfig(rate_limit_tpm=70))
    assert chat(server, [{"role": "user", "content": "say nope"}], max_tokens=60).status_code == 400
    # had the 60 reserved tokens stayed charged, the key would be in debt and this a 429
    assert chat(server, max_tokens=20).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "lookup", "description": "finds forbiddenword things"}}]},
     "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": ["ok", "forbiddenword"]}}}}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "forbiddenword_tool"}}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                       "name": "f", "arguments": "{\"q\": \"forbiddenword\"}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "done"}]}, "messages[1].tool_calls[0]"),
])
def test_tool_definitions_and_earlier_calls_are_screened(fake_server_factory, body, param):
    """Issue 32: tool definitions (name, description, enum values) and an assistant's earlier calls reached the
    prompt unscreened."""
    server = fake_server_factory(content_filter=policy("forbiddenword"), context_window=4096)
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": HI, "max_tokens": 5, **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter", r.text
    assert r.json()["error"]["param"] == param


def test_the_rendered_prompt_as_a_whole_is_screened(fake_server_factory):
    """What the template itself writes is read too: a term the fake template spells around a role name."""
    server = fake_server_factory(content_filter=policy("<user>hi"))
    r = chat(server)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_an_answer_with_a_term_glued_inside_is_stopped(fake_server_factory):
    """The fake model answers "hi" with the alphabet from b: "klm" stands glued between other letters."""
    server = fake_server_factory(content_filter=policy("klm"))
    r = chat(server)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "content_filter"
