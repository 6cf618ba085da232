"""Live traffic beside a batch (issue 35's benchmark), on one servelm server started here on its defaults:

1. interactive chat requests (Poisson arrivals) with no batch: first-token p50 and p99;
2. the same traffic (fresh prompts) while a chat batch of `--batch-lines` lines runs: the same figures, and their
   ratio to the first;
0. first, a batch of `--alone-lines` lines on the idle server: its output tokens/s (its usage over the time from
   its upload to its end), against `servelm bench`'s closed loop of 16 streams on requests of the same shape.

Every request is the 16-streams workload's shape (a ~97-token user message, 64 tokens, EOS ignored, greedy).

    .venv/bin/python -m harness.batch_live [--batch-lines 2000] [--rate 0.5] [--requests 30] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from harness.servers import MODEL_ID, ServerProcess, ServerSpec, free_port, servelm_exe
from servelm.bench.loadgen import RequestSpec, percentile, run_level, run_requests

SHAPE = {"max_tokens": 64, "prompt_tokens": 97, "ignore_eos": True}


def batch_file(count: int, salt: str) -> bytes:
    spec = RequestSpec(stream=False, prompt_salt=salt, **SHAPE)
    return b"".join(json.dumps({"custom_id": f"{salt}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": spec.body(MODEL_ID, i)}).encode() + b"\n" for i in range(count))


def start_batch(base: str, count: int, salt: str) -> str:
    f = httpx.post(base + "/v1/files", files={"file": (f"{salt}.jsonl", batch_file(count, salt))},
                   data={"purpose": "batch"}, timeout=60).json()
    batch = httpx.post(base + "/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}, timeout=60).json()
    return str(batch["id"])


def batch_state(base: str, batch_id: str) -> dict:
    return httpx.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()


def interactive(base: str, rate: float, count: int, salt: str) -> dict[str, float | None]:
    spec = RequestSpec(prompt_salt=salt, **SHAPE)
    results, _ = asyncio.run(run_requests(base + "/v1", MODEL_ID, spec, count, request_rate=rate, seed=1))
    ttft = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]
    return {"ok": len(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-lines", type=int, default=2000)
    ap.add_argument("--alone-lines", type=int, default=96)
    ap.add_argument("--rate", type=float, default=0.5, help="interactive requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=30, help="interactive requests per phase")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    state = tempfile.mkdtemp(prefix="servelm-batch-live-")
    port = free_port()
    argv = [str(servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port), "--state-dir", state,
            "--no-embedding-model", "--chat-embedding-window", "0"]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    server = ServerProcess(ServerSpec("servelm", argv, port, model=MODEL_ID), Path(state) / "server.log")
    server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(server.wait_ready(120))
        interactive(base, args.rate, 4, "warm")
        begun = time.perf_counter()
        solo = start_batch(base, args.alone_lines, "alone")
        while (done := batch_state(base, solo))["status"] != "completed":
            time.sleep(1.0)  # as a client polls; polling 10 times a second slows llama.cpp's threads (docs/batch.md)
        batch_tps = done["usage"]["output_tokens"] / (time.perf_counter() - begun)  # from its upload to its end
        spec = RequestSpec(prompt_salt="bench", **SHAPE)
        level = asyncio.run(run_level(base + "/v1", MODEL_ID, 16, args.alone_lines, spec))
        bench_tps = level.serving["output_throughput"]
        print(f"batch alone: {batch_tps:.1f} output tok/s (upload to end); servelm bench at 16 streams: "
              f"{bench_tps:.1f} ({batch_tps / bench_tps:.2f}x)", flush=True)
        alone = interactive(base, args.rate, args.requests, "no-batch")
        print(f"interactive, no batch: {alone}", flush=True)
        batch_id = start_batch(base, args.batch_lines, "live")
        while batch_state(base, batch_id)["request_counts"]["completed"] < 16:
            time.sleep(0.5)
        beside = interactive(base, args.rate, args.requests, "beside-batch")
        progress = batch_state(base, batch_id)["request_counts"]
        print(f"interactive, beside a {args.batch_lines}-line batch: {beside} (batch lines done: {progress})",
              flush=True)
        httpx.post(f"{base}/v1/batches/{batch_id}/cancel", timeout=30)
        while batch_state(base, batch_id)["status"] != "cancelled":
            time.sleep(0.5)
        for name, a, b in (("p50", beside["p50"], alone["p50"]), ("p99", beside["p99"], alone["p99"])):
            if a is not None and b:
                print(f"first token {name}: {a:.0f} ms beside the batch, {b:.0f} ms without: {a / b:.2f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
