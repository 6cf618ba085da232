"""StepPlan.calls: how a step is cut into forward passes that llama.cpp's micro-batching leaves whole."""

from __future__ import annotations

from servelm.engine.plan import ScheduledChunk, StepPlan


def chunk(slot: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(None, slot, 100, tuple(range(n)), samplers=(object(),))


def test_decode_rows_of_consecutive_slots_share_a_pass_and_a_gap_costs_one():
    plan = StepPlan([chunk(2, 1), chunk(0, 1), chunk(1, 1), chunk(5, 1)])
    assert plan.calls() == [[1, 2, 0], [3]]


def test_prompt_chunks_share_a_pass_only_with_equal_lengths_in_consecutive_slots():
    plan = StepPlan([chunk(0, 1), chunk(3, 40), chunk(4, 40), chunk(5, 12), chunk(6, 40)])
    assert plan.calls() == [[0], [3], [1, 2], [4]]


def test_the_fake_runner_counts_the_passes_the_llama_cpp_runner_makes():
    from servelm.runners.fake import FakeRunner

    runner = FakeRunner(num_slots=8)
    runner.step(StepPlan([ScheduledChunk(None, s, 0, (5, 6, 7), samplers=(object(),)) for s in (0, 1, 4)]))
    assert runner.forward_calls == 2
