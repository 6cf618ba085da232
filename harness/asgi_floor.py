"""The least CPU a streamed chunk can cost a Python ASGI server on this machine: the floor under servelm's own.

A bare ASGI app on uvicorn (uvloop and httptools, as servelm runs) streams chunks that a producer thread hands to the
event loop one at a time with `call_soon_threadsafe`, as servelm's engine hands over a step's outputs. Each chunk is
one SSE line of a JSON made once: no routing, no middleware, no models, no serialization. What the event loop's
thread spends a chunk here (the wake-up, the queue, the ASGI send, the socket write) is what any server on this stack
spends at least; servelm's own figure is `harness.cpu_per_token`'s "event loop CPU".

    .venv/bin/python -m harness.asgi_floor [--chunks 1000] [--period 0.02] [--rounds 3] [--burn 2]

`--burn N` keeps N processes spinning while it streams, as llama.cpp's threads keep the cores busy during a pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from harness.procfs import cpu_s
from harness.servers import free_port

CHUNK = ("data: " + json.dumps({
    "id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "m",
    "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}],
}) + "\n\n").encode()
MAX_CHUNKS = 100_000  # a stream's chunks at most (the query's bound)
MAX_ROUNDS, MAX_BURN = 100, 64


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """GET /stream?n=N&period=S: N chunks, one every S seconds from a producer thread; GET /cpu: the event loop
    thread's CPU seconds so far."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/cpu":
        body = json.dumps({"loop_cpu_s": time.thread_time()}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
    n, period = min(int(query.get("n", "64")), MAX_CHUNKS), min(float(query.get("period", "0.02")), 1.0)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue[bytes | None]()

    def produce() -> None:
        for _ in range(n):
            time.sleep(period)
            loop.call_soon_threadsafe(queue.put_nowait, CHUNK)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=produce, daemon=True).start()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    while (chunk := await queue.get()) is not None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def _exit_with(parent: int) -> None:
    """Exit once the measuring process is gone (killed without its cleanup), so that nothing is left running."""
    while not _orphaned(parent):
        time.sleep(0.5)
    os._exit(0)


def serve(port: int) -> None:
    import uvicorn

    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")


def _spin(parent: int) -> None:
    while not _orphaned(parent):
        for _ in range(1_000_000):
            pass


def measure(chunks: int, period: float, rounds: int, burn: int) -> list[dict[str, float]]:
    """Each round's chunks received, and the event loop thread's and the whole server's CPU a chunk (ms)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "harness.asgi_floor", "--serve", str(port)])
    burners = [multiprocessing.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(burn)]
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=60 + chunks * period * 2) as client:
            for _ in range(200):
                try:
                    client.get(url + "/cpu")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            for b in burners:
                b.start()
            rows = []
            for _ in range(rounds):
                loop0, proc0 = client.get(url + "/cpu").json()["loop_cpu_s"], cpu_s(server.pid)
                with client.stream("GET", f"{url}/stream?n={chunks}&period={period}") as r:
                    got = sum(line.startswith("data: {") for line in r.iter_lines())
                loop1, proc1 = client.get(url + "/cpu").json()["loop_cpu_s"], cpu_s(server.pid)
                rows.append({"chunks": got, "loop_ms": (loop1 - loop0) * 1e3 / max(got, 1),
                             "process_ms": (proc1 - proc0) * 1e3 / max(got, 1)})
            return rows
    finally:
        for b in burners:
            b.kill()
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=1000, help="chunks a round (at most 100,000)")
    p.add_argument("--period", type=float, default=0.02, help="seconds between chunks (at most 1)")
    p.add_argument("--rounds", type=int, default=3, help="at most 100")
    p.add_argument("--burn", type=int, default=0, help="processes kept spinning while it streams (at most 64)")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if (not 1 <= args.chunks <= MAX_CHUNKS or not 0 <= args.period <= 1 or not 1 <= args.rounds <= MAX_ROUNDS
            or not 0 <= args.burn <= MAX_BURN):
        p.error("--chunks 1..100000, --period 0..1, --rounds 1..100, --burn 0..64")
    # a plain kill ends it as Ctrl-C does: through measure's cleanup, which stops the server and the spinners
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rows = measure(args.chunks, args.period, args.rounds, args.burn)
    except KeyboardInterrupt:
        return 130
    print(f"bare ASGI stream, {args.chunks} chunks a round, one every {args.period * 1e3:g} ms, {args.burn} spinning")
    print("| round | chunks | event loop thread CPU a chunk (ms) | server process CPU a chunk (ms) |")
    print("|---|---:|---:|---:|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['chunks']:.0f} | {row['loop_ms']:.3f} | {row['process_ms']:.3f} |")
    print(f"median event loop CPU a chunk: {statistics.median(r['loop_ms'] for r in rows):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
