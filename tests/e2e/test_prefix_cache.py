"""The prefix cache (--prefix-cache) through the client, on a server of its own: what it reuses, what it reports,
what it leaves alone."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .conftest import own_server
from .helpers import MODEL, client_for

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a terse assistant that answers about the sea. " * 6}
OTHER_SYSTEMS = [{"role": "system", "content": f"You are assistant number {k}, and you talk about rivers. " * 6}
                 for k in range(3)]


@pytest.fixture(scope="module")
def cached_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with own_server(tmp_path_factory, "--prefix-cache") as srv:
        yield client_for(srv.base_url)


def ask(client: openai.OpenAI, messages, **kw):
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_a_repeated_conversation_reads_all_but_its_last_token_from_the_cache(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name a fish that lives in the deep sea."}]
    ask(cached_client, messages)
    again = ask(cached_client, messages)
    assert cached(again) == again.usage.prompt_tokens - 1


def test_a_shared_system_prompt_is_read_once(cached_client) -> None:
    ask(cached_client, [SYSTEM, {"role": "user", "content": "What colour is the sea?"}])
    b = ask(cached_client, [SYSTEM, {"role": "user", "content": "Why is sea water salty?"}])
    assert 60 <= cached(b) < b.usage.prompt_tokens - 3, "the system prompt came from the cache, the question did not"


def test_the_next_turn_reuses_the_previous_prompt_and_its_answer(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name three kinds of whale."}]
    first = ask(cached_client, messages, max_tokens=24)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which one is the largest?"}]
    second = ask(cached_client, messages)
    assert cached(second) >= first.usage.prompt_tokens + first.usage.completion_tokens - 2, (
        "the first turn's prompt and all but the end of its answer came from the cache")
    assert cached(second) < second.usage.prompt_tokens


def test_several_system_prompts_stay_cached(cached_client) -> None:
    for system in OTHER_SYSTEMS:
        ask(cached_client, [system, {"role": "user", "content": "Hello."}], max_tokens=2)
    for system in OTHER_SYSTEMS:
        again = ask(cached_client, [system, {"role": "user", "content": "Where do rivers end?"}], max_tokens=2)
        assert cached(again) >= 60, "each of the three system prompts is still held"


def test_streamed_usage_reports_cached_tokens(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Is the sea deep?"}]
    ask(cached_client, messages)
    stream = cached_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == usage[0].prompt_tokens - 1


def test_a_seeded_request_reads_nothing_from_the_cache(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Tell me about waves."}]
    ask(cached_client, messages)
    assert cached(ask(cached_client, messages, seed=11)) == 0


def test_with_the_cache_the_model_sees_the_same_prompt(cached_client, client) -> None:
    """Reused cells hold the same prompt: the first token's distribution matches the one computed afresh up to
    llama.cpp's batch-shape rounding (its CPU kernels change with the number of rows in a pass)."""
    for question in ("Name a sea bird.", "How do tides work?", "What eats plankton?"):
        messages = [SYSTEM, {"role": "user", "content": question}]
        ask(cached_client, messages, max_tokens=1)
        hit = ask(cached_client, messages, max_tokens=1, logprobs=True, top_logprobs=5)
        fresh = ask(client, messages, max_tokens=1, logprobs=True, top_logprobs=5)
        assert cached(hit) > 60 and cached(fresh) == 0
        a, b = hit.choices[0].logprobs.content[0], fresh.choices[0].logprobs.content[0]
        top_a = {t.token: t.logprob for t in a.top_logprobs}
        top_b = {t.token: t.logprob for t in b.top_logprobs}
        assert len(top_a.keys() & top_b.keys()) >= 4, (top_a, top_b)
        assert all(abs(top_a[t] - top_b[t]) < 0.5 for t in top_a.keys() & top_b.keys()), (top_a, top_b)


def test_without_the_flag_nothing_is_cached(client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name a fish."}]
    ask(client, messages)
    assert cached(ask(client, messages)) == 0
