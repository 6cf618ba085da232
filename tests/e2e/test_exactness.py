"""Exact answers under any load (issue 14; docs/exactness.md), on the real model through the official client.

Each request's signature is its text and, for every generated token, its 20 most likely tokens with their
logprobs, compared for equality (JSON carries the float64 values exactly): equal only if the logits were
bitwise equal. A greedy and a seeded request, over three prompts (the longest decodes past position 256, where a
lone row would take another kernel), must give the same signature:
- alone, on a server that caches nothing (the reference);
- among 8 identical requests at once;
- among unrelated requests of other lengths, streamed and not;
- after a warm cache of the same prompt, and of one that differs only at its end;
- on servers whose steps carry 32, 256 and 2048 tokens.
The reference server decodes one token a step; every other one drafts speculatively (its default), so each of
these also holds answers made from drafted rows to the answers made without them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import own_server
from .helpers import MODEL, client_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # slow: the reference and the compared servers

# servers of other flags are compared with the reference: --prompt-tiles off, since `auto` decides by a timed pass
# that can fall either side of its bound on two servers, and a step of 32 tokens reads no tile of 64
FAST = ("--no-embedding-model", "--chat-embedding-window", "0", "--prompt-tiles", "off")
LIGHTHOUSE = "The history of the lighthouse begins with fires lit on hills to guide ships at night. "
PROMPTS = {
    "short": [{"role": "user", "content": "Name three colours of the sea."}],
    "medium": [{"role": "system", "content": "You are a careful assistant. " * 12},
               {"role": "user", "content": "Write a short story about a cat who sails."}],
    "long": [{"role": "system", "content": LIGHTHOUSE * 20},
             {"role": "user", "content": "Summarise the history above in three sentences."}],
    # an answer that copies its prompt: speculative decoding's guesses hold, so most tokens come from drafted rows
    "echo": [{"role": "user", "content": "Copy this text exactly: " + LIGHTHOUSE + "Keepers trimmed the wicks twice a night."}],
}
KINDS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 7}}
MAX_TOKENS = 24


def request(prompt: str, kind: str) -> dict:
    return {"model": MODEL, "messages": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 20, **KINDS[kind]}


def signature(response) -> tuple:
    content = response.choices[0].logprobs.content
    return response.choices[0].message.content, [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]


CASES = [(p, k) for p in PROMPTS for k in KINDS]
# prompts (token ids) at a tile's edge: a prompt's whole tiles of 64 are read on flash attention's tiled kernel,
# and a single row right after them once re-read a tiled cell on the row kernel (tests/adversarial/test_tiles.py)
EDGES = (256, 257, 258, 513)


def edge_request(n: int) -> dict:
    return {"model": MODEL, "prompt": [100 + (i * 37) % 5000 for i in range(n)], "max_tokens": 4, "temperature": 0,
            "logprobs": 5}


def edge_signature(response) -> tuple:
    return response.choices[0].text, response.choices[0].logprobs.top_logprobs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every request alone, on a server with no prefix cache and no speculative decoding, one at a time."""
    with own_server(tmp_path_factory, "--no-prefix-cache", "--speculative", "off", *FAST) as srv:
        client = client_for(srv.base_url)
        out = {case: signature(client.chat.completions.create(**request(*case))) for case in CASES}
        out |= {("edge", str(n)): edge_signature(client.completions.create(**edge_request(n))) for n in EDGES}
    assert any(len(text) > 40 for text, _ in out.values())
    return out


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on default flags: the prefix cache on."""
    with own_server(tmp_path_factory, *FAST) as srv:
        yield srv.base_url


def aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{k}" for p, k in CASES])
async def test_eight_identical_requests_at_once_each_answer_as_one_alone(reference, cached, case) -> None:
    async with aclient(cached) as client:
        answers = await asyncio.gather(*[client.chat.completions.create(**request(*case)) for _ in range(8)])
    assert all(signature(a) == reference[case] for a in answers)


async def test_prompts_at_a_tiles_edge_answer_alone_as_together(reference, cached) -> None:
    """Prompts of 64k, 64k + 1 and 64k + 2 tokens, all at once and then one at a time (from the cache), as alone on
    the reference: the rows right after a prompt's tiles are computed the same whatever shares their step."""
    async with aclient(cached) as client:
        together = await asyncio.gather(*[client.completions.create(**edge_request(n)) for n in EDGES])
        alone = [await client.completions.create(**edge_request(n)) for n in EDGES]
    want = [reference[("edge", str(n))] for n in EDGES]
    assert [edge_signature(r) for r in together] == want
    assert [edge_signature(r) for r in alone] == want


async def test_beside_unrelated_requests_of_other_lengths_every_answer_is_its_own_alone(reference, cached) -> None:
    """All six requests at once, streamed and not, beside strangers reading and decoding prompts of other lengths."""
    async with aclient(cached) as client:
        async def streamed(case: tuple[str, str]) -> tuple:
            text, tops = "", []
            stream = await client.chat.completions.create(**request(*case), stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                    tops += [[(t.token, t.logprob) for t in c.top_logprobs] for c in chunk.choices[0].logprobs.content]
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return text, tops

        strangers = [client.chat.completions.create(
            model=MODEL, max_tokens=40 + 7 * k, temperature=0.5,
            messages=[{"role": "user", "content": f"Stranger {k}: " + "tell me about rivers and lakes. " * (3 * k + 1)}])
            for k in range(6)]
        plain = [client.chat.completions.create(**request(*case)) for case in CASES]
        streams = [streamed(case) for case in CASES]
        results = await asyncio.gather(*strangers, *plain, *streams)
    answers = results[len(strangers):]
    for case, answer in zip(CASES, answers[: len(CASES)]):
        assert signature(answer) == reference[case], case
    for case, answer in zip(CASES, answers[len(CASES):]):
        assert answer == reference[case], f"streamed {case}"


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_after_a_warm_cache_of_the_same_prompt_and_of_a_near_identical_one(reference, cached, case) -> None:
    client = client_for(cached)
    prompt, kind = case
    near = [*PROMPTS[prompt][:-1], {"role": "user", "content": PROMPTS[prompt][-1]["content"] + " Be brief."}]
    client.chat.completions.create(model=MODEL, messages=near, max_tokens=4, temperature=0)  # a near-identical prompt
    first = client.chat.completions.create(**request(*case))
    again = client.chat.completions.create(**request(*case))  # the same prompt, and its answer, in the cache
    assert first.usage.prompt_tokens_details.cached_tokens > 0 or prompt == "short"
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert signature(first) == signature(again) == reference[case]


@pytest.mark.parametrize("step_tokens", ["32", "256", "2048"])
def test_the_step_size_changes_nothing(reference, tmp_path_factory, step_tokens) -> None:
    with own_server(tmp_path_factory, "--max-step-tokens", step_tokens, *FAST) as srv:
        client = client_for(srv.base_url)
        for case in CASES:
            assert signature(client.chat.completions.create(**request(*case))) == reference[case], case


@pytest.mark.parametrize("kind, cell_bytes", [("q8_0", 12240), ("q4_0", 6480)])
async def test_a_quantized_kv_cache_keeps_answers_exact_under_load(reference, tmp_path_factory, kind, cell_bytes) -> None:
    """--kv-cache-type: the cache holds a cell in fewer bytes (SmolLM2: 30 layers × keys and values × 192 wide;
    f16 is 23,040 bytes), the logits move a little from f16's, and each answer is still its own alone under load."""
    with own_server(tmp_path_factory, "--kv-cache-type", kind, *FAST) as srv:
        health = httpx.get(srv.base_url + "/health", timeout=10).json()
        assert health["deployments"][MODEL]["kv_cell_bytes"] == cell_bytes
        alone = {case: signature(client_for(srv.base_url).chat.completions.create(**request(*case))) for case in CASES}
        assert any(alone[case] != reference[case] for case in CASES)  # another cache type: other logits
        async with aclient(srv.base_url) as client:
            together = await asyncio.gather(*[client.chat.completions.create(**request(*case))
                                              for case in CASES for _ in range(3)])
    assert [signature(a) for a in together] == [alone[case] for case in CASES for _ in range(3)]


def test_speculative_decoding_drafts_and_reports_its_counts(reference, cached) -> None:
    """The echo prompt's answer copies its prompt: guesses are read and held, counted in the answer's timings and
    in /metrics, and the answer is the one made without them."""
    client = client_for(cached)
    answer = client.chat.completions.create(**request("echo", "greedy"), extra_body={"timings_per_request": True})
    timings = answer.model_extra["timings"]
    assert signature(answer) == reference["echo", "greedy"]
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["draft_n_accepted"] >= MAX_TOKENS // 3, timings
    metrics = httpx.get(cached + "/metrics", timeout=10).text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("servelm_spec_decode_")}
    assert counts["servelm_spec_decode_draft_tokens_total"] >= timings["draft_n"]
    assert 0 < counts["servelm_spec_decode_accepted_tokens_total"] <= counts["servelm_spec_decode_draft_tokens_total"]


def test_the_engine_time_by_phase_is_mostly_llama_decode(cached) -> None:
    """On the real model /metrics splits the engine's steps into phases; llama_decode is timed inside the runner."""
    client_for(cached).chat.completions.create(**request("echo", "greedy"))
    metrics = httpx.get(cached + "/metrics", timeout=10).text
    phases = {line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("servelm_engine_phase_seconds_total{")}
    step = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("servelm_engine_step_seconds_total{"))
    assert set(phases) >= {"decode", "runner", "sample", "grammar", "detokenize", "loop", "idle"}
    assert phases["decode"] > 0 and phases["sample"] > 0 and phases["detokenize"] > 0
    assert phases["decode"] > phases["sample"], "a 135M model's pass outweighs the sampling of its rows"
    assert sum(v for k, v in phases.items() if k != "idle") <= step * 1.01 + 0.05
