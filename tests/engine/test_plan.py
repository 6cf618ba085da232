"""StepPlan.calls and micro_batches: how a step is cut into llama_decode calls, and how llama.cpp's micro-batching cuts
each (tests/runners/test_llamacpp_calls.py checks the runner's layout against llama.cpp's own split)."""

from __future__ import annotations

from servelm.engine.plan import ScheduledChunk, StepPlan


def chunk(slot: int, n: int, adapters: tuple[tuple[str, float], ...] = ()) -> ScheduledChunk:
    return ScheduledChunk(None, slot, 100, tuple(range(n)), samplers=(object(),), adapters=adapters)


def test_decode_rows_of_consecutive_slots_share_a_micro_batch_and_a_gap_costs_one_but_no_call():
    plan = StepPlan([chunk(2, 1), chunk(0, 1), chunk(1, 1), chunk(5, 1)])
    assert plan.calls() == [[1, 2, 0, 3]]
    assert plan.micro_batches([1, 2, 0, 3]) == [[(1, 0, 1), (2, 0, 1), (0, 0, 1)], [(3, 0, 1)]]


def test_a_step_with_prompt_reading_slots_between_decoding_ones_is_one_call_of_the_fewest_micro_batches():
    """Every stream's first row in one micro-batch (16 consecutive streams), then what each prompt chunk has left: two
    prompts in slots apart cannot share one, two side by side share as many rows as both have."""
    lengths = {s: 1 for s in range(16)} | {3: 40, 9: 12, 12: 20, 13: 20}
    plan = StepPlan([chunk(s, n) for s, n in lengths.items()])
    (call,) = plan.calls()
    assert call == list(range(16))
    assert plan.micro_batches(call) == [[(s, 0, 1) for s in range(16)], [(3, 1, 39)], [(9, 1, 11)],
                                        [(12, 1, 19), (13, 1, 19)]]


def test_prompt_chunks_of_consecutive_slots_share_rows_as_far_as_the_shortest_goes():
    plan = StepPlan([chunk(0, 1), chunk(3, 40), chunk(4, 40), chunk(5, 12), chunk(6, 40)])
    (call,) = plan.calls()
    assert plan.micro_batches(call) == [[(0, 0, 1)], [(1, 0, 12), (2, 0, 12), (3, 0, 12), (4, 0, 12)],
                                        [(1, 12, 28), (2, 12, 28)], [(4, 12, 28)]]


def test_a_chunk_whose_last_token_would_be_a_micro_batch_alone_goes_to_a_call_of_its_own():
    """Slot 1 reads two tokens beside slot 0's one: its second would be a lone row, which the runner keeps exact
    only by reading its previous position again, in another call. A one-token chunk alone in its stream's micro-batch
    (slot 5) stays: its previous position is in no other micro-batch of the call."""
    plan = StepPlan([chunk(0, 1), chunk(1, 2), chunk(5, 1)])
    assert plan.calls() == [[1], [0, 2]]
    assert plan.micro_batches([0, 2]) == [[(0, 0, 1)], [(2, 0, 1)]]
    assert plan.micro_batches([1]) == [[(1, 0, 2)]]


def test_chunks_of_other_lora_adapters_go_in_calls_of_their_own():
    a, b = (("a", 1.0),), (("b", 1.0),)
    plan = StepPlan([chunk(0, 1, a), chunk(1, 1, b), chunk(2, 1, a), chunk(3, 1)])
    calls = plan.calls()
    assert sorted(calls) == [[0, 2], [1], [3]]
    assert all(len({plan.chunks[i].adapters for i in call}) == 1 for call in calls)
