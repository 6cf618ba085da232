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
