"""The kernel limit: what llama.cpp's own `llama-batched-bench` (same build, same flags) allows for a workload's shape.

For N streams that each read a P-token prompt and write G tokens, `llama-batched-bench -npp P -ntg G -npl N` reads the
N prompts in one go and then decodes the N sequences together, a row each per pass: no server, no sampling, no HTTP.
Its output tokens per second, N·G ÷ (prompt time + decode time), is the most a server can give that workload on this
machine; a server's figure divided by it is the fraction of the limit it reaches.

The prompt is each request's part that a prefix cache cannot give: harness/compare.py takes the prompt tokens
servelm counted less those its cache gave (the chat template's default system prompt; shared-prefix-4's shared
system prompt), as llama-server's cache gives them too; alone, this module estimates the workload's words plus a
chat template's tokens. Each shape runs REPEATS times in one invocation and the fastest is kept: the first pays for
touching the weights, and a shared machine's speed drifts from minute to minute (the limit is the best it gives).

    .venv/bin/python -m harness.limit                                  # the default workloads, SmolLM2
    .venv/bin/python -m harness.limit --model gemma3 --workloads 1-stream,16-streams

`kernel_limits` is what harness/compare.py calls after its runs, with the prompt lengths the servers reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import llama_server, models
from servelm.bench.workloads import CHAT, WORKLOADS, Workload

DEFAULT_WORKLOADS = "1-stream,16-streams,shared-prefix-4,long-prompts-4"
REPEATS = 4  # runs of each shape; the fastest is the limit
CHAT_TEMPLATE_TOKENS = 38  # what a chat template adds to a one-message prompt, about (SmolLM2: 38, Gemma 3: 14)


@dataclass(frozen=True)
class Limit:
    """One workload's kernel limit: llama-batched-bench's row for its shape."""

    workload: str
    streams: int
    prompt_tokens: int
    output_tokens: int
    prompt_s: float  # reading every stream's prompt
    decode_s: float  # decoding every stream's output tokens together
    prompt_tok_s: float
    decode_tok_s: float

    @property
    def output_tok_s(self) -> float:
        """The workload's output tokens per second at the limit."""
        return self.streams * self.output_tokens / (self.prompt_s + self.decode_s)

    def to_dict(self) -> dict[str, float | int | str | bool]:
        return {**asdict(self), "output_tok_s": self.output_tok_s}


def measurable(w: Workload) -> bool:
    """A shape batched-bench has: chat, one turn, a fixed output length, no response format or best_of."""
    return w.model == CHAT and w.turns == 1 and w.ban_eos and not w.extra_body and w.stream


def shape(w: Workload, prompt_tokens: float | None) -> tuple[int, int, int]:
    """(prompt tokens, output tokens, streams) of a workload: the prompt tokens a request must read when known
    (`prompt_tokens`), else the workload's words plus a chat template's tokens."""
    if prompt_tokens is None:
        prompt_tokens = w.prompt_tokens + CHAT_TEMPLATE_TOKENS
    return max(1, round(prompt_tokens)), w.max_tokens, w.concurrency


def run_batched_bench(binary: Path, model: Path, threads: int, prompt: int, output: int, streams: int,
                      extra: tuple[str, ...] = ()) -> dict[str, float]:
    """The fastest of REPEATS llama-batched-bench rows (jsonl lines) for this shape, flash attention on, llama-server's
    batch sizes."""
    ctx = streams * (prompt + output) + 64
    argv = [str(binary), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads),
            "-fa", "on", "-npp", ",".join([str(prompt)] * REPEATS), "-ntg", str(output), "-npl", str(streams),
            "--output-format", "jsonl", "--kv-unified", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in (done.stdout + "\n" + done.stderr).splitlines()
            if line.startswith("{") and '"speed_tg"' in line]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({done.returncode}): {' '.join(argv)}\n{done.stderr[-2000:]}")
    return max(rows, key=lambda row: row["pl"] * row["tg"] / row["t"])


def kernel_limits(model: Path, workloads: list[Workload], threads: int,
                  prompt_tokens: dict[str, float | None] | None = None, extra: tuple[str, ...] = ()) -> dict[str, Limit]:
    """Each measurable workload's limit (see the module's docstring), by name; `extra`: more llama-batched-bench flags
    (--no-repack: the kernels servelm keeps to for a model whose repacked ones round by rows)."""
    binary = llama_server.build(tool="llama-batched-bench")
    found: dict[str, Limit] = {}
    for w in workloads:
        if not measurable(w):
            continue
        prompt, output, streams = shape(w, (prompt_tokens or {}).get(w.name))
        row = run_batched_bench(binary, model, threads, prompt, output, streams, extra)
        found[w.name] = Limit(w.name, streams, prompt, output, row["t_pp"], row["t_tg"], row["speed_pp"], row["speed_tg"])
    return found


def markdown(limits: dict[str, Limit]) -> str:
    out = ["| workload | streams | prompt tok to read | out tok | prompt tok/s | decode tok/s | limit: out tok/s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {x.workload} | {x.streams} | {x.prompt_tokens} "
            f"| {x.output_tokens} | {x.prompt_tok_s:.1f} | {x.decode_tok_s:.1f} | {x.output_tok_s:.1f} |"
            for x in limits.values()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=models.NAMES, default=models.DEFAULT, help="which model (default: SmolLM2)")
    p.add_argument("--model-path", default=None, help="a GGUF file instead")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=None, help="tokens each request reads (default: estimated)")
    p.add_argument("--no-repack", action="store_true", help="without repacked weights, as servelm serves a model "
                   "whose self-check needs that fence (Gemma 3's Q4_K_M here)")
    args = p.parse_args(argv)
    by_name = {w.name: w for w in WORKLOADS}
    workloads = [by_name[n] for n in args.workloads.split(",") if n]
    model = Path(args.model_path) if args.model_path else models.path(args.model)
    prompts: dict[str, float | None] = {w.name: args.prompt_tokens for w in workloads}
    limits = kernel_limits(model, workloads, args.threads, prompts, ("--no-repack",) if args.no_repack else ())
    print(markdown(limits))
    skipped = [w.name for w in workloads if w.name not in limits]
    if skipped:
        print(f"\nno batched-bench shape for: {', '.join(skipped)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
