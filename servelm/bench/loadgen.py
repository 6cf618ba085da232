"""Requests for any OpenAI-compatible server, timed as `vllm bench serve` times them.

A streamed `/chat/completions` request records when it was sent, the time to its first content chunk (TTFT),
the gaps between consecutive content chunks (ITL), its output tokens (the stream's `usage` when the server sends
it, else its content chunks) and its end-to-end time. A non-streamed chat completion (`RequestSpec(stream=False)`,
e.g. for `best_of`) has no TTFT or ITL; `/embeddings` requests of N sentences (`EmbeddingSpec`) count inputs.

`run_requests` sends a spec's requests at a rate (Poisson or gamma arrivals) under a concurrency limit;
`run_level` is its closed loop (`concurrency` clients); `summarize` condenses one level. `servelm bench`
(servelm/bench/cli.py) and harness/compare.py both drive servers through them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from servelm.bench.metrics import serving_metrics

# Plain, common English words; almost all are one token each (with their leading space) in the BPE
# vocabularies of small chat models, so N words make a prompt of roughly N tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this are had not but be or "
    "have one all were which their when there can an your more will would about if out so up what "
    "other into time has them some could these two may first then do any like now my over such our "
    "man me even most made after also did many before must through back years where much way well "
    "down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three states himself few "
    "house use during without again place around however home small found thought went say part once "
    "general high upon school every does got united left number course war until always away something "
    "fact though water less public put think almost hand enough far took head yet government system "
    "better set told nothing night end why called find look going asked later knew point next city "
    "give group toward young days let room president side social present given several order national "
    "second possible rather per face among form important often things looked early white case become "
    "large big need four within felt along children saw best church ever least power development light "
    "thing seemed family interest want members mind country area others done turned although open god "
    "service problem certain kind different thus began door help means sense whole matter perhaps itself "
    "york times law human line above name example action company hands local show whether five history "
    "gave today either act feet across taken past quite anything seen having death experience body word "
    "half really week field car words already themselves information tell together college shall money "
    "period held keep sure free seems real behind cannot miss political air question making office brought "
    "whose special heard major problems ago became federal moment study available known result street "
    "economic boy position reason change south board individual job areas society west close turn love "
    "community true court force full seem wife age future voice center woman control common necessary "
    "policy following front sometimes six girl clear further land run students provide feel party able "
    "mother music education university child effect level stood military town short morning total outside "
    "rate figure class art century washington north usually plan leave therefore evidence top million "
    "sound black strong hard various says believe type value play surface soon mean near table peace"
).split()


def build_prompt(n_tokens: int, seed: int | str = 0) -> str:
    """A deterministic text of plain English words, about `n_tokens` tokens long."""
    rng = random.Random(f"servelm-bench-{seed}")
    out: list[str] = []
    sentence: list[str] = []
    for _ in range(max(1, n_tokens - 8)):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(8, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return "Continue this text: " + " ".join(out)


def build_sentences(count: int, seed: int | str = 0, min_words: int = 10, max_words: int = 20) -> list[str]:
    """`count` deterministic, distinct sentences of `min_words`..`max_words` plain English words each."""
    rng = random.Random(f"servelm-bench-sentences-{seed}")
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(count)]


@dataclass
class RequestSpec:
    """What every request of a level asks for. `extra_body` is merged into the JSON body last."""

    max_tokens: int = 64
    prompt_tokens: int = 128
    temperature: float = 0.0
    ban_token_ids: tuple[int, ...] = ()
    system_prompt: str | None = None
    unique_prompts: bool = True
    prompt_salt: str = ""  # distinguishes prompt sets, so no two levels/workloads share a prompt
    extra_body: dict[str, Any] = field(default_factory=dict)
    stream: bool = True  # False: one JSON answer per request (no TTFT or ITL)
    # Non-streamed only: the server's usage.completion_tokens counts one choice though the answer has several
    # (llama-server with n > 1); output tokens are then completion_tokens x the number of choices.
    usage_per_choice: bool = False
    # A conversation: each "request" is this many turns, one after another, each resending the whole history
    # (the earlier turns' questions and answers) with a new question of prompt_tokens; every turn counts as one
    # request in the figures. 1: single requests.
    turns: int = 1
    ignore_eos: bool = False  # ask the server to ignore end-of-sequence (vLLM, llama-server, servelm take it)
    # Per request index (cycled), when given: the user message, and (prompt tokens, max_tokens) pairs
    prompts: tuple[str, ...] = ()
    lengths: tuple[tuple[int, int], ...] = ()

    path = "/chat/completions"

    async def send(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult | list[RequestResult]:
        if self.turns > 1:
            return await self._converse(client, url, body)
        if self.stream:
            return await stream_one(client, url, body)
        return await complete_one(client, url, body, self.usage_per_choice)

    async def _converse(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[RequestResult]:
        results: list[RequestResult] = []
        messages = list(body["messages"])
        for turn in range(self.turns):
            if turn:
                seed = f"{self.prompt_salt}-{messages[-1]['content'][:40]}-turn{turn}"
                messages.append({"role": "user", "content": build_prompt(self.prompt_tokens, seed)})
            result = await stream_one(client, url, {**body, "messages": messages})
            results.append(result)
            if not result.ok:
                break
            messages.append({"role": "assistant", "content": result.text})
        return results

    def body(self, model: str, index: int) -> dict[str, Any]:
        messages: list[dict[str, str]] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        seed = f"{self.prompt_salt}-{index if self.unique_prompts else 0}"
        prompt_tokens, max_tokens = self.lengths[max(index, 0) % len(self.lengths)] if self.lengths else \
            (self.prompt_tokens, self.max_tokens)
        # a warm-up (negative index) gets a prompt of its own: none of the counted ones is cached by it
        given = self.prompts[index % len(self.prompts)] if self.prompts and index >= 0 else None
        text = given if given is not None else build_prompt(prompt_tokens, seed)
        messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.ban_token_ids:
            body["logit_bias"] = {str(t): -100 for t in self.ban_token_ids}
        body.update(self.extra_body)
        return body


@dataclass
class EmbeddingSpec:
    """Every request of a level: POST /embeddings with `inputs` fresh sentences (none repeats)."""

    inputs: int = 32
    min_words: int = 10
    max_words: int = 20
    prompt_salt: str = ""
    extra_body: dict[str, Any] = field(default_factory=dict)

    path = "/embeddings"

    async def send(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
        return await embed_one(client, url, body)

    def body(self, model: str, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "input": build_sentences(self.inputs, f"{self.prompt_salt}-{index}", self.min_words, self.max_words),
        }
        body.update(self.extra_body)
        return body


@dataclass
class RequestResult:
    ok: bool
    start_time: float = 0.0  # time.perf_counter() when it was sent
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    e2e_s: float = 0.0
    error: str | None = None
    inputs: int = 0  # embedding requests: vectors returned
    text: str = ""  # a streamed answer's content


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    ok: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    req_s: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    output_tokens_min: int | None
    output_tokens_max: int | None
    prompt_tokens_mean: float | None
    error_samples: list[str] = field(default_factory=list)
    inputs: int = 0  # embedding inputs embedded (vectors returned)
    inputs_s: float = 0.0  # inputs / wall time
    serving: dict[str, Any] = field(default_factory=dict)  # vllm bench serve's figures (servelm.bench.metrics)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _summary_ms(values: list[float]) -> dict[str, float | None]:
    def ms(q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v * 1000.0

    return {"p50": ms(50), "p90": ms(90), "p99": ms(99)}


def _content_of(event: dict[str, Any]) -> str:
    parts = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            parts.append(content)
    return "".join(parts)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    """Send one streamed chat completion and time its content chunks."""
    start = time.perf_counter()
    failed = functools.partial(RequestResult, False, start)
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                return failed(e2e_s=time.perf_counter() - start,
                                     error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {json.dumps(event)[:200]}")
                content = _content_of(event)
                if content:
                    chunk_times.append(time.perf_counter())
                    pieces.append(content)
                if event.get("usage"):
                    usage = event["usage"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, OSError) as exc:
        return failed(e2e_s=time.perf_counter() - start,
                             error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if not done:
        return failed(e2e_s=end - start, error="stream ended without [DONE]")
    if not chunk_times:
        return failed(e2e_s=end - start, error="stream had no content")
    try:
        tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(chunk_times)
        prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
    except (TypeError, ValueError):
        return failed(e2e_s=end - start, error=f"bad usage: {usage!r}"[:200])
    return RequestResult(
        ok=True,
        start_time=start,
        ttft_s=(chunk_times[0] - start) if chunk_times else None,
        itl_s=[b - a for a, b in itertools.pairwise(chunk_times)],
        output_tokens=tokens,
        prompt_tokens=prompt_tokens,
        e2e_s=end - start,
        text="".join(pieces),
    )


_ANSWER_ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, OSError)


async def _post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     read: Callable[[dict[str, Any], float], RequestResult]) -> RequestResult:
    """POST one non-streamed request and time it; `read(answer, e2e_s)` judges a 200's JSON answer."""
    start = time.perf_counter()
    failed = functools.partial(RequestResult, False, start)
    try:
        resp = await client.post(url, json=body)
        e2e = time.perf_counter() - start
        if resp.status_code != 200:
            return failed(e2e_s=e2e, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
        result = read(resp.json(), e2e)
    except _ANSWER_ERRORS as exc:
        return failed(e2e_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])
    result.start_time = start
    return result


def _prompt_tokens(usage: dict[str, Any]) -> int | None:
    return int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None


async def complete_one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       usage_per_choice: bool = False) -> RequestResult:
    """Send one non-streamed chat completion; its output tokens come from `usage`."""

    def read(answer: dict[str, Any], e2e: float) -> RequestResult:
        choices = answer["choices"]
        usage = answer["usage"]
        tokens = int(usage["completion_tokens"]) * (len(choices) if usage_per_choice else 1)
        if not choices or not any((c.get("message") or {}).get("content") for c in choices):
            return RequestResult(ok=False, e2e_s=e2e, error="answer had no content")
        return RequestResult(ok=True, output_tokens=tokens, prompt_tokens=_prompt_tokens(usage), e2e_s=e2e)

    return await _post_json(client, url, body, read)


async def embed_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    """Send one /embeddings request; it must return one non-empty vector per input."""
    expected = len(body["input"]) if isinstance(body["input"], list) else 1

    def read(answer: dict[str, Any], e2e: float) -> RequestResult:
        data = answer["data"]
        if len(data) != expected or not all(d.get("embedding") for d in data):
            return RequestResult(ok=False, e2e_s=e2e, error=f"{len(data)} vectors (some empty?) for {expected} inputs")
        return RequestResult(ok=True, prompt_tokens=_prompt_tokens(answer.get("usage") or {}), e2e_s=e2e,
                             inputs=len(data))

    return await _post_json(client, url, body, read)


def summarize(concurrency: int, results: list[RequestResult], wall_s: float,
              goodput: dict[str, float] | None = None) -> LevelResult:
    good = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompts = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        ok=len(good),
        errors=len(bad),
        wall_s=wall_s,
        output_tokens=out_tokens,
        output_tok_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        req_s=len(good) / wall_s if wall_s > 0 else 0.0,
        ttft_ms=_summary_ms([r.ttft_s for r in good if r.ttft_s is not None]),
        itl_ms=_summary_ms([gap for r in good for gap in r.itl_s]),
        e2e_ms=_summary_ms([r.e2e_s for r in good]),
        output_tokens_min=min((r.output_tokens for r in good), default=None),
        output_tokens_max=max((r.output_tokens for r in good), default=None),
        prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
        error_samples=sorted({r.error or "" for r in bad})[:5],
        inputs=sum(r.inputs for r in good),
        inputs_s=sum(r.inputs for r in good) / wall_s if wall_s > 0 else 0.0,
        serving={k: v for k, v in serving_metrics(results, wall_s, goodput=goodput).items() if not isinstance(v, list)},
    )


def _client(concurrency: int, timeout_s: float, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                             headers=headers, trust_env=False)


def arrival_gaps(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each of `count` requests: none at an infinite rate; else gamma-distributed gaps
    of mean 1 / request_rate (burstiness 1: exponential gaps, a Poisson process; below 1 burstier, above more even)."""
    if math.isinf(request_rate):
        return [0.0] * count
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [0.0 if i == 0 else rng.gammavariate(burstiness, theta) for i in range(count)]  # the first at once


async def run_requests(
    url: str,
    model: str,
    spec: RequestSpec | EmbeddingSpec,
    count: int,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    warmup: int = 0,
    timeout_s: float = 300.0,
    api_key: str | None = None,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `count` requests of `spec` (index 0..count-1): they arrive at `request_rate` per second (all at once
    when infinite) and at most `max_concurrency` are in flight (None: no limit). `warmup` requests run first, at
    most `max_concurrency` at a time, and are not counted. Returns every request's result (a conversation's turns
    each) and the run's duration in seconds, from the first arrival to the last answer. `on_done()` is called as
    each request (a whole conversation) ends."""
    gaps = arrival_gaps(count, request_rate, burstiness, seed)
    endpoint = url.rstrip("/") + spec.path
    width = max_concurrency or count or 1
    limit = asyncio.Semaphore(width)

    async def one(client: httpx.AsyncClient, index: int, counted: list[RequestResult] | None) -> None:
        async with limit:
            got = await spec.send(client, endpoint, spec.body(model, index))
        batch = got if isinstance(got, list) else [got]
        if counted is not None:
            counted.extend(batch)
            if on_done is not None:
                on_done()

    async with _client(min(width, 1024), timeout_s, api_key) as client:
        await asyncio.gather(*(one(client, -1 - i, None) for i in range(warmup)))
        results: list[RequestResult] = []
        tasks = []
        start = time.perf_counter()
        for index, gap in enumerate(gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, index, results)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    requests: int | None = None,
    spec: RequestSpec | EmbeddingSpec | None = None,
    warmup: int = 0,
    timeout_s: float = 300.0,
    api_key: str | None = None,
    goodput: dict[str, float] | None = None,
) -> LevelResult:
    """One closed-loop level: `concurrency` clients share `requests` requests (default 2 x concurrency, at least
    4), after `warmup` uncounted ones. `url` is the base URL (e.g. http://127.0.0.1:8000/v1). `goodput`: SLOs in ms
    by metric (servelm.bench.metrics), for `serving["request_goodput"]`."""
    spec = spec or RequestSpec()
    total = requests if requests is not None else max(4, 2 * concurrency)
    results, wall = await run_requests(url, model, spec, total, max_concurrency=concurrency, warmup=warmup,
                                       timeout_s=timeout_s, api_key=api_key)
    return summarize(concurrency, results, wall, goodput)
