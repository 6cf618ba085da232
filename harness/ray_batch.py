"""`servelm batch --ray` on a local two-node Ray cluster (one CPU a node, one engine thread an actor): the same
batch file with one engine actor and with two, and the lines per second of each, counted from the first answer
back to the last (each actor loads its model first; that start is left out, and printed apart).

    .venv/bin/python -m harness.ray_batch [--lines 128] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.servers import MODEL_ID
from servelm.bench.loadgen import RequestSpec


def run(cluster_address: str, source: Path, actors: int) -> tuple[float, float, int]:
    """(seconds to the first answer, seconds from the first answer to the last, lines answered)."""
    output = source.with_name(f"out-{actors}.jsonl")
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "servelm", "batch", "-i", str(source), "-o", str(output), "--ray",
                             "--ray-address", cluster_address, "--actors", str(actors), "--threads", "1",
                             "--no-embedding-model", "--chat-embedding-window", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        if first is None and output.exists() and output.stat().st_size:
            first = time.perf_counter()
        time.sleep(0.05)
    end = time.perf_counter()
    if proc.returncode:
        raise SystemExit(f"servelm batch --ray --actors {actors} failed ({proc.returncode})")
    lines = len(output.read_text().splitlines())
    first = first or end
    return first - start, end - first, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="servelm-ray-batch-"))
    spec = RequestSpec(stream=False, max_tokens=args.max_tokens, prompt_tokens=97, ignore_eos=True, prompt_salt="ray")
    source = work / "in.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                          "body": spec.body(MODEL_ID, i)}) + "\n" for i in range(args.lines)))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        rates = {}
        for actors in (1, 2):
            started, taken, lines = run(cluster.address, source, actors)
            # the first answers arrive with the first block: the lines after it, over the time after it
            rates[actors] = (lines - min(lines, 16)) / taken if taken else 0.0
            print(f"{actors} actor(s): {lines} lines; first answer after {started:.1f} s, then {taken:.1f} s "
                  f"({rates[actors]:.2f} lines/s)", flush=True)
        print(f"two actors against one: {rates[2] / rates[1]:.2f}x")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
