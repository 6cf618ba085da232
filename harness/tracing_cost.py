"""What tracing costs (issue 37): two servers of the embedded model, one with --otlp-traces-endpoint sending to a local
OTLP/HTTP receiver (tests/otlp_receiver.py, decoding every span as a collector would) and one without; waves of
--streams concurrent greedy answers of --tokens tokens (end-of-text ignored) go to each in turn, and the best output
tokens per second of each is compared.

    .venv/bin/python -m harness.tracing_cost [--streams 16] [--tokens 128] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

from harness.lora_streams import wave
from servelm.config import DEFAULT_MODEL_ID
from tests.otlp_receiver import OtlpReceiver


def start(port: int, threads: int, streams: int, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--port", str(port), "--threads", str(threads),
                             "--max-num-seqs", str(streams), "--no-embedding-model", "--log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ready(base: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    receiver = OtlpReceiver()
    endpoint = receiver.start_http()
    port = 18700 + os.getpid() % 500
    off = start(port, args.threads, args.streams)
    on = start(port + 1, args.threads, args.streams, "--otlp-traces-endpoint", endpoint)
    bases = {"off": f"http://127.0.0.1:{port}", "on": f"http://127.0.0.1:{port + 1}"}
    best: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for base in bases.values():
            ready(base)
            asyncio.run(wave(base, [DEFAULT_MODEL_ID] * 2, 8))  # warm
        models = [DEFAULT_MODEL_ID] * args.streams
        for _ in range(args.repeats):
            for name, base in bases.items():
                best[name].append(asyncio.run(wave(base, models, args.tokens)))
            print(f"tracing off {best['off'][-1]:.1f} tok/s, on {best['on'][-1]:.1f} tok/s", flush=True)
    finally:
        for proc in (off, on):
            proc.terminate()
            proc.wait(timeout=60)
        receiver.stop()
    a, b = max(best["off"]), max(best["on"])
    spans = len(receiver.spans)
    print(f"best of {args.repeats}: {args.streams} streams, tracing off {a:.1f} output tok/s, on {b:.1f} tok/s: "
          f"{b / a:.3f}x (target >= 0.98x); {spans} spans received")


if __name__ == "__main__":
    main()
