"""Exactness and its cost on every quantization llama.cpp serves on this CPU (docs/exactness.md's matrix).

For each type (the embedded SmolLM2 requantized by scripts/requantize.py, and Gemma 3 270M): what the start-up
self-check finds and which fences it takes (runners/llamacpp.load_exact), and the speed of the fenced runner against
llama.cpp's defaults on the same file (tiled K-quant matmul on, repacked weights, one-row calls), each measured in
a process of its own: prompt reading (4 prompts of 126 tokens in chunks of 63), one stream decoding, 16 streams
decoding; each the best of three runs. Measure on a quiet machine: llama.cpp's threads spin.

    .venv/bin/python -m harness.exactness_matrix [--types Q4_K_M,F16] [--json out.json]
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


def _measure(path: str, fenced: bool) -> dict:
    """In this process: load the file (fenced: as servelm does; else as llama.cpp's defaults), time the three loads."""
    import numpy as np

    from servelm.engine.plan import Clear, ScheduledChunk, StepPlan
    from servelm.runners.llamacpp import LlamaCppRunner, load_exact

    kw = {"num_slots": 16, "context_window": 512}
    runner = load_exact(path, **kw) if fenced else LlamaCppRunner(path, **kw)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(100, min(runner.vocab_size, 30000), 400)]

    def chunk(slot: int, start: int, tokens: list[int], want: bool = True) -> ScheduledChunk:
        return ScheduledChunk(None, slot, start, tuple(tokens), toks[start - 1] if start else None, samplers=("x",) if want else ())

    clear = [Clear(s) for s in range(16)]

    def timed(plans: list[StepPlan]) -> float:
        """The best of three runs of the plans, from empty slots (a noisy machine slows runs, never speeds them)."""
        best = float("inf")
        for _ in range(3):
            runner.step(StepPlan([], clear))
            t = time.perf_counter()
            for plan in plans:
                runner.step(plan)
            best = min(best, time.perf_counter() - t)
        return best

    prompt = timed([StepPlan([chunk(s, a, toks[a:a + 63], a == 63)]) for s in range(4) for a in (0, 63)])
    one = timed([StepPlan([chunk(0, p, [toks[p]])]) for p in range(48)])
    sixteen = timed([StepPlan([chunk(s, p, [toks[p]]) for s in range(16)]) for p in range(32)])
    out = {"exact": runner.exactness.exact, "exactness": runner.exactness.describe(),
           "prompt_tok_s": 4 * 126 / prompt, "decode1_tok_s": 48 / one, "decode16_tok_s": 16 * 32 / sixteen}
    runner.close()
    return out


def _run(path: str, fenced: bool) -> dict:
    env = {**os.environ, "GGML_CPU_TILED_MM": "0" if fenced else "1"}
    code = f"import json, harness.exactness_matrix as m; print(json.dumps(m._measure({path!r}, {fenced})))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    import requantize  # scripts/requantize.py

    from servelm.config import gemma_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(requantize.TYPES) + ",gemma")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    print("| type | exact | fences | prompt | 1 stream | 16 streams |")
    print("|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        path = str(gemma_model_path() if kind == "gemma" else requantize.requantize(kind))
        plain, fenced = _run(path, False), _run(path, True)  # the file's pages are warm for both
        ratio = {k: fenced[k] / plain[k] for k in ("prompt_tok_s", "decode1_tok_s", "decode16_tok_s")}
        rows.append({"type": kind, "fenced": fenced, "llama_cpp_defaults": plain, "ratio": ratio})
        words = fenced["exactness"]
        fences = words.split("fences: ", 1)[1].rstrip(")") if "fences: " in words else ("none" if fenced["exact"] else words)
        print(f"| {kind} | {'yes' if fenced['exact'] else 'no'} | {fences} | {ratio['prompt_tok_s']:.2f}x "
              f"| {ratio['decode1_tok_s']:.2f}x | {ratio['decode16_tok_s']:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
