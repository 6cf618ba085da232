"""Streaming: the chunk sequence, the usage chunk, `data: [DONE]`, and equality with the non-streamed result."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .helpers import HELLO, MODEL, NO_EOS, STORY, chat

pytestmark = pytest.mark.e2e


def test_stream_chunks_in_order(client: openai.OpenAI) -> None:
    out = chat(client, stream=True, messages=STORY, max_tokens=16, temperature=0)
    chunks = out.chunks
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    # content deltas between the role and the finish
    assert any(c.choices[0].delta.content for c in choice_chunks)
    assert choice_chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    # the usage chunk comes last, with no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert out.usage.completion_tokens == 16


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    out = chat(client, stream=True, stream_options=None, messages=HELLO, max_tokens=8, temperature=0)
    assert out.usage is None
    assert all(c.usage is None and c.choices for c in out.chunks)


def test_stream_ends_with_done(base_url: str) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines()]
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert all(line.startswith("data: ") or line == "" for line in lines), lines
    assert data[-1] == "[DONE]"
    assert data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("messages", [HELLO, STORY], ids=["hello", "story"])
def test_stream_equals_plain_greedy(client: openai.OpenAI, messages: list) -> None:
    kw = dict(messages=messages, max_tokens=32, temperature=0)
    plain = chat(client, stream=False, **kw)
    streamed = chat(client, stream=True, **kw)
    assert streamed.same_result() == plain.same_result()


def test_stream_equals_plain_seeded(client: openai.OpenAI) -> None:
    kw = dict(messages=STORY, max_tokens=32, temperature=0.9, seed=1234)
    plain = chat(client, stream=False, **kw)
    streamed = chat(client, stream=True, **kw)
    assert streamed.same_result() == plain.same_result()


def test_stream_usage_equals_plain_usage_at_length(client: openai.OpenAI) -> None:
    kw = dict(messages=HELLO, max_tokens=20, temperature=0, logit_bias=NO_EOS)
    plain = chat(client, stream=False, **kw)
    streamed = chat(client, stream=True, **kw)
    assert streamed.same_result() == plain.same_result()
    assert streamed.usage.completion_tokens == 20
