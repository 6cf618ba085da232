"""Robustness runs against a real servelm (issue 13): what a careless or hostile client does to a server, and
what its neighbours see meanwhile. Each run starts `servelm serve` on the default model (127.0.0.1, a free port)
unless `--url` names a server already running, sends bounded traffic to 127.0.0.1 only, and stops by itself.

    .venv/bin/python -m harness.abuse fuzz --bodies 10000 --server-arg=--context-window --server-arg=1024
                                                             # generated bodies: 0 5xx, 0 resets, peak RSS
    .venv/bin/python -m harness.abuse disconnects --n 100      # streams dropped mid-way: every cell freed
    .venv/bin/python -m harness.abuse soak --streams 32 --seconds 300   # RSS over time under steady load
    .venv/bin/python -m harness.abuse burst --n 300            # 300 at once against --max-waiting 16
    .venv/bin/python -m harness.abuse slowloris --n 2000       # slow-header connections beside a normal client
    .venv/bin/python -m harness.abuse batch-memory --mib 50    # a batch of `[{},{},…]` lines: RSS, /health, loop lag
    .venv/bin/python -m harness.abuse models-dir               # a hostile --models-dir: start-up, refresh, non-models
    .venv/bin/python -m harness.abuse rerank-wait --docs 1024  # a 2-document rerank beside eight big ones
    .venv/bin/python -m harness.abuse starve --seconds 60      # a priority-0 client beside a priority -1000 flood
    .venv/bin/python -m harness.abuse batch-pace --seconds 21  # a key with tpm=200 runs a batch: tokens it used
    .venv/bin/python -m harness.abuse scrape-flood --n 8       # 4 streams alone, then beside 8 tight /metrics scrapers

Every run prints one JSON object (also written with `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import shutil
import socket
import statistics
import string
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from harness import procfs, servers

MODEL = servers.MODEL_ID
CHAT = "/v1/chat/completions"


# -- the server ---------------------------------------------------------------------------------------
class Target:
    """A server to hurt: started here (its process sampled for memory), or one given by URL (and --pid)."""

    def __init__(self, args: argparse.Namespace, flags: list[str], wrap: list[str] | None = None) -> None:
        self.args = args
        self.flags = flags
        self.wrap = wrap or []  # a command servelm runs under (prlimit: its heap capped)
        self.proc: servers.ServerProcess | None = None
        self.url = args.url
        self.pid = args.pid

    def __enter__(self) -> Target:
        if self.url is None:
            port = servers.free_port()
            argv = [*self.wrap, str(servers.servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--no-embedding-model", "--chat-embedding-window", "0", *self.flags]
            log = Path(tempfile.mkdtemp(prefix="servelm-abuse-")) / "server.log"
            self.proc = servers.ServerProcess(servers.ServerSpec("servelm", argv, port), log, sample_every_s=0.25)
            self.proc.start()
            try:  # a busy machine: the self-check at start takes minutes with many slots
                asyncio.run(self.proc.wait_ready(300))
            except BaseException:
                self.proc.stop()  # __exit__ does not run when __enter__ fails
                raise
            self.url = self.proc.spec.root_url
            self.pid = self.proc.proc.pid if self.proc.proc else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.stop()

    def rss_mib(self) -> float | None:
        return procfs.tree_rss_kib(self.pid) / 1024 if self.pid else None

    def peak_rss_mib(self) -> float | None:
        if self.proc is not None:
            return max(self.proc.peak_rss_kib, procfs.tree_rss_kib(self.pid or 0)) / 1024
        return procfs.status_kib(self.pid, "VmHWM") / 1024 if self.pid else None

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()["deployments"][MODEL]


def wait_idle(target: Target, timeout_s: float = 60) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        h = target.health()
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_cells_used"] == 0:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


# -- fuzz: generated bodies -----------------------------------------------------------------------------
ROUTES = [CHAT, "/v1/completions", "/v1/embeddings", "/chat/completions?api-version=2024-05-01-preview",
          "/invocations", "/v3/chat/completions", "/v3/completions"]
FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "best_of", "max_tokens", "stop", "logit_bias",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs", "top_logprobs", "stream",
          "response_format", "tools", "tool_choice", "guided_choice", "guided_regex", "guided_json",
          "structured_outputs", "use_beam_search", "length_penalty", "diversity_penalty", "num_beam_groups",
          "min_tokens", "ignore_eos", "stop_token_ids", "echo", "suffix", "cache_salt", "stream_options",
          "max_completion_tokens", "parallel_tool_calls", "include_stop_str_in_output", "skip_special_tokens"]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e-320", "9" * 40, "-0", "18446744073709551616"]


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, n: int | None = None) -> str:
        r = self.rng
        n = n if n is not None else r.choice([0, 1, 5, 20, 200, 5000])
        alphabet = string.printable + "éß日本🙂\u200b\ue000<|>" + "".join(["<|im_start|>", "<|im_end|>"])
        return "".join(r.choice(alphabet) for _ in range(n))

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        kinds = ["int", "float", "str", "bool", "null", "list", "dict", "big", "neg"]
        kind = r.choice(kinds if depth < 3 else kinds[:5])
        return {"int": lambda: r.randint(-5, 200), "float": lambda: r.uniform(-3, 3), "str": lambda: self.text(),
                "bool": lambda: r.random() < 0.5, "null": lambda: None, "big": lambda: r.choice([2**31, 2**63, 10**30]),
                "neg": lambda: -r.randint(1, 10**6),
                "list": lambda: [self.value(depth + 1) for _ in range(r.randint(0, 4))],
                "dict": lambda: {self.text(5): self.value(depth + 1) for _ in range(r.randint(0, 4))}}[kind]()

    def messages(self) -> Any:
        r = self.rng
        roles = ["system", "user", "assistant", "tool", "developer", "robot", ""]
        out = []
        for _ in range(r.randint(0, 4)):
            m: dict[str, Any] = {"role": r.choice(roles), "content": self.text()}
            if r.random() < 0.2:
                m["content"] = [{"type": r.choice(["text", "image_url", "audio"]), "text": self.text(10)}]
            if r.random() < 0.1:
                m["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": self.text(20)}}]
            out.append(m)
        return out or [{"role": "user", "content": "hi"}]

    def valid(self, route: str) -> dict[str, Any]:
        r = self.rng
        if "embeddings" in route:
            return {"model": MODEL, "input": r.choice([self.text(20), [self.text(10)] * r.randint(1, 5), [1, 2, 3]])}
        if "completions" in route and "chat" not in route:
            return {"model": MODEL, "prompt": self.text(r.randint(1, 50)), "max_tokens": r.randint(1, 8)}
        return {"model": MODEL, "messages": self.messages(), "max_tokens": r.randint(1, 8)}

    def body(self) -> tuple[str, bytes, dict[str, str]]:
        """(route, raw body, headers): a valid body with a few mutations, or malformed bytes, or a wrong type."""
        r = self.rng
        route = r.choice(ROUTES)
        headers = {"content-type": "application/json"}
        roll = r.random()
        if roll < 0.04:
            return route, bytes(r.randrange(256) for _ in range(r.randint(0, 300))), headers
        if roll < 0.07:
            return route, b'{"model": "%s", "messages": [' % MODEL.encode(), headers
        if roll < 0.09:
            return route, json.dumps(self.valid(route)).encode(), {"content-type": r.choice(["text/plain", ""])}
        body = self.valid(route)
        raw_numbers: dict[str, str] = {}
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            name = r.choice(FIELDS + ["model", "messages", "prompt", "input", "unknown_" + self.text(3)])
            action = r.random()
            if action < 0.15:
                body.pop(name, None)
            elif action < 0.25:
                raw_numbers[name] = r.choice(RAW_NUMBERS)
            else:
                body[name] = self.value()
        if body.get("stream") is True and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
            body["max_tokens"] = 16  # keep a valid stream short
        text = json.dumps(body)
        for name, raw in raw_numbers.items():  # numbers JSON cannot carry, as lenient encoders write them
            text = text[:-1] + f', "{name}": {raw}}}'
        return route, text.encode(), headers


async def fuzz(target: Target, bodies: int, workers: int, seed: int) -> dict[str, Any]:
    fuzzer = Fuzzer(seed)
    jobs = [fuzzer.body() for _ in range(bodies)]
    from tests.http.abuse_corpus import cases  # the probe's own bodies go first

    jobs = [(c.path, c.body, c.headers) for c in cases(MODEL)] + jobs
    statuses: Counter[int] = Counter()
    resets: list[str] = []  # the connection broke (reset, closed mid-answer): never acceptable
    timeouts = 0  # the client gave up waiting (a long answer): counted apart, it is not the server failing
    slow: list[tuple[float, int, str, str]] = []  # the slowest requests: (seconds, status, route, body)
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker() -> None:
        nonlocal timeouts
        async with httpx.AsyncClient(base_url=target.url, timeout=300) as client:
            while not queue.empty():
                route, body, headers = queue.get_nowait()
                start = time.monotonic()
                status = 0
                try:
                    async with client.stream("POST", route, content=body, headers=headers) as resp:
                        await resp.aread()
                        status = resp.status_code
                        statuses[status] += 1
                except httpx.TimeoutException:
                    timeouts += 1
                except httpx.TransportError as exc:
                    resets.append(f"{route}: {type(exc).__name__}: {exc}")
                slow.append((time.monotonic() - start, status, route, body[:400].decode(errors="replace")))
                slow.sort(reverse=True)
                del slow[5:]

    start = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(workers)])
    return {"bodies": len(jobs), "seconds": round(time.monotonic() - start, 1), "statuses": dict(sorted(statuses.items())),
            "5xx": sum(n for s, n in statuses.items() if s >= 500), "connection_errors": len(resets),
            "client_timeouts": timeouts,
            "errors_sample": resets[:5], "slowest": [(round(s, 2), st, r, b) for s, st, r, b in slow],
            "peak_rss_mib": _mib(target.peak_rss_mib()),
            "idle_after_s": wait_idle(target)}


# -- disconnects -----------------------------------------------------------------------------------------
async def disconnects(target: Target, n: int, concurrency: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "stream": True, "logit_bias": {"0": -100, "2": -100}}
    dropped = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal dropped
        async with sem:
            async with client.stream("POST", CHAT, json=body) as resp:
                chunks = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                    if chunks >= 3:
                        dropped += 1
                        break  # leaving the block closes the connection mid-stream

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=target.url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        await asyncio.gather(*[one(c) for _ in range(n)])
    idle = wait_idle(target)
    h = target.health()
    return {"streams_dropped": dropped, "seconds": round(time.monotonic() - start, 1), "idle_after_s": idle,
            "kv_cells_used_after": h["kv_cells_used"], "running_after": h["running"], "waiting_after": h["waiting"],
            "peak_rss_mib": _mib(target.peak_rss_mib())}


# -- soak --------------------------------------------------------------------------------------------------
async def soak(target: Target, streams: int, seconds: float, sample_s: float = 5.0) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64,
            "stream": True, "temperature": 0.7, "logit_bias": {"0": -100, "2": -100}}
    done = 0
    tokens = 0
    errors: Counter[str] = Counter()
    rss: list[tuple[float, float]] = []
    stop_at = time.monotonic() + seconds
    start = time.monotonic()

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal done, tokens
        while time.monotonic() < stop_at:
            try:
                got = await _streamed_chunks(client, body, errors)
            except httpx.TransportError as exc:
                errors[type(exc).__name__] += 1
                continue
            if got is not None:
                tokens += got
                done += 1

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            rss.append((round(time.monotonic() - start, 1), _mib(target.rss_mib()) or 0.0))
            await asyncio.sleep(sample_s)

    async with httpx.AsyncClient(base_url=target.url, timeout=120,
                                 limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(sampler(), *[loop(client) for _ in range(streams)])
    warm = [m for t, m in rss if t >= min(60.0, seconds / 5)] or [m for _, m in rss]
    return {"streams": streams, "seconds": seconds, "requests": done, "tokens_per_s": round(tokens / seconds, 1),
            "errors": dict(errors), "rss_mib_first": warm[0] if warm else None, "rss_mib_last": warm[-1] if warm else None,
            "rss_mib_max": max(warm) if warm else None, "rss_samples": rss, "idle_after_s": wait_idle(target)}


async def _streamed_chunks(client: httpx.AsyncClient, body: dict[str, Any], errors: Counter[str]) -> int | None:
    """One streamed chat: its chunks with text (None, the status counted in `errors`, when it is not a 200)."""
    async with client.stream("POST", CHAT, json=body) as resp:
        if resp.status_code != 200:
            errors[str(resp.status_code)] += 1
            await resp.aread()
            return None
        return sum([line.startswith("data: {") and '"content":"' in line and '"content":""' not in line
                    async for line in resp.aiter_lines()])


# -- scrape-flood --------------------------------------------------------------------------------------------
async def scrape_flood(target: Target, scrapers: int, seconds: float, streams: int = 4) -> dict[str, Any]:
    """`streams` clients streaming 64-token chats for `seconds` alone, then as long beside `scrapers` clients that
    scrape /metrics back to back: the streams' tokens a second both ways, and the scrapes a second."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64,
            "stream": True, "temperature": 0, "ignore_eos": True}

    async def level(flood: int) -> tuple[float, float, Counter[str]]:
        tokens = scrapes = 0
        errors: Counter[str] = Counter()
        stop_at = time.monotonic() + seconds

        async def stream(client: httpx.AsyncClient) -> None:
            nonlocal tokens
            while time.monotonic() < stop_at:
                tokens += await _streamed_chunks(client, body, errors) or 0

        async def scrape(client: httpx.AsyncClient) -> None:
            nonlocal scrapes
            while time.monotonic() < stop_at:
                resp = await client.get("/metrics")
                if resp.status_code != 200:
                    errors[f"metrics {resp.status_code}"] += 1
                scrapes += 1

        async with httpx.AsyncClient(base_url=target.url, timeout=120,
                                     limits=httpx.Limits(max_connections=streams + flood + 4)) as client:
            await asyncio.gather(*[stream(client) for _ in range(streams)], *[scrape(client) for _ in range(flood)])
        return round(tokens / seconds, 1), round(scrapes / seconds, 1), errors

    alone, _, errors = await level(0)
    flooded, scrapes_per_s, more = await level(scrapers)
    return {"streams": streams, "scrapers": scrapers, "seconds": seconds, "tokens_per_s_alone": alone,
            "tokens_per_s_beside_scrapers": flooded, "scrapes_per_s": scrapes_per_s, "errors": dict(errors + more)}


# -- burst -------------------------------------------------------------------------------------------------
async def burst(target: Target, n: int, stream: bool) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16, "stream": stream}
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    errors: list[str] = []

    async def one(client: httpx.AsyncClient) -> None:
        start = time.monotonic()
        try:
            async with client.stream("POST", CHAT, json=body) as resp:
                text = (await resp.aread()).decode(errors="replace")
                statuses[resp.status_code] += 1
                if resp.status_code == 200:
                    latencies.append(time.monotonic() - start)
                    if stream and '"error"' in text:
                        errors.append("an error event in a stream")
        except httpx.TransportError as exc:
            errors.append(type(exc).__name__)

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=target.url, timeout=300, limits=httpx.Limits(max_connections=n + 8)) as c:
        await asyncio.gather(*[one(c) for _ in range(n)])
    lat = sorted(latencies)
    return {"requests": n, "stream": stream, "seconds": round(time.monotonic() - start, 1),
            "statuses": dict(sorted(statuses.items())), "errors": errors[:5],
            "latency_s_p50": round(statistics.median(lat), 2) if lat else None,
            "latency_s_max": round(lat[-1], 2) if lat else None, "idle_after_s": wait_idle(target)}


# -- slowloris --------------------------------------------------------------------------------------------
def slowloris(target: Target, n: int, seconds: float) -> dict[str, Any]:
    """n connections that send a request's headers a byte every second, beside one client asking every 0.5 s."""
    host, port = "127.0.0.1", int(target.url.rsplit(":", 1)[1])
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + b"x-pad: a\r\n" * 50
    stop = time.monotonic() + seconds
    socks: list[socket.socket] = []
    opened = refused = 0

    def attacker() -> None:
        nonlocal opened, refused
        for _ in range(n):
            try:
                s = socket.create_connection((host, port), timeout=2)
                s.setblocking(False)
                socks.append(s)
                opened += 1
            except OSError:
                refused += 1
        i = 0
        while time.monotonic() < stop:
            for s in list(socks):
                try:
                    s.send(request[i % len(request):i % len(request) + 1])
                except OSError:
                    socks.remove(s)
                    s.close()
                    try:  # a dropped one comes back: the pressure stays
                        fresh = socket.create_connection((host, port), timeout=2)
                        fresh.setblocking(False)
                        socks.append(fresh)
                    except OSError:
                        refused += 1
            i += 1
            time.sleep(1.0)

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    ok, failed, latencies = 0, 0, []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    time.sleep(2)
    while time.monotonic() < stop:
        start = time.monotonic()
        try:
            r = httpx.post(target.url + CHAT, json=body, timeout=30)
            ok += r.status_code == 200
            failed += r.status_code != 200
            latencies.append(time.monotonic() - start)
        except httpx.TransportError:
            failed += 1
        time.sleep(0.5)
    thread.join()
    for s in socks:
        s.close()
    lat = sorted(latencies)
    return {"slow_connections": n, "seconds": seconds, "opened": opened, "refused_or_reopened_failures": refused,
            "client_ok": ok, "client_failed": failed, "client_latency_s_p50": round(statistics.median(lat), 3) if lat else None,
            "client_latency_s_max": round(lat[-1], 3) if lat else None}


# -- cheap bodies: large requests that must be refused for less than a small constant -------------------------------
def cheap_bodies(target: Target) -> dict[str, Any]:
    """Bodies near the body limit that cannot be served (too many messages, too long a prompt), each sent alone:
    the time to its 4xx and the server's memory after it."""
    big = {
        "chat: 200,000 one-character messages": ("/v1/chat/completions", {"max_tokens": 4, "messages": [{"role": "user", "content": "a"}] * 200_000}),
        "chat: 2,048 messages of 3 KB": ("/v1/chat/completions", {"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 600}] * 2048}),
        "chat: one 6 MB message": ("/v1/chat/completions", {"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 1_200_000}]}),
        "responses: 200,000 input items": ("/v1/responses", {"max_output_tokens": 4, "input": [{"role": "user", "content": "a"}] * 200_000}),
        "messages: 200,000 messages": ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "a"}] * 200_000}),
    }
    out: dict[str, Any] = {"rss_mib_before": _mib(target.rss_mib())}
    for name, (path, body) in big.items():
        data = json.dumps({"model": MODEL, **body}).encode()
        start = time.monotonic()
        r = httpx.post(target.url + path, content=data, headers={"content-type": "application/json"}, timeout=300)
        out[name] = {"mb": round(len(data) / 1e6, 1), "status": r.status_code, "seconds": round(time.monotonic() - start, 3),
                     "rss_mib_after": _mib(target.rss_mib()), "peak_rss_mib": _mib(target.peak_rss_mib())}
    return out


# -- shared by the runs below: the loop's lag, and what the server looks like while something runs ----------------
LAG = "servelm_event_loop_lag_seconds"


def loop_lag(url: str, headers: dict[str, str] | None = None, bound_s: float = 0.5) -> dict[str, Any]:
    """The server's own loop monitor (/metrics): timers observed, those later than `bound_s`, and the longest lag
    since the server started (servelm_event_loop_lag_max_seconds)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=60).text
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    ticks = over = 0.0
    longest: float | None = None
    edge: tuple[float, float] | None = None  # (le, count) of the highest bucket at or below the bound
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(LAG + "_bucket"):
            le = float(name.split('le="', 1)[1].split('"', 1)[0])
            if le <= bound_s and (edge is None or le > edge[0]):
                edge = (le, float(value))
        elif name.startswith(LAG + "_count"):
            ticks = float(value)
        elif name.startswith("servelm_event_loop_lag_max_seconds"):
            longest = round(float(value), 3)
    if edge is not None:
        over = ticks - edge[1]
    return {"ticks": int(ticks), f"over_{bound_s:g}_s": int(over), "longest_s": longest}


def _lag_during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the loop monitor saw between two readings: ticks, those over the bound, and the longest since start."""
    if "error" in before or "error" in after:
        return {"before": before, "after": after}
    over = next(k for k in after if k.startswith("over_"))
    return {"ticks": after["ticks"] - before["ticks"], over: after[over] - before[over],
            "longest_since_start_s": after["longest_s"]}


class Watch:
    """While the block runs: the server's peak RSS (its process tree, every 20 ms) and the slowest answer to /health
    (asked every 50 ms)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.peak_mib = target.rss_mib() or 0.0
        self.slowest_health_s = 0.0
        self.health_failures = 0
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._rss, daemon=True), threading.Thread(target=self._health, daemon=True)]

    def _rss(self) -> None:
        while not self._done.is_set():
            self.peak_mib = max(self.peak_mib, self.target.rss_mib() or 0.0)
            time.sleep(0.02)

    def _health(self) -> None:
        with httpx.Client(base_url=self.target.url, timeout=120) as client:
            while not self._done.is_set():
                start = time.monotonic()
                try:
                    client.get("/health")
                except httpx.HTTPError:
                    self.health_failures += 1
                self.slowest_health_s = max(self.slowest_health_s, time.monotonic() - start)
                time.sleep(0.05)

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for t in self._threads:
            t.join(130)

    def result(self) -> dict[str, Any]:
        return {"rss_mib_peak": _mib(self.peak_mib if self.target.pid else None),
                "slowest_health_s": round(self.slowest_health_s, 3), "health_failures": self.health_failures}


BATCH_ENDED = ("completed", "failed", "cancelled", "expired")


# -- batch-memory: a batch of `[{},{},…]` lines, validated and run a line at a time -----------------------------------
def batch_memory(target: Target, mib: int, timeout_s: float = 600) -> dict[str, Any]:
    """A file of `mib` MiB whose lines each hold a list of 3,333 `{}` (3 bytes of JSON each, ~64 bytes once parsed;
    `stream` makes each line a 400 of its own, so what they cost is the reading): uploaded, then run as a batch while
    the server's RSS, /health and its loop's lag are watched. The whole file parsed at once took ~25x its size."""

    def line(i: int) -> bytes:
        return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                           "body": {"stream": True, "messages": [{}] * 3333}}, separators=(",", ":")).encode() + b"\n"

    n = max(1, mib * 2**20 // len(line(0)))
    data = b"".join(line(i) for i in range(n))
    out: dict[str, Any] = {"file_mib": round(len(data) / 2**20, 1), "lines": n, "rss_mib_before": _mib(target.rss_mib())}
    start = time.monotonic()
    f = httpx.post(target.url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}, timeout=600)
    del data
    out["upload_s"] = round(time.monotonic() - start, 2)
    if f.status_code != 200:
        return {**out, "upload_status": f.status_code, "upload_error": f.text[:400]}
    out["rss_mib_after_upload"] = _mib(target.rss_mib())
    lag_before = loop_lag(target.url)
    batch: dict[str, Any] = {}
    with Watch(target) as watch:
        start = time.monotonic()
        b = httpx.post(target.url + "/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": CHAT,
                                                         "completion_window": "24h"}, timeout=600)
        if b.status_code != 200:
            return {**out, "batch_status_code": b.status_code, "batch_error": b.text[:400]}
        while time.monotonic() - start < timeout_s:
            batch = httpx.get(f"{target.url}/v1/batches/{b.json()['id']}", timeout=600).json()
            if batch["status"] in BATCH_ENDED:
                break
            time.sleep(0.2)
        ran_s = time.monotonic() - start
    rss_after = target.rss_mib()
    return {**out, "batch_status": batch.get("status"), "request_counts": batch.get("request_counts"),
            "batch_s": round(ran_s, 1), **watch.result(),
            "rss_mib_growth_over_upload": _mib(watch.peak_mib - out["rss_mib_after_upload"]) if target.pid else None,
            "rss_mib_after": _mib(rss_after), "loop_lag": _lag_during(lag_before, loop_lag(target.url))}


# -- models-dir: a careless operator's directory, and clients naming what is not a model ----------------------------
NON_MODELS = ["mmproj-vision", "split-00002-of-00002", "two", "empty", "piped", "x", "mmproj-model-0",
              "model-0-00002-of-00002", "not-one", "x" * 300, "../models", "a\0b", "model-0.gguf", "nothing-here"]


def hostile_models_dir(root: Path) -> Path:
    """tests/adversarial/test_models_dir.py's hostile headers, FIFOs, projector, shards and folders, beside twelve
    plausible models (30,000-token vocabularies) and a vision model's folder."""
    from tests.adversarial.test_models_dir import crowd, hostile_dir

    return crowd(hostile_dir(root / "models"))


def models_dir(target: Target, directory: Path, rounds: int) -> dict[str, Any]:
    from tests.adversarial.test_models_dir import HOSTILE

    def chat(model: str) -> tuple[int, str, float]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        start = time.monotonic()
        r = httpx.post(target.url + CHAT, content=json.dumps(body), headers={"content-type": "application/json"},
                       timeout=120)
        try:
            code = str(r.json()["error"]["code"])
        except (ValueError, KeyError, TypeError):
            code = r.text[:80]
        return r.status_code, code, time.monotonic() - start

    hwm_mib = lambda: procfs.status_kib(target.pid, "VmHWM") / 1024 if target.pid else None  # noqa: E731
    out: dict[str, Any] = {"startup_to_health_s": round(target.proc.ready_s, 1) if target.proc and target.proc.ready_s
                           else None, "vmhwm_mib_at_start": _mib(hwm_mib()), "rss_mib_at_start": _mib(target.rss_mib())}
    lag_before = loop_lag(target.url)
    with Watch(target) as watch:
        start = time.monotonic()
        r = httpx.post(target.url + "/models/refresh", timeout=120)
        models = r.json().get("models", []) if r.status_code == 200 else []
        out["refresh"] = {"status": r.status_code, "seconds": round(time.monotonic() - start, 2), "models": len(models),
                          "non_models_listed": sorted(set(NON_MODELS) & set(models))}
        (directory / "late.gguf").write_bytes(HOSTILE["huge-strings"])  # dropped in at runtime, then named
        late = [chat("late") for _ in range(3)]
        out["late_hostile_file"] = [{"status": s, "code": c, "seconds": round(t, 2)} for s, c, t in late]
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(chat, NON_MODELS * rounds))
        lat = sorted(t for _, _, t in answers)
        out["non_models"] = {"requests": len(answers), "concurrency": 8, "seconds": round(time.monotonic() - start, 2),
                             "statuses": dict(Counter(f"{s} {c}" for s, c, _ in answers)),
                             "latency_ms_p50": round(statistics.median(lat) * 1000, 1),
                             "latency_ms_max": round(lat[-1] * 1000, 1)}
    after = hwm_mib()
    return {**out, **watch.result(), "vmhwm_mib_growth_after_start":
            _mib(after - out["vmhwm_mib_at_start"]) if after is not None and out["vmhwm_mib_at_start"] is not None
            else None, "loop_lag": _lag_during(lag_before, loop_lag(target.url))}


# -- rerank-wait: another key's small rerank beside one key's big ones ------------------------------------------------
def rerank_wait(target: Target, docs: int, n: int) -> dict[str, Any]:
    """n reranks of `docs` documents each from sk-big, then (once the engine holds them, at most 3 s later) a
    2-document rerank from sk-small: how long the small one waits. Eight 1,024-document ones made it wait 161 s (first come, first served)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def body(documents: list[str]) -> dict[str, Any]:
        return {"model": servers.EMBEDDING_MODEL_ID, "query": "which document is about gamma", "documents": documents}

    def big(r: int) -> tuple[int, float, float]:
        documents = [f"document {r}-{i} about {words[i % 10]} and {words[(i // 10) % 10]}" for i in range(docs)]
        sent = time.monotonic()
        resp = httpx.post(target.url + "/v1/rerank", json=body(documents), timeout=600,
                          headers={"Authorization": "Bearer sk-big"})
        return resp.status_code, time.monotonic() - sent, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        start = time.monotonic()
        futures = [pool.submit(big, r) for r in range(n)]
        while time.monotonic() - start < 3:  # until the engine holds the big ones (at most 3 s)
            health = httpx.get(target.url + "/health", headers={"Authorization": "Bearer sk-small"},  # keys on
                               timeout=30).json().get("deployments", {})
            engine = health.get(servers.EMBEDDING_MODEL_ID, {})
            if engine.get("running", 0) + engine.get("waiting", 0) >= n:
                break
            time.sleep(0.05)
        asked = time.monotonic()
        small = httpx.post(target.url + "/v1/rerank", json=body(["Paris is in France.", "gamma rays"]), timeout=600,
                           headers={"Authorization": "Bearer sk-small"})
        small_done = time.monotonic() - start
        waited = time.monotonic() - asked
        bigs = [f.result() for f in futures]
    return {"big_requests": n, "docs_each": docs, "small_sent_after_s": round(asked - start, 2),
            "small_status": small.status_code, "small_latency_s": round(waited, 2),
            "big_statuses": dict(Counter(s for s, _, _ in bigs)),
            "big_durations_s": sorted(round(d, 1) for _, d, _ in bigs),
            "bigs_done_before_small": sum(end < small_done for _, _, end in bigs),
            "all_done_s": round(max(end for _, _, end in bigs), 1)}


# -- starve: a priority-0 client beside a flood at priority -1000 ------------------------------------------------------
def starve(target: Target, threads: int, seconds: float, aging_s: float | None) -> dict[str, Any]:
    """`threads` clients send priority -1000 requests without pause for `seconds`; meanwhile one client sends
    priority-0 requests one after another. Aging used to count every level (1,000 levels: the flood's whole length);
    it now counts priorities within ±AGING_SPAN, so a priority-0 request waits about AGING_SPAN levels of aging."""
    from servelm.engine.fairness import AGING_SPAN

    stop = time.monotonic() + seconds
    flood_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True,
                  "priority": -1000}
    flood_statuses: Counter[str] = Counter()

    def flood() -> None:
        with httpx.Client(base_url=target.url, timeout=seconds + 120) as client:
            while time.monotonic() < stop:
                try:
                    flood_statuses[str(client.post(CHAT, json=flood_body).status_code)] += 1
                except httpx.TransportError as exc:
                    flood_statuses[type(exc).__name__] += 1

    workers = [threading.Thread(target=flood, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    time.sleep(min(1.0, seconds / 4))  # the flood holds every slot and the queue
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "priority": 0}
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    after_flood = 0
    with httpx.Client(base_url=target.url, timeout=seconds + 120) as client:
        while time.monotonic() < stop:
            sent = time.monotonic()
            statuses[client.post(CHAT, json=body).status_code] += 1
            latencies.append(time.monotonic() - sent)
            after_flood += time.monotonic() > stop  # it got through only once the flood had ended
        for t in workers:
            t.join(seconds + 130)
        wait_idle(target)
        sent = time.monotonic()
        alone = client.post(CHAT, json=body)
        alone_s = time.monotonic() - sent
    lat = sorted(latencies)
    return {"flood_threads": threads, "flood_priority": -1000, "seconds": seconds, "priority_aging_s": aging_s,
            "expected_wait_bound_s": round(2 * AGING_SPAN * aging_s + 2.0, 1) if aging_s is not None else None,
            "flood_statuses": dict(flood_statuses), "priority_0_requests": len(lat),
            "priority_0_statuses": dict(statuses), "priority_0_latency_s_p50": round(statistics.median(lat), 2) if lat
            else None, "priority_0_latency_s_max": round(lat[-1], 2) if lat else None,
            "priority_0_answered_after_flood_ended": after_flood,
            "priority_0_alone_s": round(alone_s, 2) if alone.status_code == 200 else alone.status_code}


# -- batch-pace: a key's tokens per minute hold for its batch lines ----------------------------------------------------
PACE_KEYS = "sk-x tpm=200\nsk-free\n"  # the paced key, and one without limits to price a line


def batch_pace(target: Target, seconds: float, lines: int, tpm: int = 200) -> dict[str, Any]:
    """sk-x (tpm=200) uploads a batch of `lines` chat lines and runs it; the tokens it used after `seconds` must stay
    within the bucket (tpm) and its refill. Lines skipped the key's limits: 1,717 tokens in 21 s."""
    auth = {"Authorization": "Bearer sk-x"}
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "ignore_eos": True}
    usage = httpx.post(target.url + CHAT, json=request, headers={"Authorization": "Bearer sk-free"}, timeout=120).json()
    cost = int(usage["usage"]["total_tokens"])
    data = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": request}).encode() + b"\n"
                    for i in range(lines))
    f = httpx.post(target.url + "/v1/files", headers=auth, files={"file": ("in.jsonl", data)},
                   data={"purpose": "batch"}, timeout=120)
    if f.status_code != 200:
        return {"upload_status": f.status_code, "upload_error": f.text[:400]}
    b = httpx.post(target.url + "/v1/batches", headers=auth, timeout=120,
                   json={"input_file_id": f.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
    if b.status_code != 200:
        return {"batch_status_code": b.status_code, "batch_error": b.text[:400]}
    start = time.monotonic()
    time.sleep(seconds)
    got = httpx.get(f"{target.url}/v1/batches/{b.json()['id']}", headers=auth, timeout=120).json()
    elapsed = time.monotonic() - start
    own = httpx.post(target.url + CHAT, json=request, headers=auth, timeout=120)
    httpx.post(f"{target.url}/v1/batches/{b.json()['id']}/cancel", headers=auth, timeout=120)  # the rest: not needed
    used = int((got.get("usage") or {}).get("total_tokens", 0))
    bound = tpm + tpm / 60 * elapsed + cost
    return {"tpm": tpm, "lines": lines, "line_cost_tokens": cost, "window_s": round(elapsed, 1), "tokens_used": used,
            "bound_tokens": round(bound), "within_bound": used <= bound, "request_counts": got.get("request_counts"),
            "own_request_meanwhile": {"status": own.status_code, "retry_after": own.headers.get("retry-after")}}


def _mib(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", choices=["fuzz", "disconnects", "soak", "burst", "slowloris", "cheap-bodies", "batch-memory",
                                   "models-dir", "rerank-wait", "starve", "batch-pace", "scrape-flood"])
    p.add_argument("--url", default=None, help="a server already running (default: start servelm here; models-dir "
                   "always starts its own). rerank-wait needs keys sk-big and sk-small on it, batch-pace sk-x "
                   "(tpm=200) and sk-free, batch-memory and batch-pace a --state-dir")
    p.add_argument("--pid", type=int, default=None, help="with --url: its process, for memory")
    p.add_argument("--server-arg", action="append", default=[], help="a flag for the servelm started here")
    p.add_argument("--bodies", type=int, default=10000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--n", type=int, default=None, help="disconnects: streams (100); burst: requests (300); "
                   "slowloris: connections (2000); rerank-wait: big reranks (8); starve: flood threads (6); "
                   "batch-pace: lines (200); models-dir: rounds of the non-model names, 8 at once (6); "
                   "scrape-flood: clients scraping /metrics (8)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=None, help="soak (300), slowloris (60), starve: the flood (60), "
                   "batch-pace: the window (21), scrape-flood: each level (20)")
    p.add_argument("--stream", action="store_true", help="burst: streamed requests")
    p.add_argument("--mib", type=int, default=50, help="batch-memory: the batch file's size")
    p.add_argument("--docs", type=int, default=1024, help="rerank-wait: documents in each big rerank")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _flag(flags: list[str], name: str) -> str | None:
    """The value of `name` among servelm's flags (`--name V` or `--name=V`), the last one given; None if absent."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def _default(flags: list[str], name: str, value: str) -> None:
    if _flag(flags, name) is None:
        flags += [name, value]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = list(args.server_arg)
    wrap: list[str] = []
    scratch = tempfile.TemporaryDirectory(prefix="servelm-abuse-")  # state, keys, models: gone after the run
    root = Path(scratch.name)
    if args.run == "burst":
        _default(flags, "--max-waiting", "16")
    elif args.run == "batch-memory":
        _default(flags, "--state-dir", str(root / "state"))
        _default(flags, "--batch-max-file-mib", str(max(200, args.mib + 1)))
    elif args.run == "models-dir":
        if args.url is not None:
            raise SystemExit("models-dir starts its own server over the directory it makes: drop --url")
        flags += ["--models-dir", str(hostile_models_dir(root))]
        if shutil.which("prlimit"):  # its heap capped, so that a regression fails the run, not the machine
            wrap = ["prlimit", f"--data={3 << 30}"]
    elif args.run == "rerank-wait":
        flags += ["--embedding-model", "--api-key", "sk-big", "--api-key", "sk-small"]
        _default(flags, "--threads", "2")
    elif args.run == "starve":
        _default(flags, "--max-num-seqs", "2")
        _default(flags, "--priority-aging-s", "1")  # whole seconds; the default 60 s a level: a 20-minute bound
    elif args.run == "batch-pace":
        (root / "keys").write_text(PACE_KEYS)
        flags += ["--api-key-file", str(root / "keys")]
        _default(flags, "--state-dir", str(root / "state"))
    with scratch, Target(args, flags, wrap) as target:
        if args.run == "fuzz":
            result = asyncio.run(fuzz(target, args.bodies, args.workers, args.seed))
        elif args.run == "disconnects":
            result = asyncio.run(disconnects(target, args.n or 100, 8))
        elif args.run == "soak":
            result = asyncio.run(soak(target, args.streams, args.seconds or 300))
        elif args.run == "burst":
            result = asyncio.run(burst(target, args.n or 300, args.stream))
        elif args.run == "cheap-bodies":
            result = cheap_bodies(target)
        elif args.run == "batch-memory":
            result = batch_memory(target, args.mib)
        elif args.run == "models-dir":
            result = models_dir(target, root / "models", args.n or 6)
        elif args.run == "rerank-wait":
            result = rerank_wait(target, args.docs, args.n or 8)
        elif args.run == "starve":
            aging = _flag(flags, "--priority-aging-s") if args.url is None else None
            result = starve(target, args.n or 6, args.seconds or 60, float(aging) if aging is not None else None)
        elif args.run == "batch-pace":
            result = batch_pace(target, args.seconds or 21, args.n or 200)
        elif args.run == "scrape-flood":
            result = asyncio.run(scrape_flood(target, args.n or 8, args.seconds or 20))
        else:
            result = slowloris(target, args.n or 2000, args.seconds or 60)
        result = {"run": args.run, "server_flags": flags, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
