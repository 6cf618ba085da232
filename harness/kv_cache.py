"""What a quantized KV cache buys and costs: per `--kv-cache-type`, the streams that fit in a memory budget, the
server's peak memory, and how far the prompt tokens' logprobs move from an f16 cache on a fixed prompt set.

    .venv/bin/python -m harness.kv_cache --budget-mib 512 --prompts 8

For each type one servelm (the embedded model, 16 slots of 2,048 cells, no embedding model) is started on
127.0.0.1, asked for every prompt's token logprobs (`prompt_logprobs`: the model's logprob of each prompt token
given the ones before it, through the cache of the tokens before it) and for a greedy 32-token answer, and
stopped. Figures against f16: the mean and largest |Δ logprob| over every prompt position, and the greedy answers
that stay the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

from harness import servers
from servelm.bench.loadgen import build_prompt

TYPES = ("f16", "q8_0", "q4_0")
CONTEXT = 2048


def measure(kind: str, prompts: list[str], log_dir: Path, threads: int) -> dict:
    port = servers.free_port()
    spec = servers.ServerSpec(kind, [str(servers.servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port),
                                     "--threads", str(threads), "--kv-cache-type", kind, "--no-embedding-model",
                                     "--chat-embedding-window", "0", "--max-num-seqs", "16",
                                     "--context-window", str(CONTEXT)], port)
    proc = servers.ServerProcess(spec, log_dir / f"servelm-{kind}.log")
    proc.start()
    try:
        asyncio.run(proc.wait_ready(120))
        health = httpx.get(spec.root_url + "/health", timeout=10).json()["deployments"][servers.MODEL_ID]
        scored, answers = [], []
        for text in prompts:
            body = {"model": servers.MODEL_ID, "prompt": text, "max_tokens": 32, "temperature": 0,
                    "prompt_logprobs": 0}
            got = httpx.post(spec.base_url + "/completions", json=body, timeout=120).json()
            rows = got["choices"][0]["prompt_logprobs"]  # vLLM puts them on each completion choice
            ids = [int(next(iter(r))) if r else None for r in rows]
            scored.append([None if r is None else r[str(t)]["logprob"] for r, t in zip(rows, ids)])
            answers.append(got["choices"][0]["text"])
    finally:
        proc.stop()
    return {"type": kind, "cell_bytes": health["kv_cell_bytes"], "cells": health["kv_cells_total"],
            "peak_rss_mib": proc.peak_rss_kib / 1024, "logprobs": scored, "answers": answers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mib", type=float, default=512, help="KV memory to fill with streams of 2,048 cells")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    prompts = [build_prompt(args.prompt_tokens, f"kv-cache-{i}") for i in range(args.prompts)]
    log_dir = servers.REPO / "harness" / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = [measure(kind, prompts, log_dir, args.threads) for kind in TYPES]
    base = runs[0]
    print(f"| KV cache | bytes a cell | streams of {CONTEXT} cells in {args.budget_mib:g} MiB | server peak RSS MiB | "
          "mean abs Δ logprob | max abs Δ logprob | greedy answers unchanged |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        deltas = [abs(a - b) for mine, ref in zip(run["logprobs"], base["logprobs"])
                  for a, b in zip(mine, ref) if a is not None and b is not None]
        run["mean_abs_delta"], run["max_abs_delta"] = statistics.fmean(deltas), max(deltas)
        run["same_answers"] = sum(a == b for a, b in zip(run["answers"], base["answers"]))
        streams = int(args.budget_mib * 2**20 // (run["cell_bytes"] * CONTEXT))
        run["streams_in_budget"] = streams
        print(f"| {run['type']} | {run['cell_bytes']:,} | {streams} | {run['peak_rss_mib']:.0f} | "
              f"{run['mean_abs_delta']:.4f} | {run['max_abs_delta']:.3f} | {run['same_answers']} / {len(prompts)} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"budget_mib": args.budget_mib, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
