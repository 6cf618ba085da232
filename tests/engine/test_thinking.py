"""The thinking budget on the fake model (token t is followed by t+1; its text is a letter a token): after N
reasoning tokens the engine writes the closing marker's tokens itself, and counts the thought's tokens."""

from __future__ import annotations

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.thinking import ThinkTracker
from servelm.engine.types import GenerationRequest, SamplingParams, Thinking
from servelm.runners.fake import FakeRunner

CLOSE = 20  # the fake's token 20 spells "u": the closing marker of these tests


@pytest.fixture
def engine():
    eng = LocalEngine(FakeRunner(num_slots=4, max_step_tokens=16))
    eng.start()
    yield eng
    eng.stop()


async def run(engine, thinking, prompt=(1,), max_tokens=10, n=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    tokens, finals = {}, {}
    async for out in engine.generate(GenerationRequest("r", tuple(prompt), params, thinking=thinking)):
        tokens.setdefault(out.index, []).extend(out.token_ids)
        if out.finished:
            finals[out.index] = out
    return tokens, finals


@pytest.mark.parametrize("budget", [0, 1, 3])
async def test_the_budget_forces_the_closing_marker_after_exactly_n_tokens(engine, budget):
    spec = Thinking(b"<", b"u", (CLOSE,), opened=True, budget=budget)
    tokens, finals = await run(engine, spec)
    # the model would go 2, 3, 4, ...: after `budget` of them the engine writes 20, and the model goes on from it
    expected = list(range(2, 2 + budget)) + [CLOSE, 21, 22]
    assert tokens[0][: budget + 3] == expected
    assert finals[0].reasoning_tokens == budget


async def test_every_choice_has_its_own_budget(engine):
    spec = Thinking(b"<", b"u", (CLOSE,), opened=True, budget=2)
    tokens, finals = await run(engine, spec, n=3)
    assert all(t[:3] == [2, 3, CLOSE] for t in tokens.values()) and len(tokens) == 3
    assert all(f.reasoning_tokens == 2 for f in finals.values())


async def test_a_thought_closed_by_the_model_is_counted_without_its_marker(engine):
    spec = Thinking(b"<", b"e", (4,), opened=True)  # the model writes c, d, then e (token 4) closes the thought
    tokens, finals = await run(engine, spec, max_tokens=6)
    assert tokens[0] == [2, 3, 4, 5, 6, 7] and finals[0].reasoning_tokens == 2


async def test_an_output_that_opens_its_own_thought(engine):
    # the prompt ends at token 1: the model writes "cd" (tokens 2, 3), which opens the thought here
    spec = Thinking(b"cd", b"u", (CLOSE,), opened=False, budget=2)
    tokens, finals = await run(engine, spec)
    assert tokens[0][:5] == [2, 3, 4, 5, CLOSE] and finals[0].reasoning_tokens == 2


def test_an_output_that_does_not_think_is_left_alone():
    t = ThinkTracker(Thinking(b"<think>", b"</think>", (9,), opened=False, budget=0))
    for token, text in [(1, b" "), (2, b"Hello")]:
        t.step(token, text)
    assert t.state == "done" and not t.forced and t.reasoning_tokens == 0


async def test_engine_reports_queue_and_prompt_times(engine):
    _, finals = await run(engine, None, prompt=(1, 2, 3))
    out = finals[0]
    assert out.prompt_seconds > 0 and out.queued_seconds >= 0 and out.reasoning_tokens == 0
