"""Exactness and its cost on every quantization llama.cpp serves on this CPU (docs/exactness.md's matrix).

For each type (the embedded SmolLM2 requantized by scripts/requantize.py, and Gemma 3 270M): what the start-up
self-check finds and which fences it takes (runners/llamacpp.load_exact), and the speed of each way of fencing the
same file, each measured in a process of its own (ggml's tiled K-quant switch is the process's):
- defaults: llama.cpp's own (tiled K-quant matmul on, repacked weights, calls of any shape), not exact;
- kernel: the kernel fences (tiled kernel off, then two rows a call, no repacked weights, or both);
- shape: the fast kernels kept and every call given a shape that takes one path (repacked Q4_K in rows by 4);
- tiled: the same with the tiled kernel on (GGML_CPU_TILED_MM=1: every micro-batch 8 rows or more).
Each reads 4 prompts of 126 tokens (its whole tile, then chunks of the runner's max_rows, as the scheduler cuts
them), one stream decoding, 16 streams decoding;
each the best of three runs, and of `--rounds` processes per mode, the modes interleaved. Measure on a quiet
machine: llama.cpp's threads spin.

    .venv/bin/python -m harness.exactness_matrix [--types Q4_K_M,F16] [--modes kernel,shape] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("defaults", "kernel", "shape", "tiled")
_RATES = ("prompt_tok_s", "decode1_tok_s", "decode16_tok_s")  # tokens a wall second; each also a CPU second (_cpu_s)
_ALL = _RATES + tuple(k.replace("_s", "_cpu_s") for k in _RATES)


def _measure(path: str, mode: str, threads: int | None = None) -> dict:
    """In this process (its tiled switch set by _run): load the file fenced as `mode` says, time the three loads."""
    import numpy as np

    from servelm.engine.plan import Clear, ScheduledChunk, StepPlan
    from servelm.runners.llamacpp import KERNEL_FENCES, SHAPE_FENCES, LlamaCppRunner, load_exact

    kw = {"num_slots": 16, "context_window": 512, "threads": threads}
    fences = KERNEL_FENCES if mode == "kernel" else KERNEL_FENCES[:2] + SHAPE_FENCES + KERNEL_FENCES[2:]
    runner = LlamaCppRunner(path, **kw) if mode == "defaults" else load_exact(path, fences, **kw)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(100, min(runner.vocab_size, 30000), 400)]

    def chunk(slot: int, start: int, tokens: list[int], want: bool = True, tiled: bool = False) -> ScheduledChunk:
        return ScheduledChunk(None, slot, start, tuple(tokens), toks[start - 1] if start else None,
                              samplers=("x",) if want else (), tiled=tiled)

    clear = [Clear(s) for s in range(16)]

    def timed(plans: list[StepPlan]) -> tuple[float, float]:
        """The best of three runs of the plans, from empty slots (a noisy machine slows runs, never speeds them): in
        wall seconds, and in the process's CPU seconds (every thread's: ggml's spin too)."""
        wall = cpu = float("inf")
        for _ in range(3):
            runner.step(StepPlan([], clear))
            t, c = time.perf_counter(), time.process_time()
            for plan in plans:
                runner.step(plan)
            wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
        return wall, cpu

    rows, tile = runner.max_rows, runner.tile_rows
    tiles = 126 // tile * tile if tile else 0  # as the scheduler reads it: its whole tiles, then rows
    cuts = ([(0, tiles)] if tiles else []) + [(a, min(a + rows, 126)) for a in range(tiles, 126, rows)]
    prompt = timed([StepPlan([chunk(s, a, toks[a:b], b == 126, a < tiles)]) for s in range(4) for a, b in cuts])
    one = timed([StepPlan([chunk(0, p, [toks[p]])]) for p in range(48)])
    sixteen = timed([StepPlan([chunk(s, p, [toks[p]]) for s in range(16)]) for p in range(32)])
    out = {"exact": runner.exactness.exact, "exactness": runner.exactness.describe()}
    for key, tokens, (wall, cpu) in (("prompt", 4 * 126, prompt), ("decode1", 48, one), ("decode16", 16 * 32, sixteen)):
        out |= {f"{key}_tok_s": tokens / wall, f"{key}_tok_cpu_s": tokens / cpu}
    runner.close()
    return out


def _run(path: str, mode: str, threads: int | None) -> dict:
    env = {**os.environ, "GGML_CPU_TILED_MM": "1" if mode in ("defaults", "tiled") else "0"}
    code = f"import json, harness.exactness_matrix as m; print(json.dumps(m._measure({path!r}, {mode!r}, {threads!r})))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fences(row: dict) -> str:
    words = row["exactness"]
    return words.split("fences: ", 1)[1].rstrip(")") if "fences: " in words else ("none" if row["exact"] else "not exact")


def main() -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    import requantize  # scripts/requantize.py

    from servelm.config import gemma_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(requantize.TYPES) + ",gemma")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=1, help="processes per mode (1 to 5), interleaved: the best is kept")
    ap.add_argument("--threads", type=int, help="llama.cpp's threads (1 to the CPUs; default all): with 1, the CPU "
                    "seconds are the kernels' own, unmoved by other processes on a busy machine (no spinning workers)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or not 1 <= args.rounds <= 5 or not 1 <= (args.threads or 1) <= (os.cpu_count() or 1):
        ap.error(f"--modes: of {', '.join(MODES)}; --rounds: 1 to 5; --threads: 1 to {os.cpu_count()}")
    rows = []
    print("| type | mode | fences | prompt tok/s (per CPU s) | 1 stream | 16 streams |")
    print("|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        path = str(gemma_model_path() if kind == "gemma" else requantize.requantize(kind))
        best: dict[str, dict] = {}
        for _ in range(args.rounds):  # the modes interleaved, so that the machine's load falls on each alike
            for mode in modes:
                got = _run(path, mode, args.threads)
                old = best.setdefault(mode, got)
                best[mode] = {**got, **{k: max(got[k], old[k]) for k in _ALL}}
        for mode in modes:
            row = best[mode]
            rows.append({"type": kind, "mode": mode, **row})
            print(f"| {kind} | {mode} | {_fences(row) if mode != 'defaults' else '(not exact)'} | "
                  + " | ".join(f"{row[k]:.1f} ({row[k.replace('_s', '_cpu_s')]:.1f})" for k in _RATES) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
