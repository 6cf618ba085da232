"""What a content filter costs: one stream's first token and answer time on three deployments of the embedded model
in one server (no policy; a blocklist; a guard model, the same model loaded as a fourth deployment with Llama
Guard 3's template), and the guard's own tokens and time from /metrics.

    .venv/bin/python -m harness.guard --requests 8 --tokens 64 --window 32

The server is started by this script (on 127.0.0.1, a free port) from a config it writes; requests run one at a
time, streamed, greedy, `--tokens` tokens each (end of text banned), the same questions on every deployment.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Write a story about a lighthouse.", "Explain how rain forms.", "Describe a busy market.",
             "What makes a good breakfast?", "Tell me about the moon.", "How do bees make honey?",
             "Describe a train journey.", "Why is the sea salty?"]
CONFIG = """
[server]
embedding_model = false
[[deployments]]
name = "plain"
model = "{model}"
embedding_window = 0
engine = {{ max_num_seqs = 4 }}
[[deployments]]
name = "listed"
model = "{model}"
embedding_window = 0
engine = {{ max_num_seqs = 4 }}
content_filter = {{ terms = ["forbidden", "re:secret\\\\s+code"], window = {window} }}
[[deployments]]
name = "guarded"
model = "{model}"
embedding_window = 0
engine = {{ max_num_seqs = 4 }}
content_filter = {{ guard = {{ deployment = "guard" }}, window = {window} }}
[[deployments]]
name = "guard"
model = "{model}"
embedding_window = 0
engine = {{ max_num_seqs = 4 }}
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one(url: str, model: str, question: str, tokens: int) -> tuple[float, float, str]:
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0, "logit_bias": {"0": -100, "2": -100},
            "messages": [{"role": "user", "content": question}]}
    start = time.perf_counter()
    first, finish = None, ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", []):
                if c["delta"].get("content") and first is None:
                    first = time.perf_counter() - start
                finish = c.get("finish_reason") or finish
    return first or 0.0, time.perf_counter() - start, finish


def _guard_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for name in ("servelm_prompt_tokens_total", "servelm_generation_tokens_total", "servelm_generation_requests_total",
                 "servelm_e2e_request_latency_seconds_sum", "servelm_prefix_cache_tokens_total"):
        found = re.findall(rf'^{name}{{[^}}]*model="guard"[^}}]*}} ([0-9.e+]+)$', text, re.M)
        out[name] = sum(float(v) for v in found)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=32)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="servelm-guard-bench-"))
    config = folder / "servelm.toml"
    config.write_text(CONFIG.format(model=MODEL, window=args.window))
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--port", str(port), "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the server did not start; see {folder / 'server.log'}")
            time.sleep(0.5)
        questions = (QUESTIONS * (args.requests // len(QUESTIONS) + 1))[: args.requests]
        _one(url, "plain", "Hello", 4)  # warm-up
        rows = {}
        for model in ("plain", "listed", "guarded"):
            before = _guard_counts(url)
            runs = [_one(url, model, q, args.tokens) for q in questions]
            after = _guard_counts(url)
            rows[model] = (runs, {k: after[k] - before[k] for k in after})
        base_ttft = statistics.median(r[0] for r in rows["plain"][0])
        base_total = statistics.median(r[1] for r in rows["plain"][0])
        print(f"{args.requests} requests of {args.tokens} tokens, one at a time, window {args.window} tokens")
        print("deployment  TTFT p50 ms  (x plain)  answer p50 ms  (x plain)  finishes")
        for model, (runs, _) in rows.items():
            ttft = statistics.median(r[0] for r in runs)
            total = statistics.median(r[1] for r in runs)
            finishes = ",".join(sorted({r[2] for r in runs}))
            print(f"{model:10}  {ttft * 1000:11.1f}  {ttft / base_ttft:9.2f}  {total * 1000:13.1f}  "
                  f"{total / base_total:9.2f}  {finishes}")
        guard = rows["guarded"][1]
        calls = guard["servelm_generation_requests_total"]
        if calls:
            per_request = calls / args.requests
            print(f"guard: {calls:.0f} calls ({per_request:.1f} a request), per call "
                  f"{guard['servelm_prompt_tokens_total'] / calls:.0f} prompt tokens "
                  f"({guard['servelm_prefix_cache_tokens_total'] / calls:.0f} of them cached), "
                  f"{guard['servelm_generation_tokens_total'] / calls:.1f} generated, "
                  f"{guard['servelm_e2e_request_latency_seconds_sum'] / calls * 1000:.0f} ms")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    main()
