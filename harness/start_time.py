"""How long `servelm serve` takes from its command to a healthy /health listing its model, on 127.0.0.1 and a free
port, `--runs` times in a row; prints one JSON object. The first run of a model, settings and build reads the
start-up self-check's probe; the next ones take its kept finding (docs/exactness.md), unless `--cold`, which gives
every run a cache directory of its own.

    .venv/bin/python -m harness.start_time --runs 3
    .venv/bin/python -m harness.start_time --cold --runs 2 -- --no-embedding-model
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

TIMEOUT_S = 300.0  # a run that is not healthy by then is stopped and counted as failed


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(flags: list[str], cache: str | None) -> float | None:
    """Seconds until /health lists a deployment (None: it exited or timed out); the server is stopped after."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    if cache is not None:
        env["XDG_CACHE_HOME"] = cache
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while time.monotonic() - began < TIMEOUT_S and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if r.status_code == 200 and r.json().get("deployments"):
                    return time.monotonic() - began
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.05)
        return None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="a cache directory of its own for every run")
    p.add_argument("flags", nargs="*", help="flags for servelm serve (after --)")
    args = p.parse_args()
    times = []
    for _ in range(max(1, args.runs)):
        if args.cold:
            with tempfile.TemporaryDirectory(prefix="servelm-start-") as cache:
                times.append(one(args.flags, cache))
        else:
            times.append(one(args.flags, None))
    print(json.dumps({"flags": args.flags, "cold": args.cold,
                      "healthy_s": [round(t, 2) if t is not None else None for t in times]}))


if __name__ == "__main__":
    main()
