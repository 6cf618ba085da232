"""Closed-loop load generator for any OpenAI-compatible server.

Each of `concurrency` clients sends one streamed `/chat/completions` request, reads its SSE stream to
the end, and sends the next, until the level's request count is done. Per request it records the time
to the first content token (TTFT), the gaps between consecutive content chunks (ITL), the output token
count (from the stream's `usage` when the server sends it, else the number of content chunks) and the
end-to-end time. Per level it reports output tokens/s, requests/s, TTFT and ITL percentiles and errors.

Two other request kinds: a non-streamed chat completion (`RequestSpec(stream=False)`; no TTFT or ITL,
output tokens from `usage`), e.g. for `best_of`, where a stream would only carry the chosen answer at the
end; and `/embeddings` requests of N sentences each (`EmbeddingSpec`), reported as inputs/s.

    python -m bench.loadgen --url http://127.0.0.1:8000/v1 --concurrency 1,16 --ban-eos 0 2
    python -m bench.loadgen --model all-minilm-l6-v2 --embed-inputs 32 --concurrency 2 --requests 8

As a library: `await run_level(url, model, concurrency, requests, spec, ...)` returns a `LevelResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

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
        messages.append({"role": "user", "content": build_prompt(self.prompt_tokens, seed)})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
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
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                return RequestResult(ok=False, e2e_s=time.perf_counter() - start,
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
        return RequestResult(ok=False, e2e_s=time.perf_counter() - start,
                             error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if not done:
        return RequestResult(ok=False, e2e_s=end - start, error="stream ended without [DONE]")
    if not chunk_times:
        return RequestResult(ok=False, e2e_s=end - start, error="stream had no content")
    try:
        tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(chunk_times)
        prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
    except (TypeError, ValueError):
        return RequestResult(ok=False, e2e_s=end - start, error=f"bad usage: {usage!r}"[:200])
    return RequestResult(
        ok=True,
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
    try:
        resp = await client.post(url, json=body)
        e2e = time.perf_counter() - start
        if resp.status_code != 200:
            return RequestResult(ok=False, e2e_s=e2e, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
        return read(resp.json(), e2e)
    except _ANSWER_ERRORS as exc:
        return RequestResult(ok=False, e2e_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])


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


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelResult:
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
    )


def _client(concurrency: int, timeout_s: float, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                             headers=headers, trust_env=False)


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    requests: int | None = None,
    spec: RequestSpec | EmbeddingSpec | None = None,
    warmup: int = 0,
    timeout_s: float = 300.0,
    api_key: str | None = None,
) -> LevelResult:
    """Run one closed-loop level: `concurrency` clients share `requests` requests.

    `url` is the base URL (e.g. http://127.0.0.1:8000/v1). `spec` says what each request is (streamed chat
    by default; `EmbeddingSpec` for /embeddings). `warmup` requests run first, one at a time, and are not
    counted. `requests` defaults to 2 x concurrency, at least 4.
    """
    spec = spec or RequestSpec()
    total = requests if requests is not None else max(4, 2 * concurrency)
    endpoint = url.rstrip("/") + spec.path
    async with _client(concurrency, timeout_s, api_key) as client:
        for i in range(warmup):
            await spec.send(client, endpoint, spec.body(model, -1 - i))  # type: ignore[union-attr]
        next_index = 0
        results: list[RequestResult] = []

        async def worker() -> None:
            nonlocal next_index
            while next_index < total:
                index = next_index
                next_index += 1
                got = await spec.send(client, endpoint, spec.body(model, index))
                results.extend(got if isinstance(got, list) else [got])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(concurrency, results, wall)


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_table(levels: list[LevelResult]) -> str:
    """A plain-text table, one row per level."""
    if any(lv.inputs for lv in levels):  # embeddings: inputs/s and request latency
        head = ["conc", "reqs", "err", "inputs/s", "req/s", "e2e p50", "p90", "p99", "prompt tok"]
        rows = [head]
        for lv in levels:
            rows.append([str(lv.concurrency), str(lv.requests), str(lv.errors), _fmt(lv.inputs_s), _fmt(lv.req_s, 2),
                         _fmt(lv.e2e_ms["p50"]), _fmt(lv.e2e_ms["p90"]), _fmt(lv.e2e_ms["p99"]),
                         _fmt(lv.prompt_tokens_mean, 0)])
        return _align(rows) + "\n(times in ms; prompt tok = tokens of one request's inputs together)"
    head = ["conc", "reqs", "err", "out tok/s", "req/s", "TTFT p50", "p90", "p99",
            "ITL p50", "p90", "p99", "e2e p50", "out tok", "prompt tok"]
    rows = [head]
    for lv in levels:
        toks = ("-" if lv.output_tokens_min is None else
                f"{lv.output_tokens_min}" if lv.output_tokens_min == lv.output_tokens_max else
                f"{lv.output_tokens_min}-{lv.output_tokens_max}")
        rows.append([
            str(lv.concurrency), str(lv.requests), str(lv.errors), _fmt(lv.output_tok_s), _fmt(lv.req_s, 2),
            _fmt(lv.ttft_ms["p50"]), _fmt(lv.ttft_ms["p90"]), _fmt(lv.ttft_ms["p99"]),
            _fmt(lv.itl_ms["p50"]), _fmt(lv.itl_ms["p90"]), _fmt(lv.itl_ms["p99"]), _fmt(lv.e2e_ms["p50"]),
            toks, _fmt(lv.prompt_tokens_mean, 0),
        ])
    return _align(rows) + "\n(times in ms; out tok = output tokens per request, min-max)"


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Closed-loop load generator (OpenAI chat or embeddings API).")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL, ending in /v1")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model id sent in each request")
    p.add_argument("--concurrency", type=_int_list, default="1,16", help="comma list, e.g. 1,16")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per concurrency level (default 2 x concurrency, at least 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate user-message size")
    p.add_argument("--ban-eos", type=int, nargs="*", default=[], metavar="TOKEN_ID",
                   help="token ids to ban with logit_bias -100 (SmolLM2: 0 2)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--same-prompt", action="store_true",
                   help="send the same prompt in every request (default: a different one each)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before each level")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="a JSON object merged into every request body, e.g. '{\"response_format\": {...}}'")
    p.add_argument("--no-stream", action="store_true",
                   help="non-streamed chat completions (no TTFT/ITL; output tokens from usage)")
    p.add_argument("--embed-inputs", type=int, default=0, metavar="N",
                   help="POST /embeddings with N fresh sentences per request instead of chat (reports inputs/s)")
    p.add_argument("--json-out", default=None, metavar="FILE")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> list[LevelResult]:
    spec: RequestSpec | EmbeddingSpec
    if args.embed_inputs > 0:
        spec = EmbeddingSpec(inputs=args.embed_inputs, extra_body=args.extra_body)
    else:
        spec = RequestSpec(max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                           temperature=args.temperature, ban_token_ids=tuple(args.ban_eos),
                           unique_prompts=not args.same_prompt, extra_body=args.extra_body,
                           stream=not args.no_stream)
    levels = []
    for conc in args.concurrency:
        level_spec = replace(spec, prompt_salt=f"c{conc}")
        levels.append(await run_level(args.url, args.model, conc, args.requests, level_spec,
                                      warmup=args.warmup, timeout_s=args.timeout, api_key=args.api_key))
    return levels


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = asyncio.run(_main(args))
    print(format_table(levels))
    for lv in levels:
        for err in lv.error_samples:
            print(f"  concurrency {lv.concurrency} error: {err}", file=sys.stderr)
    if args.json_out:
        payload = {"url": args.url, "model": args.model, "max_tokens": args.max_tokens,
                   "prompt_tokens": args.prompt_tokens, "ban_eos": args.ban_eos,
                   "temperature": args.temperature, "extra_body": args.extra_body,
                   "stream": not args.no_stream, "embed_inputs": args.embed_inputs,
                   "levels": [lv.to_dict() for lv in levels]}
        with open(args.json_out, "w") as fh:
            json.dump(payload, fh, indent=2)
    return 1 if any(lv.errors for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
