"""The waiting queue as data: places reserved all or none, per caller, given back at a first output or at the end."""

from __future__ import annotations

import gc

import pytest

from servelm.engine.types import GenerationOutput
from servelm.engine.wrappers.admission import WaitingQueue
from servelm.errors import QueueFull


def output(q: WaitingQueue, request_id: str) -> None:
    """The engine's output of one generation, as QueuedEngine passes it on."""
    q.output(GenerationOutput(request_id, 0, "x", [7], completion_tokens=1))


def test_a_request_reserves_a_place_per_generation_all_or_none():
    q = WaitingQueue()
    held = [q.reserve("a", ["r1", "r2", "r3"], limit=4, caller_limit=0)]
    with pytest.raises(QueueFull) as info:
        q.reserve("b", ["s1", "s2"], limit=4, caller_limit=0)
    assert "queue is full (3 requests waiting)" in info.value.message
    assert q.total == 3, "a refused batch takes nothing"
    held.append(q.reserve("b", ["s1"], limit=4, caller_limit=0))
    assert q.total == 4


def test_one_caller_holds_at_most_its_share():
    q = WaitingQueue()
    held = [q.reserve("a", ["1", "2"], limit=10, caller_limit=2)]
    with pytest.raises(QueueFull) as info:
        q.reserve("a", ["3"], limit=10, caller_limit=2)
    assert "one caller may hold 2" in info.value.message
    held.append(q.reserve("b", ["4", "5"], limit=10, caller_limit=2))
    assert q.by_caller == {"a": 2, "b": 2}


def test_places_come_back_at_the_first_output_and_the_rest_at_the_end():
    q = WaitingQueue()
    t = q.reserve("a", ["1", "2", "3"], limit=3, caller_limit=3)
    output(q, "1")
    output(q, "1")  # once only
    assert q.total == 2 and q.by_caller == {"a": 2}
    t.close()
    assert q.total == 0 and q.by_caller == {}
    output(q, "2")  # a late first output after the end changes nothing
    assert q.total == 0


def test_a_ticket_dropped_unreleased_gives_its_places_back():
    """A streamed response dropped before its body started never runs its cleanup; the ticket's end does."""
    q = WaitingQueue()
    t = q.reserve("a", ["1", "2"], limit=2, caller_limit=2)
    assert q.total == 2
    del t
    gc.collect()
    assert q.total == 0
    assert q.reserve("a", ["3", "4"], limit=2, caller_limit=2)


def test_a_next_turn_takes_the_place_of_the_last_and_counts_toward_the_same_charge():
    """A response's next turn (after its tool calls ran) waits in its request's admission, unrefused."""

    class Charge:
        settled: list[int] = []

        def settle(self, used: int) -> None:
            self.settled.append(used)

    q = WaitingQueue()
    charge = Charge()
    t = q.reserve("a", ["turn1"], limit=1, caller_limit=1, charge=charge)
    output(q, "turn1")
    assert q.total == 0
    q.follow(["turn1"], ["turn2"])  # even with the queue's bound reached by another meanwhile, it is not refused
    assert q.total == 1 and q.by_caller == {"a": 1}
    output(q, "turn2")
    q.follow(["unknown"], ["turn3"])  # a generation of no admission: nothing to follow
    assert q.total == 0
    t.close()
    assert charge.settled == [2] and q.total == 0 and q.by_caller == {}
