"""Exact answers on the models users bring (issue 31): other quantizations of the embedded SmolLM2, made at set-up
with llama.cpp's llama_model_quantize (scripts/requantize.py, cached per llama-cpp-python version), and Gemma 3 270M
(Q4_K_M, sliding-window attention). tests/e2e/test_exactness.py holds the embedded Q4_1 file to the whole contract;
here each model of the matrix is held to its core, by the same signature (the text and every token's top-20
logprobs, equal only if the logits were bitwise equal):
- a reference server with nothing cached and no speculative decoding answers each request alone;
- a server on default flags, whose steps carry 32 tokens (prompts read in pieces), answers each the same alone,
  among 8 identical requests, beside strangers of other lengths, and again from its prefix cache;
- and it says in /v1/models and /health that it is exact, with the fences its self-check took.
Q4_K_M and Gemma's K-quants are the types whose kernels used to switch by rows (llama.cpp's repacked Q4_K weights,
ggml's tiled K-quant matmul); F16 is one whose single row took another kernel than two (tinyBLAS).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servelm.config import gemma_model_path

from .conftest import own_server
from .helpers import client_for
from .test_exactness import FAST as ONE_MODEL_FAST
from .test_exactness import LIGHTHOUSE, aclient, signature

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # slow: each model's two servers start in the first test

_spec = importlib.util.spec_from_file_location("requantize", Path(__file__).resolve().parents[2] / "scripts" / "requantize.py")
requantize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(requantize)

FAST = (*ONE_MODEL_FAST, "--max-num-seqs", "10")  # with --prompt-tiles off, as there: its reference is compared alike
# the matrix: a requantized SmolLM2 by its type, or Gemma 3 270M (None)
MODELS = {"Q4_K_M": "Q4_K_M", "Q6_K": "Q6_K", "F16": "F16", "Q8_0": "Q8_0", "gemma": None}
PROMPTS = {
    "medium": [{"role": "system", "content": "You are a careful assistant. " * 12},
               {"role": "user", "content": "Write a short story about a cat who sails."}],
    "long": [{"role": "system", "content": LIGHTHOUSE * 20},  # decodes past position 256
             {"role": "user", "content": "Summarise the history above in three sentences."}],
}
KINDS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 7}}
CASES = [(p, k) for p in PROMPTS for k in KINDS]
MAX_TOKENS = 20


def model_file(name: str) -> str:
    if MODELS[name] is None:
        path = gemma_model_path()
        assert path.is_file(), "make install joins Gemma 3 270M under .venv/share/servelm"
        return str(path)
    return str(requantize.requantize(MODELS[name]))


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict]]:
    """(the model's name, the loaded server's URL, every case's reference signature)."""
    name = request.param
    flags = ("--model-path", model_file(name), "--model-id", name, *FAST)
    with own_server(tmp_path_factory, "--no-prefix-cache", "--speculative", "off", *flags) as ref:
        client = client_for(ref.base_url)
        reference = {case: signature(client.chat.completions.create(**request_of(name, case))) for case in CASES}
    with own_server(tmp_path_factory, "--max-step-tokens", "32", *flags) as srv:
        yield name, srv.base_url, reference


def request_of(name: str, case: tuple[str, str]) -> dict:
    prompt, kind = case
    return {"model": name, "messages": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 20, **KINDS[kind]}


def test_the_model_says_it_is_exact(served) -> None:
    name, url, _ = served
    card = httpx.get(f"{url}/v1/models/{name}", timeout=10).json()
    health = httpx.get(f"{url}/health", timeout=10).json()["deployments"][name]
    assert card["exact"] is True and health["exact"] is True, card
    assert card["exactness"] == health["exactness"] and card["exactness"].startswith("exact")
    assert card["quantization"] == ("Q4_K_M" if name == "gemma" else name)


async def test_alone_among_identical_and_beside_strangers_each_answer_is_the_reference(served) -> None:
    name, url, reference = served
    async with aclient(url) as client:
        alone = [await client.chat.completions.create(**request_of(name, case)) for case in CASES]
        strangers = [client.chat.completions.create(
            model=name, max_tokens=12 + 5 * k, temperature=0.5,
            messages=[{"role": "user", "content": f"Stranger {k}: " + "tell me about rivers. " * (2 * k + 1)}])
            for k in range(4)]
        identical = [client.chat.completions.create(**request_of(name, ("long", "greedy"))) for _ in range(6)]
        mixed = [client.chat.completions.create(**request_of(name, case)) for case in CASES]
        results = await asyncio.gather(*strangers, *identical, *mixed)
    for case, answer in zip(CASES, alone):
        assert signature(answer) == reference[case], f"{name} {case} alone"
    for answer in results[4:10]:
        assert signature(answer) == reference["long", "greedy"], f"{name} among identical requests"
    for case, answer in zip(CASES, results[10:]):
        assert signature(answer) == reference[case], f"{name} {case} beside strangers"


def test_a_prefix_cache_hit_answers_as_the_reference(served) -> None:
    name, url, reference = served
    client = client_for(url)
    for case in CASES:
        client.chat.completions.create(**request_of(name, case))
        again = client.chat.completions.create(**request_of(name, case))
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert signature(again) == reference[case], f"{name} {case} from the cache"
