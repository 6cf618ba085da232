"""The serving metrics of `vllm bench serve`, defined as it defines them, from each request's recorded times.

Per successful request: TTFT (sent → first content chunk); E2EL (sent → its answer complete); TPOT, the time per
output token after the first, (E2EL − TTFT) / (output tokens − 1), for requests of more than one token; ITL, every
gap between consecutive content chunks (pooled over requests). Each is reported as mean, median, standard
deviation and the chosen percentiles (numpy's linear interpolation), in milliseconds, under the keys
`mean_ttft_ms`, `median_tpot_ms`, `std_itl_ms`, `p99_e2el_ms`, ...

Over the run (duration: first arrival → last answer): `request_throughput` (completed requests / s),
`output_throughput` (output tokens / s), `total_token_throughput` ((input + output tokens) / s), and with SLOs
`request_goodput`: requests / s that met every SLO given (`ttft:500 tpot:50 e2el:2000`, milliseconds; a request of
one token has TPOT 0 here). `max_output_tokens_per_s` is the busiest whole second's content chunks, and
`max_concurrent_requests` the most requests in flight at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


class Timed(Protocol):
    """What a request's record holds (servelm.bench.loadgen.RequestResult)."""

    ok: bool
    start_time: float
    ttft_s: float | None
    itl_s: list[float]
    e2e_s: float
    output_tokens: int
    prompt_tokens: int | None
    text: str
    error: str | None


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` → {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError names a bad item."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r}: expected NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {item!r}: the limit must be a positive number of milliseconds")
        slos[name] = ms
    return slos


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std and percentiles of seconds, as milliseconds under vLLM's keys (0 when there are none)."""
    data = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(np.std(data))}
    for p in percentiles:
        word = str(int(p)) if float(p).is_integer() else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(data, p))
    return out


def _peaks(done: Sequence[Timed]) -> tuple[float, int]:
    """(the most content chunks in one whole second since the first start, the most requests in flight at once)."""
    if not done:
        return 0.0, 0
    first = min(r.start_time for r in done)
    last = max(r.start_time + r.e2e_s for r in done)
    per_second = np.zeros(int(math.ceil(last - first)) + 1)
    for r in done:
        if r.ttft_s is None:  # not streamed: its tokens arrive with the answer
            per_second[int(r.start_time + r.e2e_s - first)] += r.output_tokens
            continue
        t = r.start_time + r.ttft_s
        per_second[int(t - first)] += 1
        for gap in r.itl_s:
            t += gap
            per_second[int(t - first)] += 1
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.e2e_s, -1) for r in done])
    running = peak = 0
    for _, step in events:  # an end at the same instant as a start comes first: [start, end) intervals
        running += step
        peak = max(peak, running)
    return float(per_second.max()), peak


def serving_metrics(results: Sequence[Timed], duration_s: float, *, percentiles: Sequence[float] = (90, 99),
                    selected: Sequence[str] = METRICS, goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """vllm bench serve's result dictionary for one run: totals, throughputs, per-metric statistics and the
    per-request lists (input_lens, output_lens, ttfts, itls, latencies, start_times, generated_texts, errors)."""
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots, all_tpots = [], []
    for r in done:
        tpot = 0.0
        if r.ttft_s is not None and r.output_tokens > 1:
            tpot = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
    values = {"ttft": ttfts, "tpot": tpots, "itl": [g for r in done for g in r.itl_s], "e2el": [r.e2e_s for r in done]}
    good = None
    if goodput:
        limits = {name: ms / 1000.0 for name, ms in goodput.items()}
        good = 0
        for r, tpot in zip(done, all_tpots):
            seen = {"ttft": r.ttft_s if r.ttft_s is not None else r.e2e_s, "tpot": tpot, "e2el": r.e2e_s}
            good += all(seen[name] <= limit for name, limit in limits.items())
    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    per = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    peak_tokens, peak_requests = _peaks(done)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per(len(done)),
        "request_goodput": per(good) if good is not None else None,
        "output_throughput": per(total_out),
        "total_token_throughput": per(total_in + total_out),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    for name in METRICS:
        if name in selected:
            out.update(_stats(name, values[name], percentiles))
    out.update({
        "input_lens": [r.prompt_tokens or 0 for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r.ttft_s or 0.0 for r in results],
        "itls": [list(r.itl_s) for r in results],
        "latencies": [r.e2e_s for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error or "" for r in results],
    })
    return out
