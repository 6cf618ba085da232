"""How long `servelm serve` takes from its command to /health answering 200 (once its models are loaded), on 127.0.0.1 and a free
port, `--runs` times in a row; prints one JSON object. The first run of a model, settings and build reads the
start-up self-check's probe; the next ones take its kept finding (docs/exactness.md), unless `--cold`, which gives
every run a cache directory of its own.

    .venv/bin/python -m harness.start_time --runs 3
    .venv/bin/python -m harness.start_time --cold --runs 2 -- --no-embedding-model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from harness.servers import ServerProcess, ServerSpec, free_port, servelm_exe

TIMEOUT_S = 300.0  # a run that is not healthy by then is stopped and counted as failed


def one(flags: list[str], cache: str | None, log_dir: Path) -> float | None:
    """Seconds until /health answers (None: it exited or timed out); the server is stopped after."""
    port = free_port()
    spec = ServerSpec("servelm", [str(servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                      port, env={"XDG_CACHE_HOME": cache} if cache is not None else {})
    server = ServerProcess(spec, log_dir / f"servelm-{port}.log")
    server.start()
    try:
        return asyncio.run(server.wait_ready(TIMEOUT_S))
    except RuntimeError:
        return None
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="a cache directory of its own for every run")
    p.add_argument("flags", nargs="*", help="flags for servelm serve (after --)")
    args = p.parse_args()
    times = []
    with tempfile.TemporaryDirectory(prefix="servelm-start-") as tmp:
        for run in range(max(1, args.runs)):
            cache = f"{tmp}/cache-{run}" if args.cold else None
            times.append(one(args.flags, cache, Path(tmp)))
    print(json.dumps({"flags": args.flags, "cold": args.cold,
                      "healthy_s": [round(t, 2) if t is not None else None for t in times]}))


if __name__ == "__main__":
    main()
