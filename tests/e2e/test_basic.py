"""The basic contract: the response's shape, exact usage, content forms, conversations, /v1/models."""

from __future__ import annotations

import openai
import pytest

from .helpers import HELLO, MODEL, NO_EOS, chat, user

pytestmark = pytest.mark.e2e


def test_completion_shape(client: openai.OpenAI, stream: bool) -> None:
    # chat() checks id, object, created, model, system_fingerprint, choices, role and usage
    out = chat(client, stream=stream, messages=HELLO, max_tokens=16, temperature=0)
    assert out.text.strip(), "the model wrote nothing"
    assert out.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 16
    if out.finish_reason == "length":
        assert out.usage.completion_tokens == 16


def test_stream_has_content_deltas(client: openai.OpenAI) -> None:
    out = chat(client, stream=True, messages=HELLO, max_tokens=16, temperature=0)
    contents = [c.choices[0].delta.content for c in out.chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) >= 2, "a 16-token answer should arrive in several content deltas"


def test_length_means_completion_tokens_equal_max_tokens(client: openai.OpenAI, stream: bool) -> None:
    out = chat(client, stream=stream, messages=HELLO, max_tokens=12, temperature=0, logit_bias=NO_EOS)
    assert out.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_tokens_count_generated_tokens(client: openai.OpenAI, stream: bool) -> None:
    # +100 on one token makes every generated token that token: its text, repeated, is the whole answer
    one = chat(client, stream=stream, messages=HELLO, max_tokens=1, logit_bias={"28": 100})
    assert one.usage.completion_tokens == 1 and one.text
    out = chat(client, stream=stream, messages=HELLO, max_tokens=7, logit_bias={"28": 100})
    assert out.text == one.text * 7
    assert out.usage.completion_tokens == 7
    assert out.finish_reason == "length"


def test_natural_stop_counts(client: openai.OpenAI, stream: bool) -> None:
    out = chat(client, stream=stream, messages=HELLO, max_tokens=200, temperature=0)
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # ended by the model's EOS, not by a stop string or stop token id
    assert 0 < out.usage.completion_tokens < 200
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_prompt_tokens_stable_and_growing(client: openai.OpenAI, stream: bool) -> None:
    def prompt_tokens(messages: list[dict]) -> int:
        return chat(client, stream=stream, messages=messages, max_tokens=1, temperature=0).usage.prompt_tokens

    base = prompt_tokens(user("Hello"))
    assert prompt_tokens(user("Hello")) == base
    assert prompt_tokens(user("Hello, how are you doing on this fine sunny day?")) > base
    assert prompt_tokens([*user("Hello"), {"role": "assistant", "content": "Hi!"}, *user("Hello")]) > base


def test_content_as_text_parts(client: openai.OpenAI, stream: bool) -> None:
    as_string = chat(client, stream=stream, messages=HELLO, max_tokens=12, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"]}]}]
    as_parts = chat(client, stream=stream, messages=parts, max_tokens=12, temperature=0)
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    assert as_parts.text == as_string.text

    two = [{"role": "user", "content": [{"type": "text", "text": "Hi there!"}, {"type": "text", "text": "Who are you?"}]}]
    out = chat(client, stream=stream, messages=two, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > as_string.usage.prompt_tokens


def test_multi_turn_conversation(client: openai.OpenAI, stream: bool) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    out = chat(client, stream=stream, messages=messages, max_tokens=16, temperature=0)
    assert out.text.strip()
    last_only = chat(client, stream=stream, messages=messages[-1:], max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens > last_only.usage.prompt_tokens


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids
    assert client.models.retrieve(MODEL).id == MODEL
