"""Compare servelm with llama.cpp's own llama-server on the same model file and machine.

    .venv/bin/python -m bench.compare                       # llama-server, then servelm
    .venv/bin/python -m bench.compare --servers llama-server --requests 4
    .venv/bin/python -m bench.compare --with-llama-cpp-python

Each server in turn is started, waited for, given every workload, and stopped; its peak resident
memory is sampled throughout. The result is a markdown table of each server's figures, the ratios
servelm / llama-server, the within-server ratios of RATIOS (constraint overhead = tok/s of json-8-free ÷
tok/s of json-8), and a JSON file under bench/results/. A workload declared for some servers only (the
json ones: servelm) is skipped on the others.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import llama_server, procfs, servers
from bench.loadgen import LevelResult, RequestSpec, run_level

RESULTS = servers.REPO / "bench" / "results"
BASELINE = "llama-server"
ALL_SERVERS = ("llama-server", "servelm", "llama-cpp-python")
# SmolLM2's end tokens: <|endoftext|> and <|im_end|>. Banned so every request yields max_tokens.
SMOLLM2_EOS = (0, 2)
# Other work using this many cores or more (of the machine's) makes a measurement unfair: llama.cpp's
# thread pool spins at its barriers, and a descheduled thread stalls the whole step.
QUIET_CORES = 0.25


@dataclass(frozen=True)
class Workload:
    """One load shape. Add entries to WORKLOADS to extend the comparison."""

    name: str
    description: str
    concurrency: int
    prompt_tokens: int = 97  # user message; SmolLM2's chat template brings the prompt to about 135 tokens
    max_tokens: int = 64
    ban_eos: bool = True
    system_prompt: str | None = None
    unique_prompts: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict, hash=False)  # merged into every request body
    requests: int | None = None  # default: 2 x concurrency, at least 4
    servers: tuple[str, ...] | None = None  # the only servers it runs against (default: every server)
    prompt_set: str | None = None  # workloads naming the same set send the same prompts (default: own name)
    warmup: int = 0  # uncounted requests of its own before it (e.g. to compile a schema once)

    def runs_on(self, server: str) -> bool:
        return self.servers is None or server in self.servers

    def request_spec(self, ban_ids: tuple[int, ...], attempt: int = 0) -> RequestSpec:
        """The requests of this workload; a retry gets fresh prompts, so no server has them cached."""
        salt = self.prompt_set or self.name
        return RequestSpec(max_tokens=self.max_tokens, prompt_tokens=self.prompt_tokens,
                           temperature=0.0, ban_token_ids=ban_ids if self.ban_eos else (),
                           system_prompt=self.system_prompt, unique_prompts=self.unique_prompts,
                           prompt_salt=salt if attempt == 0 else f"{salt}-retry{attempt}",
                           extra_body=dict(self.extra_body))


# Structured output: a long inventory object. minItems 40 cannot be reached in 128 tokens, so the grammar
# never allows EOS and a constrained request generates max_tokens like an unconstrained one.
INVENTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}
JSON_SYSTEM_PROMPT = ('Answer only with a JSON object listing the things named in the text as a shop inventory: '
                      '{"items": [{"name": "...", "qty": 0}, ...]}.')
JSON_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "inventory", "schema": INVENTORY_SCHEMA, "strict": True},
}

WORKLOADS: list[Workload] = [
    Workload("1-stream", "1 client; ~135-token prompt, 64 output tokens, EOS banned", concurrency=1),
    Workload("16-streams", "16 concurrent clients; same requests as 1-stream", concurrency=16),
    Workload("json-8", "8 concurrent clients; json_schema response_format (inventory), 128 output tokens, "
             "EOS banned", concurrency=8, max_tokens=128, system_prompt=JSON_SYSTEM_PROMPT,
             extra_body={"response_format": JSON_RESPONSE_FORMAT}, servers=("servelm",), prompt_set="json-8",
             warmup=1),
    Workload("json-8-free", "json-8's requests and prompts without response_format", concurrency=8,
             max_tokens=128, system_prompt=JSON_SYSTEM_PROMPT, servers=("servelm",), prompt_set="json-8"),
]


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
    ready_s: float | None = None
    other_cores_before: float | None = None  # cores busy with other work just before the start
    peak_rss_mib: float | None = None
    levels: dict[str, LevelResult] = field(default_factory=dict)
    other_cores: dict[str, float] = field(default_factory=dict)  # per workload, while it ran
    attempts: dict[str, int] = field(default_factory=dict)  # per workload: 1 + noisy retries used
    error: str | None = None


def context_size(workloads: list[Workload], parallel: int) -> int:
    """Total KV context for `parallel` slots of the largest workload (template margin included)."""
    per_slot = max(int(w.prompt_tokens * 1.3) + w.max_tokens + 128 for w in workloads)
    per_slot = -(-per_slot // 256) * 256
    return parallel * per_slot


def build_spec(name: str, args: argparse.Namespace, model: Path, ctx: int) -> servers.ServerSpec:
    port = servers.free_port()
    if name == "llama-server":
        binary = Path(args.llama_server_bin) if args.llama_server_bin else llama_server.build()
        return servers.llama_server_spec(binary, model, port, args.parallel, ctx, args.threads,
                                         args.llama_server_arg)
    if name == "servelm":
        return servers.servelm_spec(port, args.parallel, model, ctx, args.threads, args.servelm_arg)
    if name == "llama-cpp-python":
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
    result = await run_level(spec.base_url, spec.model, w.concurrency,
                             args.requests if args.requests is not None else w.requests,
                             w.request_spec(ban, attempt), warmup=warmup, timeout_s=args.timeout)
    run.other_cores[w.name] = procfs.other_cores(before, procfs.CpuSnapshot.take(proc.proc.pid))
    run.levels[w.name] = result
    print(f"   {w.name}: {result.output_tok_s:.1f} out tok/s, TTFT p50 "
          f"{_num(result.ttft_ms['p50'])} ms, ITL p50 {_num(result.itl_ms['p50'])} ms, "
          f"{result.errors} errors, other work {run.other_cores[w.name]:.2f} cores", flush=True)


async def run_server(spec: servers.ServerSpec, workloads: list[Workload], args: argparse.Namespace,
                     log_dir: Path, run: ServerRun) -> None:
    proc = servers.ServerProcess(spec, log_dir / f"{spec.name}.log")
    run.log = str(proc.log_path)
    ban = tuple(args.ban_eos)
    print(f"\n== {spec.name}: {' '.join(spec.argv)}", flush=True)
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


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _figures(lv: LevelResult) -> dict[str, float | None]:
    return {"out tok/s": lv.output_tok_s, "TTFT p50": lv.ttft_ms["p50"], "TTFT p99": lv.ttft_ms["p99"],
            "ITL p50": lv.itl_ms["p50"], "ITL p99": lv.itl_ms["p99"]}


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


def markdown(runs: list[ServerRun], workloads: list[Workload]) -> str:
    out = [("| workload | server | out tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| out tok/req | prompt tok | errors | other cores |"),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in workloads:
        for r in runs:
            if not w.runs_on(r.name):
                continue
            lv = r.levels.get(w.name)
            if lv is None:
                out.append(f"| {w.name} | {r.name} | failed | | | | | | | | | |")
                continue
            toks = (f"{lv.output_tokens_min}" if lv.output_tokens_min == lv.output_tokens_max
                    else f"{lv.output_tokens_min}-{lv.output_tokens_max}")
            out.append(f"| {w.name} | {r.name} | {lv.output_tok_s:.1f} | {lv.req_s:.2f} "
                       f"| {_num(lv.ttft_ms['p50'])} | {_num(lv.ttft_ms['p99'])} | {_num(lv.itl_ms['p50'])} "
                       f"| {_num(lv.itl_ms['p99'])} | {toks} | {_num(lv.prompt_tokens_mean, 0)} | {lv.errors} "
                       f"| {_num(r.other_cores.get(w.name), 2)} |")
    out += ["", "| server | ready after s | peak RSS MiB | other cores before start |", "|---|---:|---:|---:|"]
    out += [f"| {r.name} | {_num(r.ready_s)} | {_num(r.peak_rss_mib)} | {_num(r.other_cores_before, 2)} |"
            for r in runs]
    noisy = [f"{r.name}/{w}" for r in runs for w, c in r.other_cores.items() if c >= QUIET_CORES]
    if noisy:
        out += ["", f"**Warning**: other work used {QUIET_CORES} cores or more during {', '.join(noisy)}; "
                "those figures are not a fair comparison."]
    base = next((r for r in runs if r.name == BASELINE), None)
    others = [r for r in runs if r.name != BASELINE]
    if base and others:
        cols = ["out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
        out += ["", f"Ratios X / {BASELINE} (tok/s: higher is better; times and memory: lower is better)", "",
                "| workload | server | " + " | ".join(cols) + " | peak RSS |",
                "|---|---|" + "---:|" * (len(cols) + 1)]
        for w in workloads:
            if not w.runs_on(BASELINE):
                continue
            for r in others:
                if not w.runs_on(r.name):
                    continue
                a, b = r.levels.get(w.name), base.levels.get(w.name)
                fa = _figures(a) if a else {}
                fb = _figures(b) if b else {}
                cells = [_ratio(fa.get(c), fb.get(c)) for c in cols]
                cells.append(_ratio(r.peak_rss_mib, base.peak_rss_mib))
                out.append(f"| {w.name} | {r.name} | " + " | ".join(cells) + " |")
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
               model: Path, complete: bool) -> None:
    payload = {
        "complete": complete,
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "cpu": _cpu_model(),
        "llama_cpp_python": llama_server.pinned_version(),
        "cmake_flags": llama_server.cmake_flags(),
        "model": str(model),
        "threads": args.threads,
        "parallel": args.parallel,
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
    p.add_argument("--model-path", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default 2 x conc, >= 4)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads for the peer servers")
    p.add_argument("--parallel", type=int, default=16, help="slots / --max-num-seqs")
    p.add_argument("--ctx-size", type=int, default=None, help="llama-server -c (default: sized per workload)")
    p.add_argument("--ban-eos", type=int, nargs="*", default=list(SMOLLM2_EOS), metavar="TOKEN_ID")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests per server before the first workload")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help=f"before each server, wait up to this long for other work to use < {QUIET_CORES} cores")
    p.add_argument("--noisy-retries", type=int, default=0, metavar="N",
                   help=f"run a workload again, up to N times, when other work used >= {QUIET_CORES} cores")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--llama-server-bin", default=None, help="use this llama-server instead of building one")
    p.add_argument("--llama-server-arg", action="append", default=[], help="extra llama-server argument")
    p.add_argument("--servelm-arg", action="append", default=[], help="extra `servelm serve` argument")
    p.add_argument("--llama-cpp-python-arg", action="append", default=[], help="extra llama_cpp.server argument")
    p.add_argument("--json-out", default=None, help="default: bench/results/compare-<UTC time>.json")
    return p.parse_args(argv)


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
    model = Path(args.model_path) if args.model_path else servers.default_model_path()
    ctx = args.ctx_size or context_size(workloads, args.parallel)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    runs: list[ServerRun] = []
    complete = False
    try:
        for name in names:
            mine = [w for w in workloads if w.runs_on(name)]
            skipped = [w.name for w in workloads if not w.runs_on(name)]
            if skipped:
                print(f"\n{name}: skips {', '.join(skipped)} (declared for other servers only)", flush=True)
            if not mine:
                continue
            spec = build_spec(name, args, model, ctx)
            runs.append(ServerRun(spec.name, spec.argv, ""))
            await run_server(spec, mine, args, RESULTS / "logs" / stamp, runs[-1])
        complete = True
    finally:
        # Also on Ctrl-C or SIGTERM: report what finished (every server is already stopped).
        if runs:
            print("\n" + markdown(runs, workloads) + ("" if complete else "\n\n(interrupted: partial results)"))
            json_path = Path(args.json_out) if args.json_out else RESULTS / f"compare-{stamp}.json"
            write_json(json_path, runs, workloads, args, model, complete)
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
