"""The engine's own time a decode step around the model's pass, on the runner alone (no server, no event loop
contending for the GIL): the runner's work outside llama_decode (the batch, the logits rows handed out) and the
greedy argmax of every row, as the sampler takes it.

    .venv/bin/python -m harness.step_overhead --model gemma3           # 16 streams of Gemma 3's 262k vocabulary
    PYTHONPATH=<another tree> .venv/bin/python -m harness.step_overhead  # the same on another tree, to compare

It loads the model fenced as the served default is for Gemma 3 and SmolLM2 (without repacked weights: the runner's
own time does not depend on the fence), reads 8 prompt tokens into each of `--streams` slots, then times `--steps`
decode steps of one row a stream, `--rounds` times, and prints each round's milliseconds a step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from harness import models
from servelm.engine.plan import Clear, ScheduledChunk, StepPlan
from servelm.engine.sampling import argmax_rows
from servelm.runners.llamacpp import LlamaCppRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=models.NAMES, default="gemma3")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    runner = LlamaCppRunner(models.path(args.model), num_slots=args.streams, context_window=512,
                            threads=args.threads, repack=False)
    toks = [int(t) for t in np.random.default_rng(0).integers(100, 30000, 8 + args.steps)]

    def chunk(slot: int, start: int, tokens: list[int]) -> ScheduledChunk:
        return ScheduledChunk(None, slot, start, tuple(tokens), toks[start - 1] if start else None, samplers=("x",))

    steps = [StepPlan([chunk(s, p, [toks[p]]) for s in range(args.streams)]) for p in range(8, 8 + args.steps)]
    for _ in range(args.rounds):
        runner.step(StepPlan([], [Clear(s) for s in range(args.streams)]))
        runner.step(StepPlan([chunk(s, 0, toks[:8]) for s in range(args.streams)]))
        own = pick = 0.0
        for plan in steps:
            start, decoding = time.perf_counter(), runner.decode_seconds
            logits = runner.step(plan)
            stepped = time.perf_counter()
            own += stepped - start - (runner.decode_seconds - decoding)
            argmax_rows(logits)
            pick += time.perf_counter() - stepped
        n = len(steps)
        print(f"ms a step of {args.streams} rows: runner outside llama_decode {own / n * 1e3:.3f}, "
              f"greedy argmax {pick / n * 1e3:.3f}, together {(own + pick) / n * 1e3:.3f}")
    runner.close()


if __name__ == "__main__":
    main()
