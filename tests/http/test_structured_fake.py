"""Constrained output over HTTP on the fake runner: the grammar shapes the text, streamed and not."""

from __future__ import annotations

import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"choice": ["zzz", "yyy"]}},
    {"guided_choice": ["zzz", "yyy"]},
    {"structured_outputs": {"regex": "(zzz|yyy)"}},
    {"guided_regex": "(zzz|yyy)"},
    {"guided_grammar": 'start: "zzz" | "yyy"'},
])
def test_constraint_shapes_the_answer(client, body):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=10, temperature=0, extra_body=body)
    assert r.choices[0].message.content in ("zzz", "yyy") and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=10, temperature=0,
                                            extra_body=body, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_unconstrained_answer_is_the_fake_models_own(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, temperature=0)
    assert r.choices[0].message.content not in ("zzz", "yyy") and r.choices[0].finish_reason == "length"
