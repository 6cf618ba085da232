"""LocalEngine over the fake runner: the step loop, n > 1, aborts, and KV bookkeeping end to end."""

from __future__ import annotations

import asyncio

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.plan import Copy
from servelm.engine.types import FinishReason, GenerationRequest, SamplingParams
from servelm.runners.fake import END_TOKEN, FakeRunner


@pytest.fixture
def engine():
    runner = FakeRunner(num_slots=4, max_step_tokens=16)
    eng = LocalEngine(runner)
    eng.start()
    yield eng
    eng.stop()


async def collect(engine: LocalEngine, rid: str, prompt, **kw):
    params = SamplingParams(**{"max_tokens": 10, "temperature": 0.0, **kw})
    texts: dict[int, str] = {}
    finals = {}
    async for out in engine.generate(GenerationRequest(rid, tuple(prompt), params)):
        texts[out.index] = texts.get(out.index, "") + out.text
        if out.finished:
            finals[out.index] = out
    return texts, finals


def letters(tokens):
    return "".join(chr(ord("a") + t % 26) for t in tokens)


async def test_greedy_follows_the_fake_model_and_stops_at_length(engine):
    texts, finals = await collect(engine, "a", [5, 6, 7], max_tokens=4)
    assert texts[0] == letters([8, 9, 10, 11])
    assert finals[0].finish_reason is FinishReason.LENGTH and finals[0].completion_tokens == 4


async def test_eos_stops_with_no_stop_reason(engine):
    texts, finals = await collect(engine, "a", [END_TOKEN - 2], max_tokens=10)
    assert texts[0] == letters([END_TOKEN - 1, END_TOKEN])
    assert finals[0].finish_reason is FinishReason.STOP and finals[0].stop_reason is None
    assert finals[0].completion_tokens == 3, "the EOS token counts as generated"


async def test_stop_string_and_stop_token(engine):
    texts, finals = await collect(engine, "a", [1], max_tokens=10, stop=(letters([4, 5]),))
    assert texts[0] == letters([2, 3]) and finals[0].stop_reason == letters([4, 5])
    texts, finals = await collect(engine, "b", [1], max_tokens=10, stop_token_ids=(4,))
    assert texts[0] == letters([2, 3]) and finals[0].stop_reason == 4


async def test_many_requests_at_once_more_than_the_slots(engine):
    results = await asyncio.gather(*[collect(engine, f"r{i}", [i + 1] * 20, max_tokens=6) for i in range(10)])
    for i, (texts, finals) in enumerate(results):
        assert finals[0].completion_tokens == 6
        assert texts[0] == letters([i + 2 + k for k in range(6)])
    assert engine.runner.cells_in_use() == 0 or engine.scheduler.kv_cells_used == 0


async def test_n_choices_share_the_prompt_and_each_finish(engine):
    texts, finals = await collect(engine, "n", [3] * 12, max_tokens=5, n=3)
    assert sorted(texts) == [0, 1, 2] and all(t == letters([4, 5, 6, 7, 8]) for t in texts.values())
    forks = [op for plan in engine.runner.steps for op in plan.ops if isinstance(op, Copy)]
    assert len(forks) == 2 and all(op.n == 12 for op in forks)
    prompt_tokens = sum(len(c.tokens) for plan in engine.runner.steps for c in plan.chunks if c.start == 0)
    assert prompt_tokens == 12, "the prompt was computed once"


async def test_a_step_wakes_the_event_loop_once_whatever_the_requests_in_it():
    """The step's outputs reach every request's queue through one call_soon_threadsafe (not one a request), in order,
    and a hand-out not yet run takes the next steps' outputs too."""
    engine = LocalEngine(FakeRunner(num_slots=4, max_step_tokens=16, step_delay=0.002))
    loop = asyncio.get_running_loop()
    wakes = {"n": 0}
    original = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        wakes["n"] += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counted
    engine.start()
    try:
        results = await asyncio.gather(*[collect(engine, f"w{i}", [i + 1] * 5, max_tokens=8) for i in range(4)])
    finally:
        del loop.call_soon_threadsafe
        engine.stop()
    for i, (texts, finals) in enumerate(results):
        assert texts[0] == letters([i + 2 + k for k in range(8)]) and finals[0].completion_tokens == 8
    sampled = [sum(len(c.samplers) for c in plan.chunks) for plan in engine.runner.steps]
    assert max(sampled) > 1, "steps drew for several requests"
    assert 0 < wakes["n"] <= sum(1 for n in sampled if n)


async def test_abandoning_a_generation_frees_its_cells():
    runner = FakeRunner(num_slots=2, max_step_tokens=16, step_delay=0.01)
    eng = LocalEngine(runner)
    eng.start()
    try:
        params = SamplingParams(max_tokens=300, temperature=0.0)
        gen = eng.generate(GenerationRequest("long", (1, 2, 3), params))
        for _ in range(3):
            await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if eng.stats().running == 0 and runner.cells_in_use() == eng.stats().kv_cells_cached:
                break
            await asyncio.sleep(0.01)
        s = eng.stats()
        # its slot rests, its stream holding what it computed (the prefix cache), no more
        assert s.running == 0 and s.kv_cells_used == 0 and runner.cells_in_use() == s.kv_cells_cached <= 6
        texts, finals = await collect(eng, "after", [1], max_tokens=3)
        assert finals[0].completion_tokens == 3
    finally:
        eng.stop()


async def test_a_runner_failure_fails_the_requests_but_not_the_engine():
    runner = FakeRunner(num_slots=2, max_step_tokens=16)
    eng = LocalEngine(runner)
    original = runner.step
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(plan)

    runner.step = flaky
    eng.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            await collect(eng, "x", [1], max_tokens=3)
        texts, finals = await collect(eng, "y", [1], max_tokens=3)
        assert finals[0].completion_tokens == 3 and eng.alive
    finally:
        eng.stop()


async def test_nothing_of_a_request_stays_in_the_engine_once_it_ends(engine):
    """Finished, aborted (a client gone), failed or a beam search: each stage lets go of every sequence it knew."""
    from servelm.engine.types import BeamParams

    await collect(engine, "done", [3] * 5, max_tokens=4, n=2)
    await collect(engine, "beams", [3] * 5, max_tokens=4, best_of=2, beam=BeamParams())
    gen = engine.generate(GenerationRequest("gone", (3, 4), SamplingParams(max_tokens=500, temperature=0.0)))
    await anext(gen)
    await gen.aclose()  # the client went away: its abort goes to the engine
    from servelm.engine.local import EngineError

    with pytest.raises(EngineError):
        await collect(engine, "bad", [3], max_tokens=4, logit_bias=((10**9, 1.0),))  # fails inside the step
    for _ in range(100):
        if not engine.scheduler.has_unfinished():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert engine.output.choices == {} and engine.output.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.has_unfinished()


async def test_a_preempted_request_pauses_for_a_higher_priority_and_ends_with_the_same_answer():
    runner = FakeRunner(num_slots=1, max_step_tokens=16, context_window=256, step_delay=0.002)
    eng = LocalEngine(runner, priority_aging_s=0)
    eng.start()
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

        async def run(rid, prompt, priority):
            text = ""
            async for out in eng.generate(GenerationRequest(rid, tuple(prompt), params, priority=priority)):
                text += out.text
                if out.finished:
                    done.append(rid)
            return text

        done: list[str] = []
        alone = await run("solo", range(1, 20), 5)
        low = asyncio.create_task(run("low", range(1, 20), 5))
        while eng.scheduler.num_running_seqs == 0 or not eng.scheduler.running[0].seqs[0].num_generated > 5:
            await asyncio.sleep(0.002)
        await run("high", range(30, 35), 0)
        assert done[-1] == "high" and not low.done(), "the high one ran while the low one waited"
        assert await low == alone, "the preempted answer is the answer it would have had"
        assert eng.stats().preemptions == 1
    finally:
        eng.stop()
