"""The fake runner keeps the llama.cpp runner's books: the passes it would make, and every KV operation checked."""

from __future__ import annotations

import pytest

from servelm.engine.plan import Copy, Keep, ScheduledChunk, StepPlan
from servelm.runners.fake import FakeKVError, FakeRunner


def test_the_fake_runner_counts_the_calls_the_llama_cpp_runner_makes():
    runner = FakeRunner(num_slots=8)
    runner.step(StepPlan([ScheduledChunk(None, s, 0, (5, 6, 7), samplers=(object(),)) for s in (0, 1, 4)]))
    assert runner.forward_calls == 1  # two micro-batches (slots 0-1, slot 4), one llama_decode
    runner.step(StepPlan([ScheduledChunk(None, 0, 3, (8,), 7, samplers=(object(),)),
                          ScheduledChunk(None, 1, 3, (8, 9), 7, samplers=(object(),))]))
    assert runner.forward_calls == 3  # slot 1's second token would be a micro-batch of one row: a call of its own


def test_the_fake_runner_refuses_kv_operations_on_cells_it_does_not_hold():
    runner = FakeRunner(num_slots=4)
    runner.step(StepPlan([ScheduledChunk(None, 0, 0, (5, 6, 7), samplers=(object(),))]))
    with pytest.raises(FakeKVError):
        runner.step(StepPlan(ops=[Keep(0, 4)]))
    with pytest.raises(FakeKVError):
        runner.step(StepPlan(ops=[Copy(1, 2, 1)]))
    runner.step(StepPlan(ops=[Copy(0, 2, 2)]))
    assert runner.cells[2] == [5, 6]
