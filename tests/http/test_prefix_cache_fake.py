"""The prefix cache through the HTTP layer on the fake model, whose arithmetic is exact: with and without the
cache, the same greedy requests give the same text, and usage reports what the cache supplied."""

from __future__ import annotations

import openai

SYSTEM = {"role": "system", "content": "abcdefghijklmnopqrstuvwxyz"}


def conversation(client: openai.OpenAI, turns: list[str]) -> list[tuple[str, int]]:
    messages, out = [SYSTEM], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6, temperature=0)
        out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def test_greedy_answers_do_not_depend_on_the_cache(fake_server_factory):
    runs = {}
    for cache in (False, True):
        server = fake_server_factory(prefix_cache=cache, num_slots=2, context_window=200)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        turns = ["hello", "more", "again"]
        runs[cache] = conversation(client, turns) + conversation(client, turns)
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]]
    assert [c for _, c in runs[False]] == [0] * 6
    hits = [c for _, c in runs[True]]
    # the fake's prompts are about 40, 65 and 90 tokens: a turn whose prompt reads its first whole tile (64
    # positions, on the tiled kernel) cannot reuse cells its entry read in rows, nor a short one tiled cells
    assert hits[0] == 0 and hits[2] > 0 and hits[4] > 0 and hits[5] > hits[2], \
        "later turns and the repeated conversation were cached"


def test_completions_report_cached_tokens(fake_server_factory):
    server = fake_server_factory(prefix_cache=True)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    prompt = "abcdefghijklmnop"
    first = client.completions.create(model="fake-model", prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model="fake-model", prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text


def test_one_key_never_reads_anothers_cached_prompt(fake_server_factory):
    """With API keys, cached prompts are per key: the second key's identical request reports no cached tokens
    (cached_tokens and the time to first token would otherwise reveal the first key's prompt), and each key
    still reuses its own. cache_salt divides one key's requests further."""
    from servelm.http.limits import SecurityConfig
    from servelm.keys import key_spec

    server = fake_server_factory(prefix_cache=True, security=SecurityConfig(keys=[key_spec("sk-a"), key_spec("sk-b")]))

    def cached(key: str, **extra) -> int:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(model="fake-model", messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                           max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("sk-a") == 0
    assert cached("sk-b") == 0, "the other key's prompt is not readable"
    assert cached("sk-a") > 0 and cached("sk-b") > 0, "each key reuses its own"
    assert cached("sk-a", cache_salt="tenant-1") == 0, "a salt starts a scope of its own"
    assert cached("sk-a", cache_salt="tenant-1") > 0
    assert cached("sk-b", cache_salt="tenant-1") == 0, "the same salt under another key is another scope"


def test_an_open_server_has_one_scope_and_salts_divide_it(fake_server_factory):
    server = fake_server_factory(prefix_cache=True)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

    def cached(**extra) -> int:
        r = client.chat.completions.create(model="fake-model", messages=[SYSTEM, {"role": "user", "content": "yo"}],
                                           max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() > 0
    assert cached(cache_salt="s") == 0 and cached(cache_salt="s") > 0
