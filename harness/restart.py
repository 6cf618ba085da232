"""Issue 21's restart target: the first token of a ~2,000-token prompt on a server restarted on its
--prefix-cache-dir, against a cold read of the same prompt (on servelm before the restart, and on llama-server).

    .venv/bin/python -m harness.restart

Each server runs on its defaults (servelm with --prefix-cache-dir added) on 127.0.0.1 with 2 threads. servelm:
start, the prompt (a cold read: its TTFT), a graceful stop (the entry is written to the directory), start again
on the directory, the same prompt (its TTFT, from disk). llama-server: start, the prompt (a cold read). Each TTFT
is the median of --repeats fresh prompts (a new prompt per repeat, each cached only by its own first run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from harness import llama_server, servers
from servelm.bench.loadgen import build_prompt, stream_one


def body(prompt: str) -> dict:
    return {"model": servers.MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def ttfts(spec: servers.ServerSpec, log: Path, prompts: list[str]) -> tuple[list[float], list[int]]:
    proc = servers.ServerProcess(spec, log)
    proc.start()
    try:
        await proc.wait_ready(180)
        out, prompt_tokens = [], []
        async with httpx.AsyncClient(timeout=300) as client:
            for prompt in prompts:
                r = await stream_one(client, spec.base_url + "/chat/completions", body(prompt))
                if not r.ok or r.ttft_s is None:
                    raise RuntimeError(f"{spec.name}: {r.error}")
                out.append(r.ttft_s)
                prompt_tokens.append(r.prompt_tokens or 0)
        return out, prompt_tokens
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=1780, help="build_prompt's size (1,780: a ~2,000-token prompt; the chat "
                   "template adds a few)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    model = servers.default_model_path()
    prompts = [build_prompt(args.prompt_tokens, f"restart-{i}") for i in range(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        logs, cache = Path(tmp), Path(tmp) / "prefix-cache"
        extra = ["--prefix-cache-dir", str(cache)]
        cold, prompt_tokens = asyncio.run(ttfts(servers.servelm_defaults_spec(servers.free_port(), model, args.threads,
                                                                              extra), logs / "cold.log", prompts))
        files = sorted(cache.glob("*"))
        warm, _ = asyncio.run(ttfts(servers.servelm_defaults_spec(servers.free_port(), model, args.threads, extra),
                                    logs / "restarted.log", prompts))
        binary = llama_server.build()
        peer, _ = asyncio.run(ttfts(servers.llama_server_defaults_spec(binary, model, servers.free_port(), args.threads,
                                                                       []), logs / "llama-server.log", prompts))
    result = {
        "prompt_tokens": prompt_tokens, "files_written": len(files),
        "servelm_cold_ttft_s": cold, "servelm_from_disk_ttft_s": warm, "llama_server_cold_ttft_s": peer,
        "from_disk_over_servelm_cold": statistics.median(warm) / statistics.median(cold),
        "from_disk_over_llama_server_cold": statistics.median(warm) / statistics.median(peer),
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
