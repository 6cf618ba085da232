"""The server's own CPU time per generated token: where servelm spends it outside the forward pass.

    .venv/bin/python -m harness.cpu_per_token                        # SmolLM2, 1 and 16 streams
    .venv/bin/python -m harness.cpu_per_token --model gemma3 --logprobs 5
    .venv/bin/python -m harness.cpu_per_token --model gemma3 --temperature 0.7 --streams 16 --body '{"top_k": 40}'
    .venv/bin/python -m harness.cpu_per_token --streams 1,4,16 --requests 8

It starts `servelm serve` on the model (as harness/compare.py does, on its defaults; one llama.cpp thread by default,
so that a busy machine stalls no barrier of the pass: the figures are the server's CPU outside it), runs streamed
chats at each level of streams (temperature 0 unless --temperature, max_tokens fixed by banning the model's end tokens with logit_bias), and reads
/metrics before and after each level. Per generated token it reports, in ms: each phase of the engine thread
(`servelm_engine_phase_seconds_total`: wall time, which is CPU time on a quiet machine), the engine thread's CPU time
and the part of it outside the model's pass (less its decode and runner phases), the CPU time of the threads that share
a step's whole-row sampling passes with it (servelm-sample), and the event loop thread's CPU time
with its parts in the streams' chunks (`servelm_stream_cpu_seconds_total`: serialize, write; `rest`: the hop from the
engine, the service layers, HTTP), and the garbage collector's pauses, whichever thread they fell on
(`servelm_gc_pause_seconds_total`). `sample+logprobs a step` is the figure of Gemma 3's large vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from harness import models, procfs, servers
from servelm.bench.loadgen import RequestSpec, run_level
from servelm.bench.workloads import named
from servelm.engine.clock import PHASES
from servelm.engine.sampling import HELPER_THREAD

# the engine's own phases outside the model's pass (decode, runner) and its waits (idle)
OWN_PHASES = tuple(p for p in PHASES if p not in ("decode", "runner", "idle"))


def scrape(url: str) -> dict[str, float]:
    """The counters this harness reads: `phase:NAME`, `thread:NAME`, `stream:PART`, steps and tokens generated."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}

    def add(key: str, value: str) -> None:
        found[key] = found.get(key, 0.0) + float(value)

    for phase, value in re.findall(r'^servelm_engine_phase_seconds_total{[^}]*phase="(\w+)"[^}]*} (\S+)$', text, re.M):
        add(f"phase:{phase}", value)
    for thread, value in re.findall(r'^servelm_thread_cpu_seconds_total{thread="([\w-]+)"} (\S+)$', text, re.M):
        add(f"thread:{thread}", value)
    for part, value in re.findall(r'^servelm_stream_cpu_seconds_total{part="(\w+)"} (\S+)$', text, re.M):
        add(f"stream:{part}", value)
    for value in re.findall(r'^servelm_gc_pause_seconds_total{[^}]*} (\S+)$', text, re.M):
        add("gc", value)
    for key, name in (("steps", "servelm_engine_steps_total"), ("tokens", "servelm_generation_tokens_total"),
                      ("calls", "servelm_engine_forward_calls_total")):
        for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M):
            add(key, value)
    return found


def per_token(delta: dict[str, float]) -> dict[str, float]:
    """ms a generated token by row, and a few per-step figures."""
    tokens = max(delta.get("tokens", 0.0), 1.0)
    steps = max(delta.get("steps", 0.0), 1.0)
    ms = {f"phase {p}": 1000 * delta.get(f"phase:{p}", 0.0) / tokens for p in PHASES}
    own = sum(delta.get(f"phase:{p}", 0.0) for p in OWN_PHASES)
    ms["engine phases outside the pass"] = 1000 * own / tokens
    engine = delta.get("thread:servelm-engine", 0.0)
    ms["engine thread CPU"] = 1000 * engine / tokens
    ms["engine thread CPU outside the pass"] = 1000 * max(
        0.0, engine - delta.get("phase:decode", 0.0) - delta.get("phase:runner", 0.0)) / tokens
    ms["sampling helper threads CPU"] = 1000 * delta.get(f"thread:{HELPER_THREAD}", 0.0) / tokens
    loop = delta.get("thread:event_loop", 0.0)
    serialize, write = delta.get("stream:serialize", 0.0), delta.get("stream:write", 0.0)
    ms["event loop CPU"] = 1000 * loop / tokens
    ms["  serialize"] = 1000 * serialize / tokens
    ms["  write"] = 1000 * write / tokens
    ms["  rest (hop, services, HTTP)"] = 1000 * max(0.0, loop - serialize - write) / tokens
    ms["server CPU outside the pass"] = ms["engine phases outside the pass"] + ms["event loop CPU"]
    ms["  of all threads: garbage collection (the GIL held)"] = 1000 * delta.get("gc", 0.0) / tokens
    ms["tokens a step"] = delta.get("tokens", 0.0) / steps
    ms["llama_decode calls a step"] = delta.get("calls", 0.0) / steps
    ms["sample+logprobs a step"] = 1000 * (delta.get("phase:sample", 0.0) + delta.get("phase:logprobs", 0.0)) / steps
    return ms


async def measure(spec: servers.ServerSpec, levels: list[int], requests: int | None, request: RequestSpec,
                  warmup: int) -> dict[int, dict[str, float]]:
    url = spec.root_url
    out: dict[int, dict[str, float]] = {}
    if warmup:
        await run_level(spec.base_url, spec.model, 1, warmup, replace(request, prompt_salt="warmup"))
    for streams in levels:
        before, t0 = scrape(url), time.monotonic()
        result = await run_level(spec.base_url, spec.model, streams, requests or max(4, streams),
                                 replace(request, prompt_salt=f"m{streams}"))
        after = scrape(url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        out[streams] = per_token(delta)
        print(f"   {streams} streams: {result.output_tok_s:.1f} out tok/s, {delta.get('tokens', 0):.0f} tokens in "
              f"{time.monotonic() - t0:.1f} s, {result.errors} errors", flush=True)
        if result.errors:
            print("   errors: " + "; ".join(result.error_samples[:3]), file=sys.stderr, flush=True)
    return out


def table(figures: dict[int, dict[str, float]]) -> str:
    levels = sorted(figures)
    rows = list(next(iter(figures.values())))
    lines = ["| ms of CPU a token | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in levels) + " |",
             "|---|" + "---:|" * len(levels)]
    for row in rows:
        if all(figures[n][row] == 0.0 for n in levels):
            continue
        lines.append(f"| {row} | " + " | ".join(f"{figures[n][row]:.3f}" for n in levels) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="servelm's own CPU time per generated token, by phase.")
    p.add_argument("--model", choices=models.NAMES, default=models.DEFAULT)
    p.add_argument("--streams", default="1,16", help="comma list of concurrent streams (default 1,16)")
    p.add_argument("--requests", type=int, default=None, help="requests a level (default: streams, >= 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=None, metavar="K", help="ask for logprobs and K top_logprobs")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default 0: greedy)")
    p.add_argument("--body", type=json.loads, default={}, metavar="JSON",
                   help='more request fields, e.g. \'{"top_k": 40}\'')
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before the first level")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    p.add_argument("--servelm-arg", action="append", default=[], help="extra `servelm serve` argument")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # the server stops either way
    model = models.path(args.model)
    spec = servers.servelm_defaults_spec(servers.free_port(), model, args.threads, args.servelm_arg)
    base = named("1-stream").request_spec("servelm", models.END_TOKENS[args.model])
    assert isinstance(base, RequestSpec)
    extra = dict(base.extra_body)
    if args.logprobs is not None:
        extra.update(logprobs=True, top_logprobs=args.logprobs)
    extra.update(args.body)
    request = replace(base, max_tokens=args.max_tokens, temperature=args.temperature, extra_body=extra)
    proc = servers.ServerProcess(spec, Path("harness/results/logs/cpu_per_token.log"))
    print(f"== {' '.join(spec.argv)}", flush=True)
    print(f"   other work before: {procfs.other_cores_now(1.0):.2f} cores", flush=True)
    try:
        proc.start()
        await proc.wait_ready(args.startup_timeout)
        figures = await measure(spec, [int(n) for n in args.streams.split(",") if n], args.requests, request,
                                args.warmup)
    finally:
        proc.stop()
    lp = f", logprobs top {args.logprobs}" if args.logprobs is not None else ""
    lp += "".join(f", {k} {v}" for k, v in args.body.items())
    print(f"\n{args.model}, {args.max_tokens} tokens a request, temperature {args.temperature:g}{lp}\n")
    print(table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
