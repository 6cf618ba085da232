"""The engine thread's time by phase: each part of a step counted once, under its own phase."""

from __future__ import annotations

import time

from servelm.constrain.grammars import Grammars
from servelm.engine.clock import PHASES, PhaseClock
from servelm.engine.local import LocalEngine
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner


def test_an_inner_phase_pauses_the_outer_one() -> None:
    clock = PhaseClock()
    with clock.phase("loop"):
        time.sleep(0.02)
        with clock.phase("grammar"):
            time.sleep(0.05)
        time.sleep(0.02)
    s = clock.seconds
    assert 0.05 <= s["grammar"] < 0.09
    assert 0.04 <= s["loop"] < 0.08, "the loop's time excludes the grammar's inside it"
    assert set(s) == set(PHASES)


def test_move_hands_time_from_one_phase_to_another() -> None:
    clock = PhaseClock()
    with clock.phase("runner"):
        time.sleep(0.03)
    clock.move(0.02, "runner", "decode")
    assert abs(clock.seconds["decode"] - 0.02) < 1e-9 and 0.009 < clock.seconds["runner"] < 0.05


async def _run(engine: LocalEngine, rid: str, constraint=None) -> str:
    text = ""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    async for out in engine.generate(GenerationRequest(rid, (3, 4), params, constraint)):
        text += out.text
    return text


async def test_an_engines_steps_are_split_into_its_phases() -> None:
    runner = FakeRunner(num_slots=2, max_step_tokens=16, step_delay=0.003)
    grammars = Grammars(runner.model.token_table(), list(runner.eog_ids), runner.model.tokenize_text)
    engine = LocalEngine(runner, grammars=grammars)
    engine.start()
    try:
        assert await _run(engine, "free")
        assert await _run(engine, "json", grammars.regex("(ab|cd)e{2}"))
        stats = engine.stats()
    finally:
        engine.stop()
    s = stats.phase_seconds
    assert set(s) == set(PHASES)
    assert s["runner"] >= 0.003 * stats.steps, "the fake runner's step (its sleep) is the runner's own work"
    assert s["decode"] == 0.0, "a runner that calls no llama_decode has no decode time"
    assert s["grammar"] > 0 and s["detokenize"] > 0 and s["sample"] > 0
    inside = sum(v for k, v in s.items() if k != "idle")
    assert inside <= stats.step_seconds + 0.05 and inside >= 0.9 * stats.step_seconds, \
        "the phases of the steps add up to the steps' time"
