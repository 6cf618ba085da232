"""The output stage driven by hand: a SampledStep built here goes in, a StepResult comes out (outputs per request
and the events the scheduler applies), and nothing of the scheduler is touched."""

from __future__ import annotations

from servelm.engine.output import BeamMove, EngineError, Failed, Finish, OutputProcessor
from servelm.engine.sampler import Drawn, SampledStep
from servelm.engine.sequence import SequenceGroup
from servelm.engine.types import BeamParams, FinishReason, GenerationRequest, SamplingParams
from servelm.runners.fake import EOS, FakeRunner


def attached(processor: OutputProcessor, rid: str, **params) -> SequenceGroup:
    request = GenerationRequest(rid, (3, 4, 5), SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params}))
    group = SequenceGroup(rid, request.prompt_token_ids, request.params)
    processor.attach(processor.prepare(request, group))
    return group


def drew(*pairs) -> SampledStep:
    return SampledStep({group.seqs[i].key: Drawn([token], [None]) for group, i, token in pairs})


def test_a_token_becomes_text_and_the_end_token_finishes_its_choice_alone():
    out = OutputProcessor(FakeRunner(), None)
    a, b = attached(out, "a"), attached(out, "b")
    result = out.process(drew((a, 0, 1), (b, 0, 2)))
    assert [o.text for o in result.outputs["a"]] == ["b"] and [o.text for o in result.outputs["b"]] == ["c"]
    assert result.events == []
    result = out.process(drew((a, 0, EOS), (b, 0, 3)))
    (last,) = result.outputs["a"]
    assert last.finish_reason is FinishReason.STOP and last.token_ids == [] and last.completion_tokens == 2
    assert result.events == [Finish(a.seqs[0].key)], "the scheduler learns it from the event"
    assert out.live(b.seqs[0].key) and not out.live(a.seqs[0].key)


def test_max_tokens_ends_a_choice_with_length():
    out = OutputProcessor(FakeRunner(), None)
    g = attached(out, "g", max_tokens=2)
    out.process(drew((g, 0, 1)))
    result = out.process(drew((g, 0, 2)))
    assert result.outputs["g"][-1].finish_reason is FinishReason.LENGTH
    assert result.events == [Finish(g.seqs[0].key)]


def test_a_failure_in_the_sampler_fails_its_request_and_nothing_else():
    out = OutputProcessor(FakeRunner(), None)
    a, b = attached(out, "a"), attached(out, "b")
    sampled = drew((b, 0, 2))
    sampled.failed["a"] = ZeroDivisionError("injected")
    result = out.process(sampled)
    assert isinstance(result.outputs["a"], EngineError) and "ZeroDivisionError" in result.outputs["a"].message
    assert result.events == [Failed("a")]
    assert [o.text for o in result.outputs["b"]] == ["c"]
    assert not out.live(a.seqs[0].key)


def test_a_later_failure_replaces_what_its_request_had_in_the_step():
    out = OutputProcessor(FakeRunner(), None)
    a = attached(out, "a", n=2)
    result = out.process(drew((a, 0, 1)))
    later = SampledStep(failed={"a": ValueError("injected")})
    result.extend(out.process(later))
    assert isinstance(result.outputs["a"], EngineError), "only the error goes out"


def test_a_beam_step_is_an_event_with_each_new_beams_parent_and_token():
    import numpy as np

    runner = FakeRunner()
    out = OutputProcessor(runner, None)
    g = attached(out, "beam", n=1, best_of=2, beam=BeamParams())
    rows = np.full((2, runner.vocab_size), -10.0, dtype=np.float32)
    rows[0, 5], rows[0, 6] = 0.0, -0.5  # beam 0 leads with 5 then 6; beam 1 starts empty (it is the same text)
    result = out.process(SampledStep(beams={"beam": rows}))
    (move,) = result.events
    assert isinstance(move, BeamMove) and move.parents == (0, 0) and move.tokens == (5, 6)
    assert "beam" not in result.outputs, "beams report at the end of the search"
    assert all(out.live(s.key) for s in g.seqs), "both beams go on"
