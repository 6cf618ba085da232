"""LoRA adapters under load (issue 36): one server with 4 fixture adapters (scripts/make_test_lora.py, seeds 0-3);
16 streams on the base model, then 16 streams spread over the 4 adapters (4 each), each stream a greedy answer of
--tokens tokens with end-of-text ignored; output tokens per second of each, best of --repeats, and the ratio.

    .venv/bin/python -m harness.lora_streams [--streams 16] [--adapters 4] [--tokens 128] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servelm.config import DEFAULT_MODEL_ID

PROMPTS = ["Write a story about a cat.", "Describe a harbour at dawn.", "Explain how bread rises.",
           "List some rivers of Europe.", "Tell me about the moon.", "Write a poem about rain.",
           "How do trains work?", "Describe a forest in winter."]


async def wave(base: str, models: list[str], tokens: int) -> float:
    """Output tokens per second of one wave: every stream at once, from the first request to the last answer."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def one(i: int, model: str) -> int:
            body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        made = await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
        return sum(made) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--server-flag", action="append", default=[], help="a further `servelm serve` flag (repeatable)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        flags = []
        for i in range(args.adapters):
            path = Path(tmp) / f"a{i}.gguf"
            subprocess.run([sys.executable, str(root / "scripts" / "make_test_lora.py"), str(path), "--seed", str(i)],
                           check=True, capture_output=True)
            flags += ["--lora", f"a{i}={path}"]
        port = 18600 + os.getpid() % 1000
        proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--port", str(port), "--threads",
                                 str(args.threads), "--max-num-seqs", str(args.streams), "--no-embedding-model",
                                 "--log-level", "warning", *flags, *args.server_flag], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if "a0" in httpx.get(f"{base}/v1/models", timeout=1).text:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            plain = [DEFAULT_MODEL_ID] * args.streams
            spread = [f"a{i % args.adapters}" for i in range(args.streams)]
            asyncio.run(wave(base, plain[:2], 8))  # warm
            on_base, on_adapters = [], []
            for _ in range(args.repeats):
                on_base.append(asyncio.run(wave(base, plain, args.tokens)))
                on_adapters.append(asyncio.run(wave(base, spread, args.tokens)))
                print(f"base {on_base[-1]:.1f} tok/s, {args.adapters} adapters {on_adapters[-1]:.1f} tok/s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    b, a = max(on_base), max(on_adapters)
    print(f"best of {args.repeats}: {args.streams} streams on the base {b:.1f} output tok/s; over {args.adapters} "
          f"adapters {a:.1f} tok/s: {a / b:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
