"""Numbers a client sends: every integer and float is bounded where the body is parsed (a 400 naming the field),
never carried into the engine's arithmetic. A `priority` of 1 followed by 309 zeros used to reach Scheduler.rank,
whose OverflowError failed every request in flight; other fields took any size and were used as given.

The attack, on every route that takes numbers: 10^309 (too large for a float), its negative, and the first value
past the documented bound (±2^31)."""

from __future__ import annotations

import httpx
import pytest

from servelm.compose import build_deployment, build_embedding_deployment
from servelm.http.app import create_app
from servelm.protocol.common import MAX_INT, MIN_INT
from servelm.runners.fake import FakeEmbedder, FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

HUGE = 10**309  # the "1 followed by 309 zeros": beyond any float
MSG = [{"role": "user", "content": "hi"}]
CHAT = ("/v1/chat/completions", {"model": "fake-model", "messages": MSG, "max_tokens": 2})
COMPLETIONS = ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 2})
RESPONSES = ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 2})
MESSAGES = ("/v1/messages", {"model": "fake-model", "messages": MSG, "max_tokens": 2})
DJL = ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
EMBED = ("/v1/embeddings", {"model": "fake-embed", "input": "hi"})
RERANK = ("/v1/rerank", {"model": "fake-rerank", "query": "q", "documents": ["a"]})
COHERE = ("/v2/rerank", {"model": "fake-rerank", "query": "q", "documents": ["a"]})
OVMS = ("/v3/rerank", {"model": "fake-rerank", "query": "q", "documents": ["a"]})
SCORE = ("/v1/score", {"model": "fake-rerank", "text_1": "q", "text_2": "a"})
DETOKENIZE = ("/detokenize", {"model": "fake-model", "tokens": [1]})


def generating(field: str, value: object) -> list[tuple[tuple[str, dict], dict, str]]:
    """The same field on chat, completions and Responses (they share it)."""
    return [(route, {field: value}, field) for route in (CHAT, COMPLETIONS, RESPONSES)]


CASES = [
    *generating("priority", HUGE), *generating("priority", -HUGE), *generating("priority", MAX_INT + 1),
    *generating("priority", MIN_INT - 1),
    (MESSAGES, {"priority": HUGE}, "priority"), (MESSAGES, {"priority": -HUGE}, "priority"),
    *generating("top_k", HUGE), *generating("min_tokens", HUGE), *generating("keep_alive", HUGE),
    *generating("keep_alive", -HUGE), *generating("keep_alive", 1e300), *generating("seed", HUGE),
    *generating("stop_token_ids", [HUGE]), *generating("lora", [{"id": HUGE}]),
    (CHAT, {"max_tokens": HUGE}, "max_tokens"), (CHAT, {"max_completion_tokens": HUGE}, "max_completion_tokens"),
    (CHAT, {"num_beam_groups": HUGE}, "num_beam_groups"), (CHAT, {"thinking_budget": HUGE}, "thinking_budget"),
    (CHAT, {"n": HUGE}, "n"), (COMPLETIONS, {"best_of": HUGE}, "best_of"),
    (COMPLETIONS, {"prompt": [HUGE]}, "prompt"), (COMPLETIONS, {"prompt": [[1, HUGE]]}, "prompt"),
    (RESPONSES, {"max_output_tokens": HUGE}, "max_output_tokens"), (RESPONSES, {"max_tool_calls": HUGE}, "max_tool_calls"),
    (RESPONSES, {"thinking_budget": HUGE}, "thinking_budget"),
    (MESSAGES, {"max_tokens": HUGE}, "max_tokens"), (MESSAGES, {"top_k": HUGE}, "top_k"),
    (MESSAGES, {"seed": HUGE}, "seed"), (MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": HUGE}}, "budget_tokens"),
    (DJL, {"parameters": {"max_new_tokens": HUGE}}, "max_new_tokens"), (DJL, {"parameters": {"top_k": HUGE}}, "top_k"),
    (EMBED, {"dimensions": HUGE}, "dimensions"), (EMBED, {"input": [HUGE]}, "input"), (EMBED, {"input": [[HUGE]]}, "input"),
    (RERANK, {"top_n": HUGE}, "top_n"), (RERANK, {"keep_alive": HUGE}, "keep_alive"), (COHERE, {"top_n": HUGE}, "top_n"),
    (COHERE, {"max_tokens_per_doc": HUGE}, "max_tokens_per_doc"), (OVMS, {"top_n": HUGE}, "top_n"),
    (SCORE, {"keep_alive": HUGE}, "keep_alive"), (DETOKENIZE, {"tokens": [HUGE]}, "tokens"),
]


@pytest.fixture(scope="module")
def base_url():
    chat, engine = build_deployment("fake-model", FakeRunner())
    embed, embedder = build_embedding_deployment("fake-embed", FakeEmbedder(dim=16))
    rerank, reranker = build_embedding_deployment("fake-rerank", FakeEmbedder(cross_encoder=True))
    workers = [engine, embedder, reranker]
    app = create_app(Deployments([chat, embed, rerank]), on_start=lambda: [w.start() for w in workers],
                     on_stop=lambda: [w.stop() for w in workers])
    with serving(app) as url:
        yield url


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize(("route", "extra", "field"), CASES,
                         ids=[f"{r[0]}-{next(iter(e))}={str(next(iter(e.values())))[:12]}" for r, e, _ in CASES])
def test_every_number_past_its_bound_is_a_400_naming_the_field(base_url, route, extra, field):
    path, body = route
    r = httpx.post(base_url + path, json=merged(body, extra), timeout=20)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert field in r.text, r.text[:300]


@pytest.mark.parametrize("priority", [MIN_INT, MAX_INT])
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES, MESSAGES], ids=lambda r: r[0])
def test_the_documented_priority_range_is_accepted_on_an_open_server(base_url, route, priority):
    path, body = route
    r = httpx.post(base_url + path, json={**body, "priority": priority}, timeout=20)
    assert r.status_code == 200, r.text[:300]


def test_a_huge_priority_never_fails_the_requests_in_flight(base_url):
    """The issue's attack: while others run, the huge priority is refused alone, and the others answer."""
    import concurrent.futures

    path, body = CHAT
    slow = {**body, "max_tokens": 20, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = [pool.submit(httpx.post, base_url + path, json=slow, timeout=30) for _ in range(6)]
        attacks = [pool.submit(httpx.post, base_url + p, json={**b, "priority": HUGE}, timeout=30)
                   for p, b in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)]
        assert [a.result().status_code for a in attacks] == [400] * 4
        assert [o.result().status_code for o in others] == [200] * 6


@pytest.mark.parametrize("value", ["1e999", "-1e999", "inf", "nan", "٣", "٣s", "9999999999h", 2.0**31, -(2.0**31),
                                   10**400, float("inf"), True])
def test_keep_alive_is_finite_ascii_and_within_its_bound(value):
    from servelm.errors import InvalidParameter
    from servelm.service.registry.catalog import parse_keep_alive

    with pytest.raises(InvalidParameter) as refused:
        parse_keep_alive(value)
    assert refused.value.param == "keep_alive"


def test_keep_alive_within_its_bound_reads_as_ollama_reads_it():
    from servelm.service.registry.catalog import KEEP_ALIVE_MAX_S, parse_keep_alive

    assert [parse_keep_alive(v) for v in ("5m", "1h30m", "-1", 0, KEEP_ALIVE_MAX_S, "90")] == \
        [300.0, 5400.0, -1.0, 0.0, float(KEEP_ALIVE_MAX_S), 90.0]


def test_the_batch_priority_is_never_below_what_a_key_may_ask_for():
    """A negative --batch-priority made every batch line of a key without min_priority a 400 (lines are the key's
    requests, and a key goes below 0 only where granted it): the flag is 0 or more."""
    from pydantic import ValidationError

    from servelm.config import ServerSettings

    with pytest.raises(ValidationError, match="batch_priority"):
        ServerSettings(batch_priority=-1)
    assert ServerSettings(batch_priority=0).batch_priority == 0


@pytest.mark.parametrize("value", ["16385", "1000000000"])
def test_a_step_budget_past_its_bound_is_refused_at_start_up(value: str, capsys) -> None:
    """--max-step-tokens sizes llama.cpp's batch and compute buffers: 10^9 passed the check and the server then grew
    its memory for minutes without ever answering. It is bounded (16,384) and a larger value is refused at once."""
    from servelm.__main__ import main

    assert main(["serve", "--max-step-tokens", value, "--no-embedding-model"]) == 2
    assert "16384" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.5}], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
def test_a_temperature_within_its_bound_but_near_zero_answers_as_greedy(base_url, temperature, extra):
    """temperature 5e-324 is within [0, 2]: dividing a row by it overflowed float32 (and float64) into inf and NaN,
    and every draw took the vocabulary's last token. A temperature below 1e-5 now draws as 0 does, as vLLM's."""
    path, body = CHAT
    ask = {**body, "max_tokens": 12, "ignore_eos": True, "seed": 3, **extra}
    greedy = httpx.post(base_url + path, json={**ask, "temperature": 0}, timeout=20)
    tiny = httpx.post(base_url + path, json={**ask, "temperature": temperature}, timeout=20)
    assert greedy.status_code == tiny.status_code == 200, tiny.text[:300]
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("key", [" 5", "+5", "05", "5_0", "٥", "-0", "5 ", "0x5"])
def test_a_logit_bias_key_is_a_token_id_written_plainly(base_url, key):
    """Python's int() read each of these as a token id ("5_0" as 50, "٥" as 5); "5" and "05" in one map were the
    same token biased twice. A key is a token id in plain ASCII decimal, as OpenAI's are."""
    path, body = CHAT
    r = httpx.post(base_url + path, json={**body, "logit_bias": {key: 5}}, timeout=20)
    assert r.status_code == 400, r.text[:300]
    assert "logit_bias" in r.text
    assert httpx.post(base_url + path, json={**body, "logit_bias": {"5": 5, "0": -1}}, timeout=20).status_code == 200
