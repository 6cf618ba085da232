"""The prefix cache (on by default) through the client, on a server of its own: what it reuses, what it reports,
and that a hit answers exactly as a miss does."""

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
    # tiles on whatever a tile's pass takes here (auto turns them off where it is over half the inter-token target):
    # the whole tiles' reuse is what this module checks
    with own_server(tmp_path_factory, "--prompt-tiles", "on") as srv:
        yield client_for(srv.base_url)


@pytest.fixture(scope="module")
def uncached_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with own_server(tmp_path_factory, "--no-prefix-cache", "--no-embedding-model", "--chat-embedding-window",
                    "0", "--prompt-tiles", "on") as srv:  # as the cached one's: a prompt read in tiles or not differs
        yield client_for(srv.base_url)


def ask(client: openai.OpenAI, messages, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


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


def test_the_next_turn_reuses_the_previous_prompts_whole_tiles(cached_client) -> None:
    """A prompt's whole tiles of 64 are read on flash attention's tiled kernel, the rest of it and the answer in rows
    (docs/exactness.md): a next turn whose own tiles reach past the first's reuses those, and reads the rest (the
    first prompt's tail and answer) again in tiles; the same conversation again reuses all of it."""
    messages = [SYSTEM, {"role": "user", "content": "Name three kinds of whale."}]
    first = ask(cached_client, messages, max_tokens=24)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which one is the largest?"}]
    second = ask(cached_client, messages)
    tiles = (first.usage.prompt_tokens - 2) // 64 * 64  # never a prompt's last two tokens
    assert tiles and (second.usage.prompt_tokens - 2) // 64 * 64 > tiles
    assert cached(second) == tiles, "the first turn's whole tiles came from the cache"
    again = ask(cached_client, messages)
    assert cached(again) == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == second.choices[0].message.content


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


def test_a_seeded_request_reads_the_cache_and_samples_the_same_text(cached_client, uncached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Tell me about waves."}]
    ask(cached_client, messages)
    hit = ask(cached_client, messages, seed=11, temperature=1.0, max_tokens=24)
    miss = ask(uncached_client, messages, seed=11, temperature=1.0, max_tokens=24)
    assert cached(hit) > 60 and cached(miss) == 0
    assert hit.choices[0].message.content == miss.choices[0].message.content


def test_a_cache_hit_answers_exactly_as_a_miss(cached_client, uncached_client) -> None:
    """Reused cells are bitwise the cells a fresh read computes (docs/exactness.md): the whole answer's logprobs
    are equal, not close."""
    for question in ("Name a sea bird.", "How do tides work?", "What eats plankton?"):
        messages = [SYSTEM, {"role": "user", "content": question}]
        ask(cached_client, messages, max_tokens=1)
        hit = ask(cached_client, messages, max_tokens=16, logprobs=True, top_logprobs=5)
        fresh = ask(uncached_client, messages, max_tokens=16, logprobs=True, top_logprobs=5)
        assert cached(hit) > 60 and cached(fresh) == 0
        assert hit.choices[0].message.content == fresh.choices[0].message.content
        tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in hit.choices[0].logprobs.content]
        assert tops == [[(t.token, t.logprob) for t in c.top_logprobs] for c in fresh.choices[0].logprobs.content]


def test_without_the_cache_nothing_is_cached(uncached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name a fish."}]
    ask(uncached_client, messages)
    assert cached(ask(uncached_client, messages)) == 0
