"""The slots as data: where a new sequence starts (a cached prefix in place or copied, next to the running ones),
which resting entry goes first, and what a sequence at its end leaves behind."""

from __future__ import annotations

from servelm.engine.sequence import SequenceGroup
from servelm.engine.slots import MIN_REUSE, Slots, common_prefix
from servelm.engine.types import SamplingParams


def running(slots: Slots, index: int, tokens: list[int], scope: str = ""):
    seq = SequenceGroup(f"r{index}", tuple(tokens), SamplingParams(max_tokens=8)).seqs[0]
    seq.num_computed = len(tokens)
    slots.take(slots.slots[index], seq, scope)
    return seq


def test_common_prefix_counts_shared_leading_tokens_up_to_a_limit():
    a = list(range(200))
    assert common_prefix(a, a[:130] + [-1], 500) == 130
    assert common_prefix(a, a, 70) == 70
    assert common_prefix([1, 2], [3], 10) == 0


def test_a_prompt_that_continues_a_resting_entry_starts_there_in_place():
    slots = Slots(3)
    slots.release(slots.slots[1], [5, 6, 7, 8, 9])
    placed = slots.place([5, 6, 7, 8, 9, 10, 11], "", reads_cache=True)
    assert placed is not None and placed.slot.index == 1 and placed.reuse == 5 and placed.source is None


def test_entries_are_matched_within_their_scope_only_and_short_matches_do_not_count():
    slots = Slots(2)
    slots.release(slots.slots[0], list(range(1, 30)), 0.0)
    slots.slots[0].scope = "key-a"
    assert slots.best_match(list(range(1, 30)), 28, "key-b") == (None, 0)
    assert slots.best_match(list(range(1, 30)), 28, "key-a")[1] == 28
    placed = slots.place([1, 2, 3] + [99] * 10, "key-a", reads_cache=True)
    assert 3 < MIN_REUSE and placed is not None and placed.reuse == 0, "three shared tokens are not worth a slot"


def test_a_running_sequences_prompt_is_copied_for_a_new_one_beside_it():
    slots = Slots(4)
    running(slots, 1, list(range(1, 41)))
    placed = slots.place(list(range(1, 41)) + [7, 7], "", reads_cache=True)
    assert placed is not None and placed.source is slots.slots[1] and placed.reuse == 40
    assert placed.slot.index in (0, 2), "next to the running slot"


def test_the_least_recently_used_entry_goes_first_and_a_pinned_one_last():
    slots = Slots(2)
    slots.release(slots.slots[0], list(range(1, 20)), pin_seconds=60.0)
    slots.release(slots.slots[1], list(range(50, 70)))
    assert slots.spare().index == 1, "the pinned entry is kept while an unpinned one can go"
    slots.release(slots.slots[1], list(range(50, 70)))  # used again: now the newer of the two
    slots.slots[0].pinned_until = 0.0
    assert slots.spare().index == 0, "unpinned, the older entry goes first"
