"""Robustness runs against a real servelm (issue 13): what a careless or hostile client does to a server, and
what its neighbours see meanwhile. Each run starts `servelm serve` on the default model (127.0.0.1, a free port)
unless `--url` names a server already running, sends bounded traffic to 127.0.0.1 only, and stops by itself.

    .venv/bin/python -m harness.abuse fuzz --bodies 10000 --server-arg=--context-window --server-arg=1024
                                                             # generated bodies: 0 5xx, 0 resets, peak RSS
    .venv/bin/python -m harness.abuse disconnects --n 100      # streams dropped mid-way: every cell freed
    .venv/bin/python -m harness.abuse soak --streams 32 --seconds 300   # RSS over time under steady load
    .venv/bin/python -m harness.abuse burst --n 300            # 300 at once against --max-waiting 16
    .venv/bin/python -m harness.abuse slowloris --n 2000       # slow-header connections beside a normal client

Every run prints one JSON object (also written with `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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

    def __init__(self, args: argparse.Namespace, flags: list[str]) -> None:
        self.args = args
        self.flags = flags
        self.proc: servers.ServerProcess | None = None
        self.url = args.url
        self.pid = args.pid

    def __enter__(self) -> Target:
        if self.url is None:
            port = servers.free_port()
            argv = [str(servers.servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--no-embedding-model", "--chat-embedding-window", "0", *self.flags]
            log = Path(tempfile.mkdtemp(prefix="servelm-abuse-")) / "server.log"
            self.proc = servers.ServerProcess(servers.ServerSpec("servelm", argv, port), log, sample_every_s=0.25)
            self.proc.start()
            asyncio.run(self.proc.wait_ready(120))
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
                async with client.stream("POST", CHAT, json=body) as resp:
                    if resp.status_code != 200:
                        errors[str(resp.status_code)] += 1
                        await resp.aread()
                        continue
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            tokens += 1
                    done += 1
            except httpx.TransportError as exc:
                errors[type(exc).__name__] += 1

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
                     "rss_mib_after": _mib(target.rss_mib())}
    return out


def _mib(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", choices=["fuzz", "disconnects", "soak", "burst", "slowloris", "cheap-bodies"])
    p.add_argument("--url", default=None, help="a server already running (default: start servelm here)")
    p.add_argument("--pid", type=int, default=None, help="with --url: its process, for memory")
    p.add_argument("--server-arg", action="append", default=[], help="a flag for the servelm started here")
    p.add_argument("--bodies", type=int, default=10000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--n", type=int, default=None, help="disconnects: streams (100); burst: requests (300); "
                   "slowloris: connections (2000)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=None, help="soak (300) and slowloris (60)")
    p.add_argument("--stream", action="store_true", help="burst: streamed requests")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = list(args.server_arg)
    if args.run == "burst" and not any(f == "--max-waiting" or f.startswith("--max-waiting=") for f in flags):
        flags += ["--max-waiting", "16"]
    with Target(args, flags) as target:
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
