"""The pacer: a step reads only as much prompt as keeps it within the inter-token target."""

from __future__ import annotations

import asyncio

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.pacing import FLOOR, MIN_STEPS, UNFIT, StepPacer
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner


def cost(decode: int, prompt: int) -> float:
    return 0.005 + 0.004 * decode + 0.002 * prompt  # a: 5 ms a step, b: 4 ms a decoding row, c: 2 ms a prompt token


def trained(target_s: float) -> StepPacer:
    pacer = StepPacer(target_s)
    for i in range(3 * MIN_STEPS):
        d, p = 1 + i % 16, (i * 37) % 200
        pacer.observe(d, 0, cost(d, 0))
        pacer.observe(d, p, cost(d, p))
    return pacer


def test_it_learns_a_steps_costs_and_keeps_a_decoding_step_within_the_target() -> None:
    pacer = trained(0.150)
    a, b, c = pacer.costs or (0, 0, 0)
    assert (a, b, c) == pytest.approx((0.005, 0.004, 0.002), abs=1e-4)
    budget = pacer.prompt_budget(16)
    assert budget == pytest.approx((0.150 - 0.005 - 16 * 0.004) / 0.002, abs=1)  # 40 tokens
    assert cost(16, budget) <= 0.150 + 0.002
    assert pacer.prompt_budget(1) > budget, "fewer decoding rows leave more room for prompts"


def test_a_step_that_decodes_nothing_keeps_within_the_target_too_and_an_untrained_pacer_keeps_a_step_small() -> None:
    """Read together, a burst's prompts would each have its first token wait for all of them."""
    budget = trained(0.150).prompt_budget(0)
    assert budget == pytest.approx((0.150 - 0.005) / 0.002, abs=1) and cost(0, budget) <= 0.150 + 0.002
    fresh = StepPacer(0.150)
    for _ in range(MIN_STEPS):
        fresh.observe(4, 100, cost(4, 100))  # never a step without a prompt: no fit yet
    assert fresh.prompt_budget(4) == UNFIT, "before it knows the costs, a decoding step reads a modest chunk"


def test_prompts_always_move_on() -> None:
    assert trained(0.010).prompt_budget(16) == FLOOR, "a target below the decoding rows' own cost still reads a floor"


class Fixed(StepPacer):
    """A pacer that knows the step costs of `cost` (the fake runner's own steps cost about the same whatever they
    carry)."""

    def __init__(self, target_s: float) -> None:
        super().__init__(target_s)
        for i in range(3 * MIN_STEPS):
            super().observe(1 + i % 4, 0, cost(1 + i % 4, 0))
            super().observe(1 + i % 4, 10 + i, cost(1 + i % 4, 10 + i))

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        pass


async def _generate(engine: LocalEngine, rid: str, prompt: tuple[int, ...], n: int) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(GenerationRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0))):
        tokens += out.token_ids
    return tokens


async def test_with_a_pacer_decoding_steps_read_little_prompt_and_answers_do_not_change() -> None:
    """Four decode while a long prompt arrives: each step that decodes reads at most the pacer's budget (or one tile
    of the prompt's whole tiles), and every answer is the one the engine gives without a pacer."""
    async def run(paced: bool) -> tuple[list[list[int]], FakeRunner]:
        runner = FakeRunner(num_slots=8, context_window=512, max_step_tokens=128, max_rows=63, step_delay=0.002)
        engine = LocalEngine(runner, pacer=Fixed(0.05) if paced else None)
        engine.start()
        try:
            short = [asyncio.create_task(_generate(engine, f"d{i}", (3 + i, 4), 40)) for i in range(4)]
            await asyncio.sleep(0.02)
            long = asyncio.create_task(_generate(engine, "long", tuple(range(5, 300)), 5))
            return await asyncio.gather(*short, long), runner
        finally:
            engine.stop()

    paced, runner = await run(True)
    plain, plain_runner = await run(False)
    assert paced == plain, "how prompts are cut changes no answer"
    budget = (0.05 - 0.005 - 4 * 0.004) / 0.002  # 14.5: below the floor
    mixed = [p for p in runner.steps if p.decode_tokens and p.num_tokens > p.decode_tokens]
    assert mixed, "the long prompt was read while others decoded"
    # the prompt's whole tiles (256 of its 295 tokens) go a tile at a time: a step reads one even past the budget
    for p in mixed:
        read, tiled = p.num_tokens - p.decode_tokens, sum(len(c.tokens) for c in p.chunks if c.tiled)
        assert read <= max(FLOOR, budget) or read == tiled == runner.tile_rows, (read, tiled)
    assert sum(len(c.tokens) for p in mixed for c in p.chunks if c.tiled) == 256
    assert any(p.num_tokens - p.decode_tokens > FLOOR for p in plain_runner.steps if p.decode_tokens), \
        "without a pacer the same traffic reads more prompt in a decoding step"
