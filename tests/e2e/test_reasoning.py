"""Reasoning on the real model: a template of our own opens `<think>` in the generation prompt, so whatever the
model writes first is its thought until it writes `</think>` or the budget closes it. The thought is answered as
reasoning_content and reasoning (streamed as deltas), as Responses reasoning items and as Anthropic thinking
blocks; the budget is exact."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from .conftest import own_server
from .helpers import MODEL

pytestmark = pytest.mark.e2e

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "think-template.jinja"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    with own_server(tmp_path_factory, "--chat-template", str(TEMPLATE), "--max-num-seqs", "4",
                    "--no-embedding-model") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(thinker):
    c = openai.OpenAI(base_url=f"{thinker.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def tokens(base_url: str, text: str) -> int:
    return httpx.post(f"{base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]


@pytest.mark.parametrize("budget", [1, 6])
def test_the_budget_closes_the_thought_exactly(oai, thinker, budget):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0,
                                    extra_body={"thinking_budget": budget})
    msg = r.choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert thought == msg.model_extra["reasoning"]  # both names
    assert r.usage.completion_tokens_details.reasoning_tokens == budget
    assert tokens(thinker.base_url, thought) == budget  # the thought is exactly the budget's tokens
    assert "</think>" not in (msg.content or "") and "<think>" not in thought


def test_a_thought_streams_as_reasoning_deltas(oai):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "extra_body": {"thinking_budget": 8}}
    whole = oai.chat.completions.create(**kw).choices[0].message
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert thought == whole.model_extra["reasoning_content"] and content == (whole.content or "")


def test_reasoning_effort_none_switches_thinking_off(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0, reasoning_effort="none")
    assert "reasoning_content" not in r.choices[0].message.model_extra  # the template closed the thought at once
    assert r.usage.completion_tokens_details.reasoning_tokens == 0 and r.choices[0].message.content


def test_responses_reasoning_item(oai):
    r = oai.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=40, temperature=0,
                             extra_body={"thinking_budget": 5})
    kinds = [i.type for i in r.output]
    assert kinds[0] == "reasoning" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == 5
    events = list(oai.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=40, temperature=0,
                                       extra_body={"thinking_budget": 5}, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == r.output[0].content[0].text


def test_anthropic_thinking_block(thinker):
    claude = anthropic.Anthropic(base_url=thinker.base_url, api_key="none", max_retries=0)
    m = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0},
                               thinking={"type": "enabled", "budget_tokens": 4})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert tokens(thinker.base_url, m.content[0].thinking) == 4
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0},
                                thinking={"type": "enabled", "budget_tokens": 4}) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].thinking == m.content[0].thinking
