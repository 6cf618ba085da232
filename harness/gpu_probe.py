"""Exactness at the API, for any OpenAI-compatible server: is an answer's text, with its top-5 logprobs, bitwise
the same as the same request's answer alone?

Eight probes (four prompt lengths, greedy and seeded) are first answered one at a time: the references. Then:
- each again, alone (a server that differs here differs from run to run);
- all eight at once beside 12 strangers of other lengths and answer lengths, `--rounds` times;
- 8 identical copies of one probe at once, each round another probe.

    python -m harness.gpu_probe URL MODEL [--rounds 2]

Prints one JSON object: how many answers differed in each phase ("3/16": 3 of 16). The check's GPU script
(scripts/gpu_check.sh) runs it against servelm and llama-server from the same build.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import httpx

_WORDS = ("amber basalt cobalt delta ember fjord garnet harbor indigo juniper kestrel lagoon mesa nickel "
          "opal pylon quarry rowan sierra tundra").split()
PROBES = [(i, words, seed) for i, words in ((1, 12), (2, 60), (3, 150), (4, 300)) for seed in (None, 11)]


def prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"Note {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def request(model: str, text: str, seed: int | None, max_tokens: int = 32) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    body.update({"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed})
    return body


def answer_key(answer: dict[str, Any]) -> str:
    """What must be the same: the text and each token's logprob and top 5, as the server wrote them."""
    choice = answer["choices"][0]
    steps = (choice.get("logprobs") or {}).get("content") or []
    return json.dumps([choice["message"]["content"],
                       [(s["token"], s["logprob"], [(t["token"], t["logprob"]) for t in s["top_logprobs"]])
                        for s in steps]])


async def _ask(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return answer_key(r.json())


async def probe(url: str, model: str, rounds: int) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        def ask(body: dict[str, Any]) -> Any:
            return _ask(client, url, body)

        alone = [await ask(request(model, prompt(i, n), seed)) for i, n, seed in PROBES]
        again = [await ask(request(model, prompt(i, n), seed)) for i, n, seed in PROBES]
        mixed = identical = 0
        for r in range(rounds):
            strangers = [request(model, prompt(200 + 20 * r + j, 15 + 41 * j % 380), None, 20 + 3 * j) for j in range(12)]
            got = await asyncio.gather(*[ask(request(model, prompt(i, n), seed)) for i, n, seed in PROBES],
                                       *[ask(s) for s in strangers])
            mixed += sum(a != b for a, b in zip(got, alone))
            k = (2 * r) % len(PROBES)
            i, n, seed = PROBES[k]
            same = await asyncio.gather(*[ask(request(model, prompt(i, n), seed)) for _ in range(8)])
            identical += sum(a != alone[k] for a in same)
    return {"url": url, "model": model, "alone_again_differ": f"{sum(a != b for a, b in zip(again, alone))}/{len(PROBES)}",
            "beside_strangers_differ": f"{mixed}/{rounds * len(PROBES)}", "identical_x8_differ": f"{identical}/{rounds * 8}"}


def summarize(out: Path) -> dict[str, Any]:
    """The GPU check's results in one object: each probe's and each server's /v1/models answer (the last JSON line
    of each file), and the kernel limit's table and servelm's engine counters as text."""
    summary: dict[str, Any] = {}
    for path in sorted([*out.glob("probe-*.json"), *out.glob("*models.json")]):
        try:
            summary[path.name] = json.loads(path.read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as exc:
            summary[path.name] = f"unreadable: {exc}"
    for name in ("batched-bench.txt", "servelm-metrics.txt"):
        summary[name] = (out / name).read_text() if (out / name).exists() else ""
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gpu_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("url", nargs="?")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--summary", type=Path, metavar="DIR", help="instead: gather DIR's results into DIR/gpu-summary.json")
    a = ap.parse_args(argv)
    if a.summary is not None:
        (a.summary / "gpu-summary.json").write_text(json.dumps(summarize(a.summary), indent=1))
        return 0
    if not a.url or not a.model:
        ap.error("give the server's URL and the model")
    print(json.dumps(asyncio.run(probe(a.url.rstrip("/"), a.model, a.rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
