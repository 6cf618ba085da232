"""One client can never hurt another (issue 13), on the real model through the official client: a request that
fails inside the engine fails alone, seeds are any 64-bit integer, role markers in content stay text, grammars
that once failed silently work or are refused, cached prompts are per key, and the queue is reserved at admission.
The bodies of the probe itself run in tests/http/test_abuse_corpus_fake.py; here the real model answers."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from .conftest import own_server
from .helpers import MODEL, NO_EOS, STORY, client_for, user

pytestmark = pytest.mark.e2e


async def test_a_beam_search_with_a_wild_length_penalty_is_refused_while_its_neighbours_stream(aclient) -> None:
    async def neighbour() -> str:
        text = ""
        stream = await aclient.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, temperature=0,
                                                       logit_bias=NO_EOS, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text

    async def wild() -> BaseException | None:
        await asyncio.sleep(0.2)
        try:
            await aclient.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                                  extra_body={"use_beam_search": True, "best_of": 2,
                                                              "length_penalty": 1000})
        except openai.BadRequestError as exc:
            return exc
        return None

    texts_and_error = await asyncio.gather(neighbour(), neighbour(), wild())
    *texts, error = texts_and_error
    assert isinstance(error, openai.BadRequestError) and error.body["param"] == "length_penalty"
    assert all(len(t) > 20 for t in texts), "the neighbours finished their answers"


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_any_64_bit_seed_is_repeatable(client: openai.OpenAI, seed: int) -> None:
    first = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=12, seed=seed)
    again = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=12, seed=seed)
    assert first.choices[0].message.content == again.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=12, seed=seed, stream=True) if c.choices)
    assert streamed == first.choices[0].message.content


def test_a_seed_past_64_bits_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, seed=2**64)
    assert info.value.body["param"] == "seed"


def test_role_markers_in_a_message_are_read_as_text(client: openai.OpenAI) -> None:
    """SmolLM2 writes `<|im_start|>` as one control token; spelled in a message it is several text tokens."""
    plain = client.chat.completions.create(model=MODEL, messages=user("hi xx"), max_tokens=1)
    forged = client.chat.completions.create(model=MODEL, messages=user("hi<|im_start|>"), max_tokens=1)
    assert forged.usage.prompt_tokens >= plain.usage.prompt_tokens + 3


def test_thousands_of_choices_answer_with_one_of_them(client: openai.OpenAI) -> None:
    """4,000 options used to compile and then end every answer empty (past llguidance's 2,000 items a row)."""
    options = [f"option-{i}" for i in range(4000)]
    r = client.chat.completions.create(model=MODEL, messages=user("Pick one."), max_tokens=16, temperature=0,
                                       extra_body={"guided_choice": options})
    assert r.choices[0].message.content in options and r.choices[0].finish_reason == "stop"


def test_a_grammar_too_complex_to_follow_is_a_400(client: openai.OpenAI) -> None:
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(20000))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=4,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert info.value.body["code"] == "grammar_too_complex" and "\n" not in info.value.body["message"]


def test_cached_prompts_are_per_key(tmp_path_factory) -> None:
    with own_server(tmp_path_factory, "--prefix-cache", "--api-key", "sk-one", "--api-key", "sk-two",
                    "--no-embedding-model", "--chat-embedding-window", "0") as srv:
        messages = [{"role": "system", "content": "You answer questions about lighthouses. " * 8}, *user("Why?")]

        def cached(key: str) -> int:
            with client_for(srv.base_url, key) as client:
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("sk-one") == 0
        assert cached("sk-two") == 0, "the second key reads nothing the first key wrote"
        assert cached("sk-one") > 50 and cached("sk-two") > 50


def test_simultaneous_streams_are_admitted_within_the_queue_bound(tmp_path_factory) -> None:
    with own_server(tmp_path_factory, "--max-waiting", "4", "--max-waiting-per-key", "0", "--max-num-seqs", "2",
                    "--no-embedding-model", "--chat-embedding-window", "0") as srv:
        body = {"model": MODEL, "messages": STORY, "max_tokens": 16, "logit_bias": NO_EOS, "stream": True}
        statuses: list[int] = []
        lock = threading.Lock()

        def one() -> None:
            with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
                r.read()
                with lock:
                    statuses.append(r.status_code)

        threads = [threading.Thread(target=one) for _ in range(30)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(statuses) == 30 and set(statuses) <= {200, 429}
        assert statuses.count(429) >= 10, f"2 running and 4 waiting at a time: most of 30 at once are refused: {statuses}"
