"""Does a greedy answer depend on the load? 100 temperature-0 requests under issue 14's load patterns, per server.

Each server runs on its own defaults (the model, the address and the threads only). Ten prompts of different
lengths are first answered one at a time, each alone: the reference answers. Then every prompt is sent again
ten times, and each answer is compared with its reference, byte for byte:
- 6 times among 8 identical requests sent together (the 8 answers: 6 counted, alike for every prompt);
- twice among 7 unrelated requests of other lengths sent together;
- once alone, after the same prompt (a warm cache of the same prefix);
- once alone, after a near-identical prompt (its last word changed).
That is 100 answers compared per server; the figure is how many differ from their reference. The
--max-step-tokens pattern of issue 14 is servelm's own flag: tests/e2e/test_exactness.py covers it.

    .venv/bin/python -m harness.exactness                      # llama-server and servelm, about 10 minutes
    .venv/bin/python -m harness.exactness --servers servelm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness import llama_server, servers
from servelm.bench.loadgen import build_prompt

PROMPT_WORDS = (20, 45, 70, 95, 120, 160, 200, 260, 330, 420)
MAX_TOKENS = 64
IDENTICAL, COUNTED_IDENTICAL, UNRELATED_ROUNDS = 8, 6, 2


@dataclass
class Tally:
    server: str
    compared: int = 0
    differing: int = 0
    by_pattern: dict[str, list[int]] = field(default_factory=dict)  # pattern -> [compared, differing]

    def add(self, pattern: str, reference: str, answer: str) -> None:
        counts = self.by_pattern.setdefault(pattern, [0, 0])
        differs = int(answer != reference)
        counts[0] += 1
        counts[1] += differs
        self.compared += 1
        self.differing += differs


def messages(words: int, seed: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Continue this text: " + build_prompt(words, seed)}]


def near(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same conversation with its last word changed."""
    text = msgs[-1]["content"]
    return [{"role": "user", "content": text.rsplit(" ", 1)[0] + " harbour"}]


async def answer(client: httpx.AsyncClient, url: str, model: str, msgs: list[dict[str, str]]) -> str:
    r = await client.post(url, json={"model": model, "messages": msgs, "temperature": 0, "max_tokens": MAX_TOKENS})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def measure(spec: servers.ServerSpec, log_dir: Path, startup_s: float) -> Tally:
    proc = servers.ServerProcess(spec, log_dir / f"{spec.name}.log")
    proc.start()
    tally = Tally(spec.name)
    url = spec.base_url + "/chat/completions"
    try:
        await proc.wait_ready(startup_s)
        prompts = [messages(w, f"exact-{w}") for w in PROMPT_WORDS]
        others = [messages(w + 13, f"other-{w}") for w in PROMPT_WORDS]
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            ask = lambda m: answer(client, url, spec.model, m)  # noqa: E731
            reference = [await ask(p) for p in prompts]
            for i, p in enumerate(prompts):
                same = await asyncio.gather(*[ask(p) for _ in range(IDENTICAL)])
                for a in same[:COUNTED_IDENTICAL]:
                    tally.add("among 8 identical", reference[i], a)
                for k in range(UNRELATED_ROUNDS):
                    mix = [others[(i + k + j) % len(others)] for j in range(7)]
                    got = await asyncio.gather(ask(p), *[ask(m) for m in mix])
                    tally.add("among 7 unrelated", reference[i], got[0])
                await ask(p)
                tally.add("after the same prompt", reference[i], await ask(p))
                await ask(near(p))
                tally.add("after a near-identical prompt", reference[i], await ask(p))
                print(f"   {spec.name}: prompt {i + 1}/{len(prompts)}: {tally.differing}/{tally.compared} differ",
                      flush=True)
    finally:
        proc.stop()
    return tally


async def _main(args: argparse.Namespace) -> int:
    model = Path(args.model_path) if args.model_path else servers.default_model_path()
    tallies = []
    with tempfile.TemporaryDirectory(prefix="servelm-exactness-") as tmp:
        for name in args.servers.split(","):
            port = servers.free_port()
            if name == "llama-server":
                binary = Path(args.llama_server_bin) if args.llama_server_bin else llama_server.build()
                spec = servers.llama_server_defaults_spec(binary, model, port, args.threads, [])
            elif name == "servelm":
                spec = servers.servelm_defaults_spec(port, model, args.threads, [])
            else:
                raise SystemExit(f"unknown server {name!r}: llama-server or servelm")
            print(f"{name}:", flush=True)
            tallies.append(await measure(spec, Path(tmp), args.startup_timeout))
    print("\n| server | answers differing from the same request alone | " +
          " | ".join(tallies[0].by_pattern) + " |")
    print("|---|---|" + "---|" * len(tallies[0].by_pattern))
    for t in tallies:
        cells = " | ".join(f"{d}/{c}" for c, d in t.by_pattern.values())
        print(f"| {t.server} | {t.differing}/{t.compared} | {cells} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([t.__dict__ for t in tallies], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="llama-server,servelm")
    p.add_argument("--model-path", help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads for both servers")
    p.add_argument("--llama-server-bin")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--json-out")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
