"""One request's failure inside the shared engine step is its own: the requests beside it finish normally.

Each test injects a failure into one request's part of a step (its row's processing, its draw, its logprobs, its
detokenizing, its beam step) while others share the same steps, and checks that only that request fails and
that the engine keeps serving afterwards.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from servelm.engine import sampler as sampler_module
from servelm.engine import sampling
from servelm.engine.beam import BeamSearch
from servelm.engine.local import EngineError, LocalEngine
from servelm.engine.output import OutputProcessor
from servelm.engine.types import BeamParams, FinishReason, GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner

FAULTY = 1.5  # the frequency_penalty that marks the request a test makes fail


@pytest.fixture
def engine():
    runner = FakeRunner(num_slots=6, max_step_tokens=32, step_delay=0.002)  # room for all at once
    eng = LocalEngine(runner)
    eng.start()
    yield eng
    eng.stop()


async def run(engine: LocalEngine, rid: str, **kw) -> tuple[str, FinishReason | None]:
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})
    text, reason = "", None
    async for out in engine.generate(GenerationRequest(rid, (3, 4, 5), params)):
        text += out.text
        reason = out.finish_reason or reason
    return text, reason


async def neighbours_and_faulty(engine: LocalEngine, **faulty_kw) -> None:
    """Three healthy requests and a faulty one sharing every step: the faulty one alone fails, the others end
    with their whole text, and a request sent afterwards is served."""
    healthy = [run(engine, f"ok{i}", max_tokens=12) for i in range(3)]
    faulty = run(engine, "bad", frequency_penalty=FAULTY, **faulty_kw)
    results = await asyncio.gather(*healthy, faulty, return_exceptions=True)
    *ok, bad = results
    assert isinstance(bad, EngineError), bad
    for text, reason in ok:
        assert reason is FinishReason.LENGTH and len(text) == 12, (text, reason)
    text, reason = await run(engine, "after", max_tokens=5)
    assert reason is FinishReason.LENGTH and len(text) == 5
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_cells_used == 0


def fail_for_faulty(original):
    def wrapper(self, *args, **kwargs):
        if self.params.frequency_penalty == FAULTY and self.num_generated >= 2:
            raise OverflowError("injected")
        return original(self, *args, **kwargs)
    return wrapper


async def test_a_failure_in_one_rows_processing_fails_that_request_alone(engine, monkeypatch):
    monkeypatch.setattr(sampling.SamplerState, "apply_penalties", fail_for_faulty(sampling.SamplerState.apply_penalties))
    await neighbours_and_faulty(engine)


async def test_a_failure_in_one_rows_draw_fails_that_request_alone(engine, monkeypatch):
    original = sampler_module.pick_rows

    def pick(rows, states):
        if any(st.params.frequency_penalty == FAULTY and st.num_generated >= 2 for st in states):
            raise ZeroDivisionError("injected")
        return original(rows, states)

    monkeypatch.setattr(sampler_module, "pick_rows", pick)
    await neighbours_and_faulty(engine)


async def test_a_failure_in_one_requests_logprobs_fails_it_alone(engine, monkeypatch):
    original = sampler_module.token_logprobs

    def logprobs(rows, which, tokens, ks):
        if 7 in ks:
            raise ValueError("injected")
        return original(rows, which, tokens, ks)

    monkeypatch.setattr(sampler_module, "token_logprobs", logprobs)
    await neighbours_and_faulty(engine, logprobs=7)


async def test_a_failure_in_one_requests_detokenizing_fails_it_alone(engine, monkeypatch):
    original = OutputProcessor._detokenizer

    def detokenizer(self, params):
        detok = original(self, params)
        if params.frequency_penalty == FAULTY:
            def push(token):
                raise UnicodeError("injected")
            detok.push = push
        return detok

    monkeypatch.setattr(OutputProcessor, "_detokenizer", detokenizer)
    await neighbours_and_faulty(engine)


async def test_a_failing_beam_step_fails_that_search_alone(engine, monkeypatch):
    original = BeamSearch.step

    def step(self, rows):
        if self.params.frequency_penalty == FAULTY:
            raise OverflowError("(2 ** 1000.0): the kind of failure an unchecked length_penalty raised")
        return original(self, rows)

    monkeypatch.setattr(BeamSearch, "step", step)
    await neighbours_and_faulty(engine, best_of=2, beam=BeamParams())


async def test_nan_rows_from_one_request_do_not_reach_the_others(engine, monkeypatch):
    """A row turned to NaN (say, by a penalty gone wrong) still draws a token; it must not poison other rows."""
    original = sampling.SamplerState.apply_penalties

    def poison(self, row):
        if self.params.frequency_penalty == FAULTY:
            row[:] = np.nan
            return None
        return original(self, row)

    monkeypatch.setattr(sampling.SamplerState, "apply_penalties", poison)
    texts = await asyncio.gather(*[run(engine, f"ok{i}") for i in range(3)], run(engine, "nan", frequency_penalty=FAULTY))
    for text, reason in texts[:3]:
        assert reason is FinishReason.LENGTH and len(text) == 12


async def test_a_grammar_that_fails_mid_answer_fails_its_request_with_a_client_error():
    """A grammar past llguidance's per-step limits used to end its answer silently (empty or unconstrained);
    now its request fails with 400 grammar_too_complex naming the parameter, and the others go on."""
    from servelm.constrain.grammars import Grammars
    from servelm.errors import ConstraintFailed

    runner = FakeRunner(num_slots=6, max_step_tokens=32, step_delay=0.002)
    grammars = Grammars(runner.model.token_table(), list(runner.eog_ids), runner.model.tokenize_text)
    engine = LocalEngine(runner, grammars=grammars)
    engine.start()
    try:
        constraint = grammars.regex("[a-z]+")
        from dataclasses import replace
        constraint = replace(constraint, param="structured_outputs.regex")
        failing = grammars.matcher(constraint)

        class Breaks:  # a matcher that errs on its third token, as llguidance does past a limit
            def __init__(self) -> None:
                self.n = 0

            def __getattr__(self, name):
                return getattr(failing, name)

            def consume_token(self, token: int) -> bool:
                self.n += 1
                return self.n < 3 and failing.consume_token(token)

            def get_error(self) -> str:
                return "Parser Error: Current row has 4001 items; max is 2000\n<state>\nTokens: secret"

        original = grammars.matcher
        grammars.matcher = lambda c: Breaks() if c.param == "structured_outputs.regex" else original(c)
        params = SamplingParams(max_tokens=12, temperature=0.0)
        bad = GenerationRequest("bad", (3, 4, 5), params, constraint)

        async def drain(req):
            return [o async for o in engine.generate(req)]

        results = await asyncio.gather(drain(bad), *[run(engine, f"ok{i}") for i in range(3)], return_exceptions=True)
        err = results[0]
        assert isinstance(err, ConstraintFailed) and err.status == 400 and err.code == "grammar_too_complex"
        assert err.param == "structured_outputs.regex" and "secret" not in err.message and "\n" not in err.message
        for text, reason in results[1:]:
            assert reason is FinishReason.LENGTH and len(text) == 12
    finally:
        engine.stop()
