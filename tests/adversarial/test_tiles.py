"""Attacks on the prompt's whole tiles (docs/exactness.md): a row read right after a prompt's tiles, alone in its
micro-batch, made the llama.cpp runner read the previous position again on the row kernel, rewriting a tiled cell
with other values. A prompt of 64k + 1 tokens (its last token alone after its tiles), or of 64k (its first answer
token alone after them), then answered otherwise alone than beside other requests, or with speculative decoding on
than off (a 1,025-token greedy prompt's logprobs, a 257-token seeded prompt's sampled token). Now the tiles end at
least two tokens before the prompt does, and the first chunk after them is two tokens or more: the fake runner
refuses a single row right after tiled cells."""

from __future__ import annotations

import asyncio

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner


async def _answer(engine: LocalEngine, rid: str, prompt: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(GenerationRequest(rid, prompt, SamplingParams(max_tokens=4, temperature=0))):
        out += o.token_ids  # the new tokens of each step
    return out


@pytest.mark.parametrize("step_tokens", [16, 256])
@pytest.mark.parametrize("length", [64, 65, 128, 129, 130, 257])
async def test_no_single_row_right_after_a_prompts_tiles(length: int, step_tokens: int) -> None:
    runner = FakeRunner(num_slots=4, context_window=512, max_step_tokens=step_tokens)
    engine = LocalEngine(runner, speculative=False)
    engine.start()
    try:
        prompt = tuple(1 + i % 30 for i in range(length))
        alone = await _answer(engine, "alone", prompt)  # raises FakeKVError on a single row after tiled cells
        together = await asyncio.gather(*[_answer(engine, f"r{k}", prompt[: length - k]) for k in range(3)])
        assert together[0] == alone
    finally:
        engine.stop()
