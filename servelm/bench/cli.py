"""`servelm bench`: serving benchmarks of any OpenAI-compatible server, in `vllm bench serve`'s terms.

    servelm bench --url http://127.0.0.1:8000 --max-concurrency 1,4,16 --num-prompts 64
    servelm bench --url http://127.0.0.1:8000 --compare http://127.0.0.1:8080 --request-rate 2,4 --goodput ttft:500 tpot:50
    servelm bench --url http://127.0.0.1:8000 --dataset-name shared-prefix-4

Each server (--url, then each --compare URL in turn) gets every load level: each value of --max-concurrency
times each value of --request-rate (Poisson arrivals, or gamma with --burstiness), after --num-warmups
uncounted requests. Per server and level it prints vLLM's result block and writes vLLM's JSON (its key names)
to --result-dir (default: the current directory); then one PNG of latency CDFs and throughput against load, and,
with --compare, the ratio table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import random
import sys
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from servelm.bench import metrics as M
from servelm.bench.loadgen import EmbeddingSpec, RequestSpec, build_prompt, run_requests
from servelm.bench.plot import Run, figure
from servelm.bench.workloads import WORKLOADS, named

DEFAULT_NUM_PROMPTS = 100
# What the ratio table compares, and whether more is better
RATIO_KEYS = (("request_throughput", True), ("output_throughput", True), ("total_token_throughput", True),
              ("request_goodput", True), ("median_ttft_ms", False), ("p99_ttft_ms", False), ("median_tpot_ms", False),
              ("p99_tpot_ms", False), ("median_itl_ms", False), ("p99_itl_ms", False), ("median_e2el_ms", False),
              ("p99_e2el_ms", False))


@dataclass
class Load:
    """What one benchmark sends: the requests, how many, and at most how many at once unless told."""

    spec: RequestSpec | EmbeddingSpec
    num_prompts: int
    concurrency: int | None = None


def _words(n_tokens: int) -> int:
    return max(1, round(n_tokens / 1.3))  # plain English runs about 1.3 tokens a word in BPE vocabularies


def random_dataset(args: argparse.Namespace, count: int, level: int = 0) -> RequestSpec:
    """Random lengths: each request's input and output tokens drawn uniformly from [len × (1 − r), len × (1 + r)]
    (r = --random-range-ratio), after a shared prefix of --random-prefix-len tokens; the words are random too."""
    rng = random.Random(args.seed)
    r = args.random_range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - r)), math.ceil(n * (1 + r))))

    prefix = build_prompt(args.random_prefix_len, f"prefix-{args.seed}") + " " if args.random_prefix_len else ""
    lengths = tuple((draw(args.random_input_len), draw(args.random_output_len)) for _ in range(count))
    prompts = tuple(prefix + build_prompt(n, f"random-{args.seed}-{level}-{i}") for i, (n, _) in enumerate(lengths))
    return RequestSpec(prompts=prompts, lengths=lengths, temperature=args.temperature, ignore_eos=args.ignore_eos,
                       prompt_salt=f"random-{args.seed}-{level}")


def fixed_dataset(args: argparse.Namespace, count: int, level: int = 0) -> RequestSpec:
    """The prompt set that ships in the package: each prompt is an instruction and lines of one passage
    (servelm/bench/data/passage.txt), about --fixed-input-len tokens, the first --fixed-prefix-len tokens'
    worth of lines the same in every prompt, the rest chosen by --seed; --fixed-output-len tokens out."""
    lines = resources.files("servelm.bench").joinpath("data/passage.txt").read_text().splitlines()
    rng = random.Random(f"{args.seed}-{level}")
    head, body = "Summarize the following lines in your own words, one sentence for each:", []
    budget = _words(args.fixed_prefix_len)
    for line in lines:
        if budget <= 0:
            break
        body.append(line)
        budget -= len(line.split())
    prompts = []
    for _ in range(count):
        picked = list(body)
        words = sum(len(x.split()) for x in picked) + len(head.split())
        while words < _words(args.fixed_input_len):
            line = rng.choice(lines)
            picked.append(line)
            words += len(line.split())
        prompts.append("\n".join([head, *picked]))
    return RequestSpec(prompts=tuple(prompts), max_tokens=args.fixed_output_len, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, prompt_salt=f"fixed-{args.seed}-{level}")


def load_of(args: argparse.Namespace, level: int = 0) -> Load:
    """The requests of one load level: the same for every server, new prompts at each level (a server's prefix
    cache must not carry one level's prompts into the next)."""
    count = args.num_prompts
    if args.dataset_name == "random":
        return Load(random_dataset(args, count or DEFAULT_NUM_PROMPTS, level), count or DEFAULT_NUM_PROMPTS)
    if args.dataset_name == "fixed":
        return Load(fixed_dataset(args, count or DEFAULT_NUM_PROMPTS, level), count or DEFAULT_NUM_PROMPTS)
    w = named(args.dataset_name)
    spec = w.request_spec("servelm-bench", (), attempt=level)
    if isinstance(spec, RequestSpec):  # the model's own end tokens are unknown here: ask for ignore_eos instead
        spec = replace(spec, ignore_eos=w.ban_eos or args.ignore_eos, ban_token_ids=())
    default = w.requests if w.requests is not None else max(4, 2 * w.concurrency)
    return Load(spec, count or default, w.concurrency)


def root_url(url: str) -> str:
    """A server's root from --url/--base-url, with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=30, trust_env=False)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"servelm bench: could not read a model from {url}/v1/models ({exc}); pass --model") from None


def slots_of(url: str, model: str, api_key: str | None) -> int | None:
    """How many sequences a server runs at once, where it says: llama-server's /props `total_slots`, servelm's
    /health (the model's `total_slots`); None where neither answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/props", "/health"):
        try:
            resp = httpx.get(url + path, headers=headers, timeout=10, trust_env=False)
            body = resp.json() if resp.status_code == 200 else {}
            found = body.get("total_slots") if path == "/props" else \
                body.get("deployments", {}).get(model, {}).get("total_slots")
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if isinstance(found, int) and found > 0:
            return found
    return None


def footing(names: list[str], slots: dict[str, int | None], streams: list[int]) -> list[str]:
    """Whether the comparison is on equal footing: every server can run the most streams a level sends at once (a
    server with fewer slots queues the rest, and the table measures its queue, not its engine)."""
    most = max(streams)
    lines = []
    for name in names:
        have = slots.get(name)
        if have is None:
            lines.append(f"- {name}: its slots are not reported; equal footing needs {most}")
        elif have >= most:
            lines.append(f"- {name}: {have} slots for at most {most} streams: equal footing")
        else:
            lines.append(f"- {name}: {have} slots for {most} streams: NOT equal footing, {most - have} of its requests "
                         f"queue at a time (defaults against defaults). For a like-for-like table start llama-server "
                         f"with -np {most} (and -c {most} × the context a request needs), or run harness/compare.py, "
                         "which does")
    return lines


def _label(load: float) -> str:
    return "inf" if math.isinf(load) else f"{load:g}"


def print_result(server: str, res: dict[str, Any], percentiles: list[float], selected: list[str]) -> None:
    """vLLM's result block."""
    line = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=f" Serving Benchmark Result: {server} ", n=50, c="="))
    print(line("Successful requests:", res["completed"]))
    print(line("Failed requests:", res["failed"]))
    if res["max_concurrency"] is not None:
        print(line("Maximum request concurrency:", res["max_concurrency"]))
    if res["request_rate"] != "inf":
        print(num("Request rate configured (RPS):", res["request_rate"]))
    print(num("Benchmark duration (s):", res["duration"]))
    print(line("Total input tokens:", res["total_input_tokens"]))
    print(line("Total generated tokens:", res["total_output_tokens"]))
    print(num("Request throughput (req/s):", res["request_throughput"]))
    if res["request_goodput"] is not None:
        print(num("Request goodput (req/s):", res["request_goodput"]))
    print(num("Output token throughput (tok/s):", res["output_throughput"]))
    print(num("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"]))
    print(line("Peak concurrent requests:", res["max_concurrent_requests"]))
    print(num("Total token throughput (tok/s):", res["total_token_throughput"]))
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for key in selected:
        short, long = headers[key]
        print("{s:{c}^{n}}".format(s=long, n=50, c="-"))
        print(num(f"Mean {short} (ms):", res[f"mean_{key}_ms"]))
        print(num(f"Median {short} (ms):", res[f"median_{key}_ms"]))
        for p in percentiles:
            word = str(int(p)) if float(p).is_integer() else str(p)
            print(num(f"P{word} {short} (ms):", res[f"p{word}_{key}_ms"]))
    print("=" * 50, flush=True)


def ratio_table(runs: list[Run], servers: list[str], load_label: str) -> str:
    """A markdown table: each compared server's figures beside the first's, and first ÷ other per level."""
    base, others = servers[0], servers[1:]
    by = {(r.server, r.load): r.result for r in runs}
    loads = sorted({r.load for r in runs})
    head = ["metric", load_label, base] + [x for o in others for x in (o, f"{base} ÷ {o}")]
    rows = [head, ["---"] * len(head)]
    for key, _ in RATIO_KEYS:
        for load in loads:
            mine = by.get((base, load), {}).get(key)
            if mine is None:
                continue
            row = [key, _label(load), f"{mine:.2f}"]
            for o in others:
                theirs = by.get((o, load), {}).get(key)
                row += ["-" if theirs is None else f"{theirs:.2f}",
                        "-" if theirs in (None, 0) else f"{mine / theirs:.2f}"]
            rows.append(row)
    legend = "more is better for throughputs and goodput, less for times"
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + f"\n({legend})"


def _csv_numbers(kind: type, text: str) -> list[Any]:
    try:
        return [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, named as vllm bench serve names them where it has one."""
    p.add_argument("--base-url", "--url", dest="base_url", default="http://127.0.0.1:8000",
                   help="the server's root URL (a trailing /v1 is fine) (default: http://127.0.0.1:8000)")
    p.add_argument("--compare", nargs="+", default=[], metavar="URL",
                   help="more servers: the same load runs against each in turn, and a ratio table is printed")
    p.add_argument("--model", default=None, help="model id sent in each request (default: each server's first in /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: OPENAI_API_KEY when set)")
    p.add_argument("--label", default=None, help="the name the results and figure use for --url (default: its host:port)")
    names = ["random", "fixed"] + [w.name for w in WORKLOADS]
    p.add_argument("--dataset-name", default="random", choices=names, metavar="NAME",
                   help=f"random (random input and output lengths), fixed (the packaged prompt set), or a named workload: "
                        f"{', '.join(w.name for w in WORKLOADS)} (default: random)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per level (default: {DEFAULT_NUM_PROMPTS}; a named workload's own count)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary by ± this fraction (0 ≤ r < 1)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens of shared prefix before each random prompt")
    p.add_argument("--fixed-input-len", type=int, default=256)
    p.add_argument("--fixed-output-len", type=int, default=64)
    p.add_argument("--fixed-prefix-len", type=int, default=0, help="tokens of passage lines every fixed prompt shares")
    p.add_argument("--max-concurrency", type=lambda t: _csv_numbers(int, t), default=None,
                   help="requests in flight at most; a comma list sweeps (default: no limit, or a named workload's)")
    p.add_argument("--request-rate", type=lambda t: _csv_numbers(float, t), default=[math.inf],
                   help="requests per second (Poisson arrivals); a comma list sweeps (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 is Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=1, help="uncounted requests before each level")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every answer runs to its max tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON", help="merged into every request body")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; milliseconds)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="which metrics get percentiles")
    p.add_argument("--metric-percentiles", default="90,99", help="which percentiles (besides the median)")
    p.add_argument("--result-dir", default=None, help="where the JSON and PNG go (default: the current directory)")
    p.add_argument("--result-filename", default=None, help="the JSON's name, for a single server and level")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="no PNG")


def _server_label(url: str) -> str:
    return url.split("://", 1)[-1]


async def run_level(url: str, model: str, load: Load, concurrency: int | None, rate: float,
                    args: argparse.Namespace, slos: dict[str, float], percentiles: list[float],
                    selected: list[str]) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=load.num_prompts, disable=args.disable_tqdm, file=sys.stderr, unit="req", leave=False)
    try:
        results, duration = await run_requests(
            url + "/v1", model, load.spec, load.num_prompts, max_concurrency=concurrency, request_rate=rate,
            burstiness=args.burstiness, seed=args.seed, warmup=args.num_warmups, timeout_s=args.timeout,
            api_key=args.api_key, on_done=lambda: bar.update(1))
    finally:
        bar.close()
    res = M.serving_metrics(results, duration, percentiles=percentiles, selected=selected, goodput=slos)
    for err in sorted({r.error for r in results if r.error})[:5]:
        print(f"   error: {err}", file=sys.stderr)
    head = {"date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai-chat",
            "backend": "openai-chat", "label": None, "model_id": model, "tokenizer_id": None, "base_url": url,
            "dataset_name": args.dataset_name, "num_prompts": load.num_prompts,
            "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
            "max_concurrency": concurrency, "goodput": slos or None}
    return head | res


def _levels(args: argparse.Namespace, load: Load) -> list[tuple[int | None, float]]:
    concurrencies = args.max_concurrency or [load.concurrency]
    return [(c, r) for c in concurrencies for r in args.request_rate]


def main(args: argparse.Namespace) -> int:
    try:
        slos = M.parse_goodput(args.goodput)
        percentiles = _csv_numbers(float, args.metric_percentiles)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"servelm bench: {exc}") from None
    selected = [m for m in args.percentile_metrics.split(",") if m]
    if bad := [m for m in selected if m not in M.METRICS]:
        raise SystemExit(f"servelm bench: --percentile-metrics {','.join(bad)}: choose from {','.join(M.METRICS)}")
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit("servelm bench: --random-range-ratio must be in [0, 1)")
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    load = load_of(args)
    if isinstance(load.spec, EmbeddingSpec):
        selected = [m for m in selected if m == "e2el"]
    levels = _levels(args, load)
    loads = [load] + [load_of(args, k) for k in range(1, len(levels))]  # level 0's requests are built already
    for each in loads:
        each.spec = replace(each.spec, extra_body={**each.spec.extra_body, **args.extra_body})
    urls = [root_url(u) for u in [args.base_url, *args.compare]]
    names = [args.label or _server_label(urls[0])] + [_server_label(u) for u in urls[1:]]
    sweep_rate = len({r for _, r in levels}) > 1
    load_label = "request rate (req/s)" if sweep_rate else "max concurrency"
    out_dir = Path(args.result_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    slots: dict[str, int | None] = {}
    failed = False
    for url, name in zip(urls, names):
        model = args.model or first_model(url, args.api_key)
        slots[name] = slots_of(url, model, args.api_key)
        for (concurrency, rate), load in zip(levels, loads):
            print(f"\n{name}: {args.dataset_name}, {load.num_prompts} requests, max concurrency "
                  f"{concurrency or 'unlimited'}, request rate {_label(rate)}/s", flush=True)
            res = asyncio.run(run_level(url, model, load, concurrency, rate, args, slos, percentiles, selected))
            res["label"] = name
            print_result(name, res, percentiles, selected)
            failed |= res["completed"] == 0
            tag = f"{_label(rate)}qps" + (f"-concurrency{concurrency}" if concurrency else "")
            single = len(urls) == 1 and len(levels) == 1
            file = out_dir / (args.result_filename if single and args.result_filename else
                              f"{_slug(name)}-{tag}-{_slug(model)}-{res['date']}.json")
            file.write_text(json.dumps(res, indent=2))
            print(f"results: {file}", flush=True)
            load_value = rate if sweep_rate else float(concurrency or load.num_prompts)
            runs.append(Run(name, load_value, res))
    if len(urls) > 1:
        print("\n" + ratio_table(runs, names, load_label))
        streams = [c or load.num_prompts for (c, _), load in zip(levels, loads)]
        print("\nFooting:\n" + "\n".join(footing(names, slots, streams)))
    if not args.no_plot:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        png = figure(runs, load_label, out_dir / f"bench-{_slug(args.dataset_name)}-{stamp}.png",
                     f"servelm bench · {args.dataset_name} · {' vs '.join(names)}")
        print(f"figure: {png}")
    return 1 if failed else 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
