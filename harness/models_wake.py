"""Models that come and go, measured on the real model (issue 36): a server started with only --models-dir and
--prefix-cache-dir; per round, a cold load by route, the first token of a ~2,000-token conversation read cold,
an unload (its prefix cache written to disk), a load again, and the first token of the same conversation woken from
disk; the server's RSS before the load, loaded, and after the unload. Each round has a conversation of its own.

    .venv/bin/python -m harness.models_wake [--model PATH] [--rounds 3] [--threads N] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.procfs import status_kib
from servelm.config import embedded_model_path

SENTENCE = "Round {i}: the harbour records list every ship that came in, with its cargo, its captain and the weather. "


def first_token_s(base: str, messages: list[dict[str, str]]) -> tuple[float, int]:
    """Seconds to the first streamed content, and the prompt's cached tokens."""
    body = {"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None
    return first, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=2000, help="about how long each conversation is")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models, cache = Path(tmp) / "models", Path(tmp) / "kv"
        models.mkdir()
        (models / "m.gguf").symlink_to(Path(args.model).resolve())
        port = 18000 + os.getpid() % 1000
        proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--port", str(port), "--models-dir",
                                 str(models), "--prefix-cache-dir", str(cache), "--max-num-seqs", "4", "--threads",
                                 str(args.threads), "--no-embedding-model", "--log-level", "warning"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            rows = []
            for i in range(args.rounds):
                text = SENTENCE.format(i=i) * max(1, args.tokens // 22)
                messages = [{"role": "system", "content": text}, {"role": "user", "content": "Which ship came first?"}]
                before = status_kib(proc.pid, "VmRSS")
                t = time.perf_counter()
                httpx.post(f"{base}/models/load", json={"model": "m"}, timeout=300).raise_for_status()
                load_s = time.perf_counter() - t
                loaded = status_kib(proc.pid, "VmRSS")
                cold, _ = first_token_s(base, messages)
                httpx.post(f"{base}/models/unload", json={"model": "m"}, timeout=300).raise_for_status()
                after = status_kib(proc.pid, "VmRSS")
                t = time.perf_counter()
                httpx.post(f"{base}/models/load", json={"model": "m"}, timeout=300).raise_for_status()
                reload_s = time.perf_counter() - t
                woken, cached = first_token_s(base, messages)
                httpx.post(f"{base}/models/unload", json={"model": "m"}, timeout=300).raise_for_status()
                rows.append((load_s, reload_s, cold, woken, cached, before, loaded, after))
                print(f"round {i}: load {load_s:.2f} s (again {reload_s:.2f} s); first token cold {cold * 1000:.0f} ms, "
                      f"woken {woken * 1000:.0f} ms ({woken / cold:.2f}x, {cached} tokens from disk); RSS "
                      f"{before >> 10} MiB before, {loaded >> 10} loaded, {after >> 10} after the unload "
                      f"({after / before:.2f}x before)", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    med = [statistics.median(r[k] for r in rows) for k in range(8)]
    print(f"median of {len(rows)}: cold load {med[0]:.2f} s; first token woken / cold {med[3] / med[2]:.3f}x "
          f"(target <= 0.2x); RSS after unload / before load {med[7] / med[5]:.3f}x (target within 10%)")


if __name__ == "__main__":
    main()
