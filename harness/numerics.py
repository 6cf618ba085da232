"""Which llama.cpp settings keep one sequence's logits bitwise the same whatever else happens (docs/exactness.md).

A bare llama.cpp context (the project's own build) decodes hand-made batches: one sequence reads a 300-token
prompt and greedily decodes, alone (the reference) and then in each perturbed way; every logits row is compared
with the reference's, bitwise. For each setting (flash attention on/off, a unified cache or a stream per sequence)
it prints whether the rows are identical and the largest difference, then the speed of each setting on three
shapes (16 sequences decoding, one decoding, a 768-token prompt read in 256-token chunks).

    .venv/bin/python -m harness.numerics            # about two minutes on 2 cores; run it on a quiet machine
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable

import llama_cpp as C
import numpy as np

from harness.servers import default_model_path
from servelm.bench.loadgen import build_prompt

Item = tuple[int, int, int, bool]  # (sequence, position, token, wants logits)


class Context:
    """A llama.cpp context over one model, decoding batches of Items."""

    def __init__(self, model: C.llama_model_p, *, flash_attn: bool, unified: bool, n_seq: int, n_ctx: int,
                 threads: int) -> None:
        p = C.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 1024, 1024, n_seq
        p.kv_unified = unified
        p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        self.ctx = C.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = C.llama_get_memory(self.ctx)
        self.batch = C.llama_batch_init(1024, 0, 1)
        self.vocab = int(C.llama_vocab_n_tokens(C.llama_model_get_vocab(model)))

    def decode(self, items: list[Item]) -> np.ndarray:
        b = self.batch
        b.n_tokens = len(items)
        for i, (seq, pos, token, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, out
            b.seq_id[i][0] = seq
        if C.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(1 for item in items if item[3])
        return np.ctypeslib.as_array(C.llama_get_logits(self.ctx), shape=(rows, self.vocab)).copy()

    def clear(self) -> None:
        C.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)


def tokenize(model: C.llama_model_p, text: str) -> list[int]:
    data = text.encode()
    buf = (C.llama_token * (len(data) + 8))()
    n = C.llama_tokenize(C.llama_model_get_vocab(model), data, len(data), buf, len(buf), False, False)
    return list(buf[:n])


def read_and_decode(ctx: Context, prompt: list[int], other: list[int], chunks: list[int], *, seq: int = 0,
                    company: bool = False, pre: int = 0, steps: int = 12) -> list[np.ndarray]:
    """Rows of `prompt`'s last token and of `steps` greedy tokens after it. `company`: every step also carries one
    token of another sequence; `pre`: another sequence's `pre` tokens are read first (they take cells)."""
    for i in range(0, pre, 64):
        ctx.decode([(6, i + j, t, False) for j, t in enumerate(other[i:min(pre, i + 64)])])
    rows, pos, cpos = [], 0, 0
    for n in chunks:
        items: list[Item] = [(seq, pos + j, prompt[pos + j], pos + j == len(prompt) - 1) for j in range(n)]
        if company:
            items.append((5, cpos, other[cpos], False))
            cpos += 1
        out = ctx.decode(items)
        pos += n
        if pos == len(prompt):
            rows.append(out[0])
    token = int(np.argmax(rows[-1]))
    for _ in range(steps):
        items = [(seq, pos, token, True)] + ([(5, cpos, other[cpos], False)] if company else [])
        cpos += company
        row = ctx.decode(items)[0]
        rows.append(row)
        pos, token = pos + 1, int(np.argmax(row))
    return rows


def exactness(model: C.llama_model_p, threads: int) -> None:
    prompt = tokenize(model, build_prompt(330, "numerics-prompt"))[:300]
    other = tokenize(model, build_prompt(330, "numerics-other"))
    cases: dict[str, Callable[[Context], list[np.ndarray]]] = {
        "chunks 256+44": lambda c: read_and_decode(c, prompt, other, [256, 44]),
        "chunks 64x4+44": lambda c: read_and_decode(c, prompt, other, [64] * 4 + [44]),
        "chunks of 32": lambda c: read_and_decode(c, prompt, other, [32] * 9 + [12]),
        "another sequence's cells first": lambda c: read_and_decode(c, prompt, other, [300], pre=200),
        "beside another sequence": lambda c: read_and_decode(c, prompt, other, [300], company=True),
        "at another sequence id": lambda c: read_and_decode(c, prompt, other, [300], seq=3),
    }
    print("| setting | " + " | ".join(cases) + " |")
    print("|---|" + "---|" * len(cases))
    for flash, unified in ((True, True), (True, False), (False, True), (False, False)):
        ctx = Context(model, flash_attn=flash, unified=unified, n_seq=8, n_ctx=4096 if unified else 8 * 1024,
                      threads=threads)
        reference = read_and_decode(ctx, prompt, other, [300])
        ctx.clear()
        cells = []
        for run in cases.values():
            rows = run(ctx)
            ctx.clear()
            diff = max(float(np.abs(a - b).max()) for a, b in zip(reference, rows))
            cells.append("same" if diff == 0 else f"differs ({diff:.2f})")
        ctx.close()
        name = f"flash attention {'on' if flash else 'off'}, {'unified' if unified else 'a stream per sequence'}"
        print(f"| {name} | " + " | ".join(cells) + " |")


def speed(model: C.llama_model_p, threads: int, rounds: int) -> None:
    """The settings' speeds, measured in interleaved rounds (this machine's speed wanders by a third from minute to
    minute: one setting measured after another would mostly measure the wander); medians."""
    prompt = tokenize(model, build_prompt(140, "numerics-speed"))[:133]
    long = tokenize(model, build_prompt(800, "numerics-long"))[:768]
    settings = [(True, True), (True, False), (False, False)]
    contexts = [Context(model, flash_attn=f, unified=u, n_seq=16, n_ctx=8192 if u else 16 * 2048, threads=threads)
                for f, u in settings]
    figures: list[list[list[float]]] = [[[], [], []] for _ in settings]
    for _ in range(rounds):
        for ctx, out in zip(contexts, figures):
            ctx.clear()
            for s in range(16):
                ctx.decode([(s, j, t, j == 132) for j, t in enumerate(prompt)])
            start = time.perf_counter()
            for k in range(32):
                ctx.decode([(s, 133 + k, 100 + s, True) for s in range(16)])
            out[0].append((time.perf_counter() - start) / 32 * 1000)
            for s in range(1, 16):
                C.llama_memory_seq_rm(ctx.mem, s, -1, -1)
            start = time.perf_counter()
            for k in range(32):
                ctx.decode([(0, 165 + k, 100, True)])
            out[1].append((time.perf_counter() - start) / 32 * 1000)
            ctx.clear()
            start = time.perf_counter()
            for i in range(0, 768, 256):
                ctx.decode([(0, i + j, t, i + j == 767) for j, t in enumerate(long[i:i + 256])])
            out[2].append(768 / (time.perf_counter() - start))
    print(f"\n({rounds} interleaved rounds, medians)")
    print("| setting | 16 sequences decode a step | 1 sequence decodes a step | 768-token prompt in 256s |")
    print("|---|---:|---:|---:|")
    for (flash, unified), ctx, (many, one, read) in zip(settings, contexts, figures):
        ctx.close()
        name = f"flash attention {'on' if flash else 'off'}, {'unified' if unified else 'a stream per sequence'}"
        print(f"| {name} | {statistics.median(many):.1f} ms | {statistics.median(one):.1f} ms | "
              f"{statistics.median(read):.0f} tokens/s |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the speed measurements")
    args = p.parse_args(argv)

    @C.llama_log_callback
    def quiet(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level >= 3 and level != 5:
            os.write(2, text)

    C.llama_log_set(quiet, ctypes.c_void_p(0))
    C.llama_backend_init()
    model = C.llama_model_load_from_file(str(default_model_path()).encode(), C.llama_model_default_params())
    if not model:
        raise SystemExit("could not load the model")
    try:
        exactness(model, args.threads)
        speed(model, args.threads, args.rounds)
    finally:
        C.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
