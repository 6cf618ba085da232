"""What a preemption costs on the real model: a sequence of N tokens saved out of its slot (the Save op a preempted
sequence's cells take when another request takes the slot), read back (Restore), against computing its N tokens
again (what resuming costs when the spill no longer holds them). Best of a few runs each.

    .venv/bin/python -m harness.preemption [--tokens 1000] [--model PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import time

from servelm.config import embedded_model_path
from servelm.engine.plan import Clear, Restore, Save, ScheduledChunk, SeqKey, StepPlan
from servelm.engine.spill import Spilled
from servelm.runners.llamacpp import load_exact


def read(runner, tokens: list[int]) -> float:
    """Compute the tokens into slot 0 from position 0, as prompt chunks of up to max_rows; seconds taken."""
    start = time.perf_counter()
    runner.step(StepPlan(ops=[Clear(0)]))
    for pos in range(0, len(tokens), runner.max_rows):
        part = tuple(tokens[pos: pos + runner.max_rows])
        last = pos + len(part) == len(tokens)
        chunk = ScheduledChunk(SeqKey(0), 0, pos, part, tokens[pos - 1] if pos else None,
                               (SeqKey(0),) if last else ())
        runner.step(StepPlan(chunks=[chunk]))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runner = load_exact(args.model, num_slots=2, max_step_tokens=256, context_window=2048, threads=args.threads)
    tokens = [(i * 7919) % 5000 + 100 for i in range(args.tokens)]
    compute = min(read(runner, tokens) for _ in range(args.repeats))
    saves, restores, size = [], [], 0
    for _ in range(args.repeats):
        entry = Spilled(tuple(tokens), "")
        t = time.perf_counter()
        runner.step(StepPlan(ops=[Save(0, entry)]))
        saves.append(time.perf_counter() - t)
        assert entry.data is not None
        size = len(entry.data)
        runner.step(StepPlan(ops=[Clear(0)]))
        t = time.perf_counter()
        runner.step(StepPlan(ops=[Restore(0, entry.data, len(tokens))]))
        restores.append(time.perf_counter() - t)
    save, restore = min(saves), min(restores)
    print(f"{args.tokens} tokens ({size / 2**20:.1f} MiB of state): save {save * 1000:.1f} ms, restore "
          f"{restore * 1000:.1f} ms, together {(save + restore) * 1000:.1f} ms; computing them again "
          f"{compute * 1000:.0f} ms ({compute / (save + restore):.0f}x the save and restore)")
    runner.close()


if __name__ == "__main__":
    main()
