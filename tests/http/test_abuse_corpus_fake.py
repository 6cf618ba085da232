"""Issue 13's bodies, each answered as it must be now (tests/http/abuse_corpus.py), on a real HTTP server over
the fake model; and the server still serves afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.http.abuse_corpus import cases

CASES = cases("fake-model")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_body_gets_its_answer(fake_server, case):
    r = httpx.post(fake_server.base_url + case.path, content=case.body, headers=case.headers, timeout=60)
    assert r.status_code in (case.status if isinstance(case.status, tuple) else (case.status,)), r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert "panic" not in err["message"] and "backtrace" not in err["message"] and "\n" not in err["message"]
        if case.code:
            assert err["code"] == case.code, err
        if case.param:
            assert err["param"] == case.param, err
    elif "stream" in case.body.decode():
        assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")
    ok = httpx.post(fake_server.base_url + "/v1/chat/completions", timeout=30,
                    json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


# -- issue 32: cheap bodies that cost a lot before they were refused -----------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 200_000}, "messages"),  # 6.8 MB
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 2049}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ("/v1/responses", {"input": [{"role": "user", "content": "a"}] * 2049}, "input"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}] * 2049}, "messages"),
])
def test_requests_past_the_message_part_and_tool_bounds_are_400_naming_them(fake_server, path, body, param):
    r = httpx.post(fake_server.base_url + path, json={"model": "fake-model", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "at most" in r.json()["error"]["message"]


def test_anthropic_messages_past_the_bound_are_400_in_anthropics_shape(fake_server):
    r = httpx.post(fake_server.base_url + "/v1/messages", timeout=30, json={
        "model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "a"}] * 2049})
    assert r.status_code == 400 and r.json()["type"] == "error" and "at most" in r.json()["error"]["message"]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(fake_server, monkeypatch):
    """The rendered text's bytes bound its tokens from below (the longest token's bytes): 200 KB of text on a
    128-token model is refused without the tokenizer ever seeing it."""
    from servelm.runners.fake import FakeModel

    calls = []
    original = FakeModel.tokenize
    monkeypatch.setattr(FakeModel, "tokenize", lambda self, text, **kw: calls.append(len(text)) or original(self, text, **kw))
    r = httpx.post(fake_server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 200_000}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert not [n for n in calls if n > 100_000], "the long text never reached the tokenizer"
