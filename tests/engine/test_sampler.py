"""The sampling stage driven by hand: a plan and logits rows built here go in, a SampledStep comes out (each
sequence's token and logprobs, a failing request isolated), with no scheduler and no model."""

from __future__ import annotations

import numpy as np

from servelm.engine.output import OutputProcessor
from servelm.engine.plan import ScheduledChunk, StepPlan
from servelm.engine.sampler import Drawn, SampledStep, StepSampler
from servelm.engine.sampling import SamplerState
from servelm.engine.sequence import SequenceGroup
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner

VOCAB = 64


def stage(*requests: tuple[str, dict]) -> tuple[StepSampler, list[SequenceGroup]]:
    runner = FakeRunner(vocab_size=VOCAB)
    out = OutputProcessor(runner, None)
    groups = []
    for rid, params in requests:
        request = GenerationRequest(rid, (3, 4, 5), SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params}))
        group = SequenceGroup(rid, request.prompt_token_ids, request.params)
        out.attach(out.prepare(request, group))
        groups.append(group)
    return StepSampler(VOCAB, runner.eog_ids, out.choices, grammars=False), groups


def decode_plan(groups: list[SequenceGroup]) -> StepPlan:
    return StepPlan([ScheduledChunk(g.seqs[0].key, i, 3, (5,), 4, samplers=(g.seqs[0].key,)) for i, g in enumerate(groups)])


def peaked(rows: int, at: list[int]) -> np.ndarray:
    logits = np.zeros((rows, VOCAB), dtype=np.float32)
    logits[np.arange(rows), at] = 5.0
    return logits


def test_each_sequence_gets_its_rows_token_and_the_logprobs_it_asked_for():
    sampler, (a, b) = stage(("a", {}), ("b", {"logprobs": 2}))
    sampled = sampler.sample(decode_plan([a, b]), peaked(2, [7, 9]))
    assert sampled.drawn[a.seqs[0].key].tokens == [7] and sampled.drawn[a.seqs[0].key].entries == [None]
    (entry,) = sampled.drawn[b.seqs[0].key].entries
    assert sampled.drawn[b.seqs[0].key].tokens == [9] and entry is not None and entry.token == 9
    assert len(entry.top) == 2 and not sampled.failed


def test_a_request_whose_row_raises_fails_alone_and_the_others_draw_as_if_alone(monkeypatch):
    sampler, (a, b, c) = stage(("a", {}), ("bad", {"frequency_penalty": 1.5}), ("c", {}))
    original = SamplerState.apply_penalties

    def raising(self, row):
        if self.params.frequency_penalty == 1.5:
            raise OverflowError("injected")
        return original(self, row)

    monkeypatch.setattr(SamplerState, "apply_penalties", raising)
    sampled = sampler.sample(decode_plan([a, b, c]), peaked(3, [7, 8, 9]))
    assert list(sampled.failed) == ["bad"] and isinstance(sampled.failed["bad"], OverflowError)
    assert {k: d.tokens for k, d in sampled.drawn.items()} == {a.seqs[0].key: [7], c.seqs[0].key: [9]}


def test_a_drafted_chunks_next_row_counts_only_while_its_guesses_hold():
    chunk = ScheduledChunk(1, 0, 10, (5, 6, 7), 4, samplers=(1,), drafted=2)
    sampled = SampledStep({1: Drawn([6], [None], drafted=2)})
    assert sampled.held(chunk, 1), "the token drawn is the first guess: the row after it is the next"
    assert not sampled.held(chunk, 2), "the row after the second guess waits for the first's token"
    sampled.extend(SampledStep({1: Drawn([9], [None], accepted=1)}))
    assert not sampled.held(chunk, 2), "9 is not the second guess"
    assert sampled.drawn[1].tokens == [6, 9] and sampled.drawn[1].accepted == 1
