"""LocalEngine over fake runners: logprobs, prompt logprobs, best_of ranking and beam search."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.types import BeamParams, FinishReason, GenerationRequest, SamplingParams
from servelm.runners.fake import EOS, FakeRunner  # noqa: F401


class ScriptedRunner(FakeRunner):
    """A fake model whose next-token distribution after each token is given as {token: probability}."""

    def __init__(self, table: dict[int, dict[int, float]], **kw) -> None:
        super().__init__(**kw)
        self.table = table

    def logits_after(self, token: int) -> np.ndarray:
        dist = self.table.get(token)
        if dist is None:
            return super().logits_after(token)
        row = np.full(self.vocab_size, -30.0, dtype=np.float32)
        for t, p in dist.items():
            row[t] = math.log(p)
        return row


# After the prompt's token 1: 10 is likelier than 20, but 10 leads to a flat spread while 20 leads to 21
# almost surely; so greedy takes 10 and a beam of 2 finds 20, 21.
TRAP = {1: {10: 0.55, 20: 0.45}, 10: {t: 1 / 8 for t in range(11, 19)}, 20: {21: 0.99, 22: 0.01},
        21: {EOS: 1.0}, **{t: {EOS: 1.0} for t in range(11, 19)}}


async def run(engine: LocalEngine, prompt, **kw):
    params = SamplingParams(**{"max_tokens": 10, "temperature": 0.0, **kw})
    outs = []
    async for out in engine.generate(GenerationRequest(f"r{id(params)}", tuple(prompt), params)):
        outs.append(out)
    return outs


async def cells_freed(runner, engine) -> bool:
    """Finished sequences' slots rest at the engine's next step, their streams holding exactly what the prefix
    cache reports; wait for it."""
    for _ in range(200):
        s = engine.stats()
        if s.running == 0 and s.kv_cells_used == 0 and runner.cells_in_use() == s.kv_cells_cached:
            return True
        await asyncio.sleep(0.005)
    return False


def by_index(outs):
    res: dict[int, dict] = {}
    for o in outs:
        r = res.setdefault(o.index, {"tokens": [], "logprobs": [], "text": "", "final": None})
        r["tokens"] += o.token_ids
        r["logprobs"] += o.logprobs or []
        r["text"] += o.text
        if o.finished:
            r["final"] = o
    return res


@pytest.fixture
def make_engine():
    engines = []

    def make(runner=None):
        eng = LocalEngine(runner or FakeRunner(num_slots=4, max_step_tokens=16))
        eng.start()
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.stop()


async def test_logprobs_cover_every_token_with_sorted_alternatives(make_engine):
    eng = make_engine()
    res = by_index(await run(eng, [5, 6], max_tokens=4, logprobs=3))[0]
    assert res["tokens"] == [7, 8, 9, 10] and [e.token for e in res["logprobs"]] == res["tokens"]
    for e in res["logprobs"]:
        assert e.logprob <= 0 and e.rank == 1 and e.top[0] == (e.token, e.logprob)
        assert len(e.top) == 3 and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        # the fake row: the successor at 10, then three tokens at -7, -8, -9, the rest at -10
        assert e.top[1][0] == (e.token + 1) % 64 and e.top[1][1] == pytest.approx(e.logprob - 17, abs=1e-6)
    assert res["final"].cumulative_logprob == pytest.approx(sum(e.logprob for e in res["logprobs"]))


async def test_logprobs_reflect_logit_bias_and_show_a_sampled_tokens_rank(make_engine):
    eng = make_engine()
    res = by_index(await run(eng, [5], max_tokens=1, logprobs=0, logit_bias=((6, -20.0),)))[0]
    e = res["logprobs"][0]
    assert e.token != 6 and e.top == () and e.rank == 1
    res = by_index(await run(eng, [5], max_tokens=1, logprobs=2, logit_bias=((30, 25.0),)))[0]
    assert res["tokens"] == [30] and res["logprobs"][0].logprob == pytest.approx(-math.log1p(math.exp(-5.0)), abs=1e-4)


async def test_prompt_logprobs_score_each_prompt_token_after_the_first(make_engine):
    eng = make_engine()
    prompt = [3, 4, 5, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]  # longer than a step
    outs = await run(eng, prompt, max_tokens=2, prompt_logprobs=1)
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and outs[0].prompt_logprobs is firsts[0]
    plp = firsts[0]
    assert len(plp) == len(prompt) and plp[0] is None
    assert [e.token for e in plp[1:]] == prompt[1:]
    for prev, e in zip(prompt, plp[1:]):
        expected_rank = 1 if e.token == prev + 1 else None
        assert e.logprob <= 0 and len(e.top) == 1 and e.top[0][0] == prev + 1
        if expected_rank:
            assert e.rank == 1
        else:
            assert e.rank > 1 and e.logprob < -15


async def test_best_of_returns_every_sequence_with_its_cumulative_logprob(make_engine):
    eng = make_engine(ScriptedRunner(TRAP, num_slots=4, max_step_tokens=16))
    res = by_index(await run(eng, [1], max_tokens=3, temperature=1.0, seed=7, n=1, best_of=4))
    assert sorted(res) == [0, 1, 2, 3]
    for r in res.values():
        assert r["final"].cumulative_logprob < 0
        lp = {1: TRAP[1]}
        first = r["tokens"][0]
        assert first in (10, 20) and r["final"].cumulative_logprob <= math.log(lp[1][first]) + 1e-6


async def test_beam_search_finds_the_likelier_sequence_greedy_misses(make_engine):
    runner = ScriptedRunner(TRAP, num_slots=4, max_step_tokens=16)
    eng = make_engine(runner)
    greedy = by_index(await run(eng, [1], max_tokens=3))[0]
    assert greedy["tokens"][0] == 10
    outs = await run(eng, [1], max_tokens=3, n=2, best_of=2, beam=BeamParams(), logprobs=1)
    res = by_index(outs)
    assert sorted(res) == [0, 1] and all(o.finished for o in outs), "beam search sends only the final choices"
    assert res[0]["tokens"] == [20, 21] and res[0]["final"].finish_reason is FinishReason.STOP
    assert res[0]["final"].cumulative_logprob == pytest.approx(math.log(0.45 * 0.99), abs=1e-4)
    assert res[1]["final"].cumulative_logprob <= res[0]["final"].cumulative_logprob
    assert [e.token for e in res[0]["logprobs"]] == res[0]["tokens"]
    assert await cells_freed(runner, eng)


async def test_beams_share_kv_cells_instead_of_recomputing(make_engine):
    runner = FakeRunner(num_slots=4, max_step_tokens=16)
    eng = make_engine(runner)
    prompt = [2] * 10
    outs = await run(eng, prompt, max_tokens=6, n=1, best_of=3, beam=BeamParams())
    assert len(outs) == 1 and outs[0].token_ids == [3, 4, 5, 6, 7, 8]
    computed = sum(len(c.tokens) for plan in runner.steps for c in plan.chunks)
    assert computed == len(prompt) + 3 * 5, "the prompt is read once; each beam decodes one token a step"
    assert await cells_freed(runner, eng)


async def test_beam_search_honours_stop_strings_and_length_penalty(make_engine):
    eng = make_engine(ScriptedRunner(TRAP, num_slots=4, max_step_tokens=16))
    letter = chr(ord("a") + 21 % 26)  # token 21's text
    res = by_index(await run(eng, [1], max_tokens=3, n=1, best_of=2, beam=BeamParams(), stop=(letter,)))
    assert res[0]["text"] == chr(ord("a") + 20 % 26) and res[0]["final"].stop_reason == letter
    res = by_index(await run(eng, [1], max_tokens=3, n=1, best_of=2, beam=BeamParams(), stop=(letter,),
                             include_stop_str_in_output=True))
    assert res[0]["text"].endswith(letter)


async def test_diverse_beam_groups_take_different_first_tokens(make_engine):
    eng = make_engine(ScriptedRunner(TRAP, num_slots=4, max_step_tokens=16))
    beam = BeamParams(diversity_penalty=5.0, groups=2)
    res = by_index(await run(eng, [1], max_tokens=2, n=2, best_of=2, beam=beam))
    assert {res[0]["tokens"][0], res[1]["tokens"][0]} == {10, 20}


async def test_include_stop_str_in_output_keeps_the_stop_string(make_engine):
    eng = make_engine()
    stop = "fg"
    res = by_index(await run(eng, [1], max_tokens=10, stop=(stop,), include_stop_str_in_output=True))[0]
    assert res["text"] == "cdefg" and res["final"].stop_reason == stop


async def test_a_beam_search_beside_another_request_gives_the_same_result(make_engine):
    alone = by_index(await run(make_engine(), [2] * 10, max_tokens=10, n=2, best_of=2, beam=BeamParams()))
    runner = FakeRunner(num_slots=4, max_step_tokens=16)
    eng = LocalEngine(runner)  # started once both requests wait, so they are admitted together
    first = asyncio.ensure_future(run(eng, [41] * 10, max_tokens=24))
    beams = asyncio.ensure_future(run(eng, [2] * 10, max_tokens=10, n=2, best_of=2, beam=BeamParams()))
    await asyncio.sleep(0.01)
    eng.start()
    try:
        crowded = by_index(await beams)
        await first
    finally:
        eng.stop()
    reads = [c for plan in runner.steps for c in plan.chunks if c.start == 0 and c.tokens[0] == 2]
    assert len(reads) == 1, "the prompt was read once, then copied to the other beam"
    assert [crowded[i]["tokens"] for i in (0, 1)] == [alone[i]["tokens"] for i in (0, 1)]
