"""The opt-in prefix cache (--prefix-cache) through the client, on a server of its own."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .conftest import own_server
from .helpers import MODEL

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a terse assistant that answers about the sea. " * 6}


@pytest.fixture(scope="module")
def cached_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with own_server(tmp_path_factory, "--prefix-cache") as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)


def ask(client: openai.OpenAI, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **kw)


def test_a_repeated_conversation_reads_all_but_its_last_token_from_the_cache(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name a fish that lives in the deep sea."}]
    ask(cached_client, messages)
    again = ask(cached_client, messages)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_a_shared_system_prompt_is_read_once(cached_client) -> None:
    ask(cached_client, [SYSTEM, {"role": "user", "content": "What colour is the sea?"}])
    b = ask(cached_client, [SYSTEM, {"role": "user", "content": "Why is sea water salty?"}])
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert 60 <= cached < b.usage.prompt_tokens - 3, "the system prompt came from the cache, the question did not"


def test_a_seeded_request_reads_nothing_from_the_cache(cached_client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Tell me about waves."}]
    ask(cached_client, messages)
    seeded = ask(cached_client, messages, seed=11, )
    assert seeded.usage.prompt_tokens_details.cached_tokens == 0


def test_without_the_flag_nothing_is_cached(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name a fish."}]
    ask(client, messages)
    assert ask(client, messages).usage.prompt_tokens_details.cached_tokens == 0
