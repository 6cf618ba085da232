"""What one tenant's ordinary traffic does to another's: a neighbour's first token and its largest gap between tokens,
alone and beside each kind of traffic, on one servelm started here (127.0.0.1, a free port; `--threads 1` by
default, so a 2-core machine keeps a core for the rest). Every run stops by itself and prints one JSON object.

    .venv/bin/python -m harness.neighbours burst      # another key's two concurrent ~170-token new prompts
    .venv/bin/python -m harness.neighbours cached     # a 749-token prompt whose first 729 tokens are cached
    .venv/bin/python -m harness.neighbours tools      # a tool request with tool_choice "required"
    .venv/bin/python -m harness.neighbours mcp        # a Responses request whose MCP tools run (a real MCP server)
    .venv/bin/python -m harness.neighbours batch      # a 300-line batch running; then a 48-line batch's short lines
    .venv/bin/python -m harness.neighbours flood      # --max-num-seqs 4: key A's 32 requests, then key B's one

Each neighbour probe is a streamed chat request of `--tokens` tokens (EOS ignored, greedy) by key k2; `--rounds`
probes alone, then as many beside the traffic. `--server-arg=--no-fair-share` and the like pass flags through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx

from harness import servers

MODEL = servers.MODEL_ID
KEYS = ("k1", "k2", "mon")
WORDS = ("amber birch cedar delta ember fjord grove harbor island jasper kettle lantern meadow nectar orchard "
         "pebble quarry river saddle timber umber valley willow yonder zephyr").split()


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def prompt_of(client: httpx.AsyncClient, tokens: int, seed: int) -> str:
    """A user message whose chat prompt is about `tokens` tokens (measured with /tokenize), new to the cache."""
    words = max(1, tokens // 2)
    for _ in range(6):
        content = f"[{seed}] " + text(words, seed)
        r = await client.post("/tokenize", headers=headers("k1"), json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True})
        count = r.json()["count"]
        if abs(count - tokens) <= 4:
            break
        words = max(1, round(words * tokens / max(count, 1)))
    return content


async def stream(client: httpx.AsyncClient, key: str, body: dict[str, Any], path: str = "/v1/chat/completions"
                 ) -> dict[str, Any]:
    """A streamed request: its first content's time, its largest gap between content chunks, its status."""
    body = {"model": MODEL, "stream": True, **body}
    start = time.monotonic()
    first = last = None
    gap, chunks = 0.0, 0
    async with client.stream("POST", path, json=body, headers=headers(key)) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices")
            delta = choices[0].get("delta", {}) if choices else {}
            if not (delta.get("content") or delta.get("tool_calls") or event.get("delta")):
                continue
            now = time.monotonic()
            first = first if first is not None else now - start
            if last is not None:
                gap = max(gap, now - last)
            last, chunks = now, chunks + 1
    return {"status": status, "first_s": round(first or 0.0, 3), "max_gap_s": round(gap, 3), "chunks": chunks,
            "total_s": round(time.monotonic() - start, 3)}


async def probe(client: httpx.AsyncClient, tokens: int, seed: int) -> dict[str, Any]:
    return await stream(client, "k2", {"messages": [{"role": "user", "content": text(3, seed)}], "max_tokens": tokens,
                                       "ignore_eos": True, "temperature": 0})


async def beside(client: httpx.AsyncClient, args: argparse.Namespace, traffic: Any) -> dict[str, Any]:
    """The neighbour's probes alone, then each beside one run of `traffic(client, i)` (begun 1 s into the probe)."""
    alone = [await probe(client, args.tokens, 1000 + i) for i in range(args.rounds)]
    near, others = [], []
    for i in range(args.rounds):
        neighbour = asyncio.create_task(probe(client, args.tokens, 2000 + i))
        await asyncio.sleep(1.0)
        others.append(await traffic(client, i))
        near.append(await neighbour)
    return {"alone": summary(alone), "beside": summary(near), "traffic": others}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"first_s": [r["first_s"] for r in runs], "max_gap_s": [r["max_gap_s"] for r in runs],
            "worst_gap_s": max(r["max_gap_s"] for r in runs), "worst_first_s": max(r["first_s"] for r in runs)}


# -- the traffic ----------------------------------------------------------------------------------------------
async def burst(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    async def two(client: httpx.AsyncClient, i: int) -> list[dict[str, Any]]:
        prompts = [await prompt_of(client, 170, 10 * i + j) for j in range(args.n or 2)]
        return list(await asyncio.gather(*(stream(client, "k1", {"messages": [{"role": "user", "content": p}],
                                                                  "max_tokens": 24, "temperature": 0})
                                           for p in prompts)))
    return await beside(client, args, two)


async def cached(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    async def long(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        head = await prompt_of(client, 729, 500 + i)
        await stream(client, "k1", {"messages": [{"role": "user", "content": head}], "max_tokens": 1})  # cached now
        tail = head + " " + text(10, 900 + i)
        return await stream(client, "k1", {"messages": [{"role": "user", "content": tail}], "max_tokens": 24,
                                           "temperature": 0})
    return await beside(client, args, long)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


async def tools(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    async def tool(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        return await stream(client, "k1", {"messages": [{"role": "user", "content": f"Weather in city {i}?"}],
                                           "tools": [TOOL], "tool_choice": "required", "max_tokens": 48})
    return await beside(client, args, tool)


async def mcp(client: httpx.AsyncClient, args: argparse.Namespace, origin: str) -> dict[str, Any]:
    async def respond(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        start = time.monotonic()
        r = await client.post("/v1/responses", headers=headers("k1"), timeout=300, json={
            "model": MODEL, "input": f"Add {i} and {i + 3} with the add tool.", "max_output_tokens": 48,
            "tools": [{"type": "mcp", "server_label": "tests", "server_url": origin + "/mcp",
                       "require_approval": "never"}], "tool_choice": "required"})
        kinds = [item.get("type") for item in r.json().get("output", [])] if r.status_code == 200 else []
        return {"status": r.status_code, "seconds": round(time.monotonic() - start, 2), "items": kinds}
    return await beside(client, args, respond)


def batch_lines(count: int, salt: str, max_tokens: Any, words: int = 60) -> bytes:
    lines = []
    for i in range(count):
        tokens = max_tokens(i) if callable(max_tokens) else max_tokens
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"[{salt}-{i}] " + text(words, zlib.crc32(f"{salt}-{i}".encode()))}],
                "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"{salt}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def start_batch(client: httpx.AsyncClient, data: bytes, name: str) -> str:
    f = await client.post("/v1/files", headers=headers("k1"), files={"file": (name, data)}, data={"purpose": "batch"})
    b = await client.post("/v1/batches", headers=headers("k1"), json={
        "input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    return str(b.json()["id"])


async def batch(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    alone = [await probe(client, args.tokens, 3000 + i) for i in range(args.rounds)]
    big = await start_batch(client, batch_lines(args.n or 300, "big", 64), "big.jsonl")
    await asyncio.sleep(10.0)  # the batch fills the slots
    near = []
    for i in range(args.rounds):
        near.append(await probe(client, args.tokens, 4000 + i))
        await asyncio.sleep(1.0)
    progress = (await client.get(f"/v1/batches/{big}", headers=headers("k1"))).json()["request_counts"]
    await client.post(f"/v1/batches/{big}/cancel", headers=headers("k1"))
    while (await client.get(f"/v1/batches/{big}", headers=headers("k1"))).json()["status"] not in (
            "cancelled", "completed", "failed"):
        await asyncio.sleep(0.5)
    # on the idle server: a 48-line batch of short questions whose lines 0, 12, 24 and 36 want 4 tokens, the others 16
    short = await start_batch(client, batch_lines(48, "mix", lambda i: 4 if i % 12 == 0 else 16, words=8), "mix.jsonl")
    await asyncio.sleep(5.0)
    mixed = (await client.get(f"/v1/batches/{short}", headers=headers("k1"))).json()
    await client.post(f"/v1/batches/{short}/cancel", headers=headers("k1"))
    answered_short = None
    while True:
        state = (await client.get(f"/v1/batches/{short}", headers=headers("k1"))).json()
        if state["status"] in ("cancelled", "completed", "failed"):
            break
        await asyncio.sleep(0.5)
    if state.get("output_file_id"):
        out = (await client.get(f"/v1/files/{state['output_file_id']}/content", headers=headers("k1"))).text
        ids = {json.loads(line)["custom_id"] for line in out.splitlines() if line.strip()}
        answered_short = sorted(i for i in ids if int(i.split("-")[1]) % 12 == 0)
    return {"alone": summary(alone), "beside_batch": summary(near), "batch_progress_at_end": progress,
            "mixed_batch_after_5s": mixed.get("request_counts"), "short_lines_answered_by_cancel": answered_short}


async def flood(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    async def one(key: str, seed: int) -> dict[str, Any]:
        return await stream(client, key, {"messages": [{"role": "user", "content": text(12, seed)}],
                                           "max_tokens": 16, "ignore_eos": True, "temperature": 0})
    alone = await one("k2", 1)
    rounds = []
    for r in range(args.rounds):
        start = time.monotonic()
        a = [asyncio.create_task(one("k1", 100 * r + i)) for i in range(args.n or 32)]
        await asyncio.sleep(1.0)
        b = await one("k2", 7000 + r)
        done = await asyncio.gather(*a)
        rounds.append({"b": b, "a_statuses": sorted({x["status"] for x in done}), "a_count": len(done),
                       "a_last_end_s": round(time.monotonic() - start, 2),
                       "a_tokens_per_s": round(16 * len(done) / (time.monotonic() - start), 2)})
    return {"b_alone": alone, "rounds": rounds}


# -- the run --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="harness.neighbours", description=__doc__.split("\n\n")[0])
    p.add_argument("run", choices=["burst", "cached", "tools", "mcp", "batch", "flood"])
    p.add_argument("--rounds", type=int, default=3, help="probes alone, and beside the traffic (1..20)")
    p.add_argument("--tokens", type=int, default=120, help="each probe's tokens (8..1000)")
    p.add_argument("--n", type=int, default=0, help="the traffic's size: burst's prompts (2), the batch's lines "
                   "(300), the flood's requests (32); 0: the default (at most 1000)")
    p.add_argument("--threads", type=int, default=1, help="the server's --threads")
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for servelm serve (repeatable)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 20 or not 8 <= args.tokens <= 1000 or not 0 <= args.n <= 1000:
        p.error("--rounds 1..20, --tokens 8..1000, --n 0..1000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = tempfile.TemporaryDirectory(prefix="servelm-neighbours-")
    root = Path(scratch.name)
    (root / "keys").write_text("k1\nk2\nmon monitor\n")
    flags = ["--api-key-file", str(root / "keys"), "--threads", str(args.threads), *args.server_arg]
    if args.run == "batch":
        flags += ["--state-dir", str(root / "state")]
    if args.run == "flood" and "--max-num-seqs" not in flags:
        flags += ["--max-num-seqs", "4"]
    mcp_server = None
    port = servers.free_port()
    argv = [str(servers.servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port), "--no-embedding-model",
            "--chat-embedding-window", "0", *flags]
    if args.run == "mcp":
        mcp_port = servers.free_port()
        mcp_server = subprocess.Popen([sys.executable, "-m", "tests.mcp_servers", "http", str(mcp_port)],
                                      cwd=servers.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        argv += ["--allowed-mcp-servers", f"http://127.0.0.1:{mcp_port}"]
    proc = servers.ServerProcess(servers.ServerSpec("servelm", argv, port), root / "server.log", sample_every_s=0.25)
    try:
        proc.start()
        asyncio.run(proc.wait_ready(600))
        result = asyncio.run(_run(args, proc.spec.root_url, mcp_port if mcp_server else 0))
        result["peak_rss_mib"] = round(proc.peak_rss_kib / 1024, 1)
    finally:
        proc.stop()
        if mcp_server is not None:
            mcp_server.terminate()
            mcp_server.wait(10)
        scratch.cleanup()
    result = {"run": args.run, "server_flags": flags, **result}
    out = json.dumps(result, indent=1)
    print(out)
    if args.out:
        args.out.write_text(out)
    return 0


async def _run(args: argparse.Namespace, url: str, mcp_port: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await probe(client, 8, 1)  # warm
        if args.run == "burst":
            return await burst(client, args)
        if args.run == "cached":
            return await cached(client, args)
        if args.run == "tools":
            return await tools(client, args)
        if args.run == "mcp":
            return await mcp(client, args, f"http://127.0.0.1:{mcp_port}")
        if args.run == "batch":
            return await batch(client, args)
        result = await flood(client, args)
        result["tenants"] = [line for line in (await client.get("/metrics", headers=headers("mon"))).text.splitlines()
                             if line.startswith("servelm_tenant_tokens_total")]
        return result


if __name__ == "__main__":
    sys.exit(main())
