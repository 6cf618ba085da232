"""Constrained rows share steps with unconstrained ones: masks apply per row, and a grammar ends its choice."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from servelm.constrain.grammars import Grammars
from servelm.engine.local import LocalEngine
from servelm.engine.types import FinishReason, GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner


@pytest.fixture
def setup():
    runner = FakeRunner(num_slots=4, max_step_tokens=16, step_delay=0.002)
    grammars = Grammars(runner.model.token_table(), list(runner.eog_ids), runner.model.tokenize_text)
    eng = LocalEngine(runner, grammars=grammars)
    eng.start()
    yield eng, grammars, runner
    eng.stop()


async def run(engine, rid, prompt, constraint=None, **kw):
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})
    texts: dict[int, str] = {}
    finals = {}
    async for out in engine.generate(GenerationRequest(rid, tuple(prompt), params, constraint)):
        texts[out.index] = texts.get(out.index, "") + out.text
        if out.finished:
            finals[out.index] = out
    return texts, finals


async def test_constrained_and_free_rows_in_the_same_steps(setup):
    engine, grammars, runner = setup
    choice = grammars.choice(["zyx", "qqq"])
    (ft, ff), (ct, cf) = await asyncio.gather(
        run(engine, "f", [3, 4], None, max_tokens=8), run(engine, "c", [3, 4], choice)
    )
    assert ct[0] in ("zyx", "qqq") and cf[0].finish_reason is FinishReason.STOP
    assert cf[0].completion_tokens == 3, "the grammar ends the choice; no EOS step is needed"
    assert ft[0] == "fghijklm" and ff[0].finish_reason is FinishReason.LENGTH  # the fake model's own text
    assert any(len(p.chunks) == 2 for p in runner.steps), "both requests were decoded in one step"


async def test_every_choice_of_n_is_constrained(setup):
    engine, grammars, _ = setup
    regex = grammars.regex("(ab|cd)e{2}")
    texts, finals = await run(engine, "n", [1], regex, n=3, temperature=1.0, seed=7)
    assert sorted(texts) == [0, 1, 2]
    for i in range(3):
        assert texts[i] in ("abee", "cdee") and finals[i].finish_reason is FinishReason.STOP


async def test_the_grammar_wins_over_a_banned_eos(setup):
    engine, grammars, _ = setup
    texts, finals = await run(engine, "m", [1], grammars.choice(["ab"]), min_tokens=5, ignore_eos=True)
    assert texts[0] == "ab" and finals[0].finish_reason is FinishReason.STOP


async def test_max_tokens_still_cuts_a_constrained_answer(setup):
    engine, grammars, _ = setup
    texts, finals = await run(engine, "l", [1], grammars.regex("a{10}"), max_tokens=4)
    assert texts[0] == "aaaa" and finals[0].finish_reason is FinishReason.LENGTH


async def test_free_unless_drops_the_grammar_once_the_text_cannot_begin_a_marker(setup):
    engine, grammars, _ = setup
    lark = 'start: "abc" "d" | TEXT\nTEXT: /[a-z]{0,3}/ & ~/abc.*/\n'
    c = replace(grammars.lark(lark), free_unless=("abc",))
    # the fake continues 'z' with "abcdefg...": it commits to the marker branch and the grammar ends it
    texts, finals = await run(engine, "m", [25], c)
    assert texts[0] == "abcd" and finals[0].finish_reason is FinishReason.STOP
    # after 'c' comes "defgh...": text that cannot begin "abc", so the grammar (at most 3 letters) is dropped
    texts, finals = await run(engine, "t", [28], c, max_tokens=6)
    assert texts[0] == "defghi" and finals[0].finish_reason is FinishReason.LENGTH
    # without the hint the same grammar holds the text to 3 letters
    texts, finals = await run(engine, "k", [28], grammars.lark(lark), max_tokens=6)
    assert texts[0] == "def" and finals[0].finish_reason is FinishReason.STOP
