"""The prefix cache: a slot at rest keeps its cells (a prompt, or a whole turn), and a new request starts where
the longest part of its prompt already is: in place in a slot at rest, or copied from a running one; the least
recently used slot's cells go first. Driven by hand (pure data) and, for every KV operation, against the fake
runner, which checks each copy, trim and chunk against its own book of cells; and engine/prefix_cache.py's
PrefixCache on its own (placement, release, copies, restores, persistence, its counts)."""

from __future__ import annotations

import random

from servelm.engine.plan import Clear, Copy, Keep, Restore, Save
from servelm.engine.prefix_cache import CacheStats, PrefixCache
from servelm.engine.sequence import SequenceGroup
from servelm.engine.spill import SUFFIX, SpillStore
from servelm.engine.types import SamplingParams
from servelm.runners.fake import FakeRunner
from tests.engine.steps import Recording


def cache(num_slots: int = 2, max_step_tokens: int = 64, **kw) -> Recording:
    return Recording(num_slots, kw.pop("context_window", 512), max_step_tokens, **kw)


def run_step(s: Recording, token: int = 7, runner: FakeRunner | None = None):
    plan = s.schedule()
    if runner is not None:
        runner.step(plan)  # raises on a copy or trim of cells that are not there, or a chunk at the wrong position
    s.record(plan, {seq: token for c in plan.chunks for seq in c.samplers})
    if runner is not None:  # never fewer: a fork's copy counts from its decision, the runner's from the next step
        assert runner.cells_in_use() <= s.kv_cells_used + s.cache.cached_cells, "the scheduler undercounts the cells"
    return plan


def ask(s: Recording, rid: str, prompt, max_tokens: int = 2, scope: str = "", **kw) -> SequenceGroup:
    g = SequenceGroup(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **kw), scope=scope)
    s.add(g)
    return g


def finish(s: Recording, g: SequenceGroup) -> None:
    for seq in g.live:
        s.finish(seq)


def test_a_prompt_stays_in_its_slot_and_one_that_continues_it_starts_there_in_place():
    s = cache()
    first = ask(s, "first", range(1, 21), max_tokens=1)
    run_step(s)
    slot = first.seqs[0].slot
    finish(s, first)
    second = ask(s, "second", [*range(1, 21), 99, 98])
    plan = run_step(s)
    assert second.seqs[0].slot == slot and second.cached_tokens == 20
    assert plan.ops == [Keep(slot, 20), Keep(slot, 20)], "trimmed to what it counted, then to what the next reuses"
    assert [(c.start, c.tokens) for c in plan.chunks] == [(20, (99, 98))]


def test_a_prefix_shared_with_an_entry_that_goes_on_differently_is_copied_and_the_entry_stays_whole():
    s = cache(num_slots=3)
    system = list(range(100, 140))
    first = ask(s, "first", [*system, 1, 2, 3], max_tokens=1)
    run_step(s)
    slot = first.seqs[0].slot
    finish(s, first)
    second = ask(s, "second", [*system, 7, 8])
    plan = run_step(s)
    assert second.cached_tokens == 40 and second.seqs[0].slot != slot
    assert Copy(slot, second.seqs[0].slot, 40) in plan.ops
    third = ask(s, "third", [*system, 1, 2, 3, 4])
    run_step(s)
    assert third.cached_tokens == 43, "the first entry is still whole"


def test_a_finished_turn_is_kept_and_the_next_turn_reuses_prompt_and_answer():
    s = cache()
    turn = ask(s, "t1", range(1, 11), max_tokens=3)
    for _ in range(3):
        run_step(s, token=50)
    finish(s, turn)
    history = list(turn.seqs[0].token_ids)
    assert len(history) == 13 and s.cache.cached_cells == 12, "the prompt and the answer's cells but the last token's"
    nxt = ask(s, "t2", [*history, 60, 61])
    run_step(s)
    assert nxt.cached_tokens == 12, "the conversation's next turn reads only what is new"


def test_several_prefixes_stay_in_several_slots_and_each_is_found():
    s = cache(num_slots=4)
    systems = [[10 + k] * 20 for k in range(3)]
    for k, system in enumerate(systems):
        g = ask(s, f"w{k}", system, max_tokens=1)
        run_step(s)
        finish(s, g)
    for k, system in enumerate(systems):
        g = ask(s, f"r{k}", [*system, 1, 2])
        run_step(s)
        assert g.cached_tokens == 20
        finish(s, g)


def test_the_least_recently_used_slot_gives_its_cells_up_first():
    s = cache(num_slots=2)
    a = ask(s, "a", [1] * 10, max_tokens=1)
    b = ask(s, "b", [2] * 10, max_tokens=1)
    run_step(s)
    slot_a = a.seqs[0].slot
    finish(s, a)
    finish(s, b)
    reuse = ask(s, "again-b", [2] * 12, max_tokens=1)  # b's slot is used again: a's is now the least recent
    run_step(s)
    finish(s, reuse)
    fresh = ask(s, "c", [3] * 10, max_tokens=1)
    plan = run_step(s)
    assert fresh.seqs[0].slot == slot_a and Clear(slot_a) in plan.ops and fresh.cached_tokens == 0
    assert ask(s, "again-b2", [2] * 12, max_tokens=1) and run_step(s) and s.running[-1].cached_tokens == 11


def test_a_running_requests_cells_are_copied_for_a_new_one():
    s = cache(num_slots=3, max_step_tokens=256)
    system = list(range(100, 180))  # 80 tokens: worth a copy
    long_running = ask(s, "a", [*system, 1], max_tokens=50)
    run_step(s)
    run_step(s)  # a has read its prompt and decodes on
    b = ask(s, "b", [*system, 2, 3])
    plan = run_step(s)
    src = long_running.seqs[0].slot
    assert b.cached_tokens == 80 and Copy(src, b.seqs[0].slot, 80) in plan.ops
    assert [(c.start, c.tokens) for c in plan.chunks if s.group(c) is b] == [(80, (2, 3))]


def test_prompt_logprob_requests_read_everything_and_seeded_ones_reuse():
    s = cache(num_slots=3)
    first = ask(s, "a", range(1, 11), max_tokens=1)
    run_step(s)
    finish(s, first)
    echoed = ask(s, "e", range(1, 11), max_tokens=1, prompt_logprobs=0)
    seeded = ask(s, "s", range(1, 11), max_tokens=1, seed=3)
    run_step(s)
    assert echoed.cached_tokens == 0, "every prompt token needs its row"
    assert seeded.cached_tokens == 9, "exact reuse: a seed gives the same text either way (docs/exactness.md)"


def test_an_identical_prompt_still_computes_its_last_token():
    s = cache(num_slots=2)
    for rid in ("a", "b"):
        g = ask(s, rid, range(1, 11), max_tokens=1)
        plan = run_step(s)
        finish(s, g)
    assert [(c.start, len(c.tokens)) for c in plan.chunks] == [(9, 1)] and plan.chunks[0].wants_logits


def arrive(s: Recording, rng: random.Random, systems: list[list[int]], request_id: str, ns: list[int] | None = None) -> None:
    """Random traffic: three times in ten, a conversation over one of the shared system prompts arrives (n drawn
    from `ns`, when given)."""
    if rng.random() < 0.3:
        prompt = [*rng.choice(systems), *[rng.randint(1, 60) for _ in range(rng.randint(1, 12))]]
        ask(s, request_id, prompt, max_tokens=8, **({"n": rng.choice(ns)} if ns else {}))


def test_every_operation_matches_the_runners_cells_under_random_traffic():
    """Conversations over a few shared system prompts, random lengths and finishes, n > 1, few slots: the fake
    runner checks every copy, trim and chunk, and the scheduler's counts are its cells after every step."""
    rng = random.Random(7)
    runner = FakeRunner(num_slots=4, max_step_tokens=32, context_window=160)
    s = Recording(4, 160, 32)
    systems = [[20 + k] * rng.randint(5, 40) for k in range(4)]
    hits = 0
    for i in range(400):
        arrive(s, rng, systems, f"r{i}", ns=[1, 1, 1, 2])
        run_step(s, token=rng.randint(1, 60), runner=runner)
        for g in list(s.running):
            for seq in g.live:
                if seq.num_generated >= 1 and rng.random() < 0.2:
                    s.finish(seq)
        hits += sum(g.cached_tokens > 0 for g in s.running)
    assert hits > 0, "the traffic did reuse cached prefixes"
    for g in list(s.running):
        finish(s, g)
    run_step(s, runner=runner)
    assert runner.cells_in_use() == s.cache.cached_cells and s.kv_cells_used == 0, "at rest, the counts are exact"


def test_requests_arriving_together_with_one_long_prefix_read_it_once():
    s = cache(num_slots=4, max_step_tokens=64)
    system = list(range(100, 300))
    groups = [ask(s, f"r{k}", [*system, k + 1, k + 2], max_tokens=4) for k in range(4)]
    read = 0
    for _ in range(12):
        read += sum(len(c.tokens) for c in run_step(s).chunks if c.start < s.seq(c.seq).prompt_len)
    assert [g.cached_tokens for g in groups] == [0, 200, 200, 200]
    assert read == 202 + 3 * 2, "the shared 200 tokens were read once"


def test_a_request_does_not_wait_for_a_prefix_too_short_to_matter():
    s = cache(num_slots=4, max_step_tokens=256)
    a = ask(s, "a", [*range(100, 130), *range(1, 100)], max_tokens=4)
    b = ask(s, "b", [*range(100, 130), *range(200, 240)], max_tokens=4)
    plan = run_step(s)
    assert {s.group(c) for c in plan.chunks} == {a, b}, "30 shared tokens are not worth a wait"


def test_a_request_does_not_wait_for_a_prefix_the_cache_already_holds_but_for_a_few_tokens():
    """Found by the bench (shared-prefix-4): with the system prompt cached, four requests arriving together share
    it plus the template's few tokens that open the user turn; the later ones waited a whole prompt read for
    those few tokens, so their first token came twice as late."""
    s = cache(num_slots=6, max_step_tokens=256)
    system = list(range(100, 300))
    warm = ask(s, "warm", [*system, 5], max_tokens=1)
    while warm.seqs[0].num_generated == 0:
        run_step(s)
    finish(s, warm)
    groups = [ask(s, f"r{k}", [*system, 1, 2, 3, 40 + k, 50 + k], max_tokens=4) for k in range(4)]
    plan = run_step(s)
    assert {s.group(c) for c in plan.chunks} == set(groups), "all four read their questions in the first step"
    assert [g.cached_tokens for g in groups] == [200] * 4


def test_entries_are_read_only_within_the_scope_that_wrote_them():
    """Another key's request with the same prompt reads nothing (not even a length it could time); the same
    scope reads the entry."""
    s = cache(num_slots=3)
    a = ask(s, "a", range(1, 21), max_tokens=1, scope="key-a")
    run_step(s)
    finish(s, a)
    other = ask(s, "b", range(1, 25), max_tokens=1, scope="key-b")
    same = ask(s, "a2", range(1, 25), max_tokens=1, scope="key-a")
    run_step(s)
    assert other.cached_tokens == 0 and same.cached_tokens == 20


def test_a_request_waits_only_for_a_prompt_of_its_own_scope():
    """Waiting for a shared prompt still being read would tell a second key that the first key sent it."""
    s = cache(num_slots=3, max_step_tokens=64, max_rows=63)
    long_prompt = tuple(range(1, 101))
    ask(s, "a", long_prompt, max_tokens=1, scope="key-a")
    run_step(s)  # "a" has read 63 of its 100 tokens
    ask(s, "b", long_prompt, max_tokens=1, scope="key-b")
    ask(s, "a2", long_prompt, max_tokens=1, scope="key-a")
    plan = s.schedule()
    started = {s.group(c).request_id for c in plan.chunks}
    assert "b" in started, "another scope's request is not held back"
    assert "a2" not in started, "the same scope waits to reuse what is being read"


def test_without_the_cache_every_prompt_is_read_whole():
    s = cache(prefix_cache=False)
    g = ask(s, "a", range(1, 11), max_tokens=1)
    run_step(s)
    slot = g.seqs[0].slot
    finish(s, g)
    again = ask(s, "b", range(1, 11), max_tokens=1)
    plan = run_step(s)
    assert again.cached_tokens == 0 and Clear(slot) in plan.ops and plan.chunks[0].start == 0


def _rest_entries(s: Recording, count: int) -> list[int]:
    """Fill `count` slots with finished one-token requests, one after another; their slots in that order."""
    slots = []
    for k in range(count):
        g = ask(s, f"entry{k}", [30 + k] * 12, max_tokens=1)
        run_step(s)
        slots.append(g.seqs[0].slot)
        finish(s, g)
    return slots


def test_a_new_sequence_goes_next_to_the_running_ones_and_the_entry_there_is_kept_elsewhere():
    """llama.cpp decodes consecutive sequence ids in one pass: a gap between running slots costs a pass a step.
    The neighbour's entry is copied over the least recently used one, which would have gone anyway."""
    s = cache(num_slots=6)
    _rest_entries(s, 6)
    running = ask(s, "running", [30 + 3] * 12 + [5], max_tokens=50)  # continues entry3 in place
    run_step(s)
    at = running.seqs[0].slot
    assert running.cached_tokens == 12
    before = {slot.index: slot.cached for slot in s.cache.slots.slots}
    fresh = ask(s, "fresh", [99] * 10, max_tokens=1)
    plan = run_step(s)
    new = fresh.seqs[0].slot
    assert abs(new - at) == 1, f"slot {new} is not beside the running slot {at}"
    lru = 0  # entry0's slot: the least recently used
    assert plan.ops[0] == Copy(new, lru, len(before[new])), "the neighbour's entry is kept, over the oldest"
    assert s.cache.slots.slots[lru].cached == before[new]
    finish(s, fresh)
    kept = ask(s, "kept", [*before[new], 7], max_tokens=1)
    run_step(s)
    assert kept.cached_tokens == len(before[new]), "the moved entry is still found"


def test_a_turn_whose_conversation_rests_apart_from_the_running_slots_is_copied_beside_them():
    s = cache(num_slots=6)
    slots = _rest_entries(s, 6)
    history = [30] * 12 + [7]  # entry0's turn: its prompt and its answer
    others = [ask(s, f"o{k}", [30 + k] * 12 + [5], max_tokens=50) for k in (3, 4)]  # continue entries 3, 4
    run_step(s)
    busy = {g.seqs[0].slot for g in others}
    assert busy == {slots[3], slots[4]} and slots[0] == 0, "the setting: entry0 rests apart from the running"
    nxt = ask(s, "turn2", [*history, 50, 51], max_tokens=1)
    plan = run_step(s)
    slot = nxt.seqs[0].slot
    assert slot == slots[2] and nxt.cached_tokens == 12, "beside the running, entry2's slot (older than entry5's)"
    assert plan.ops[:2] == [Copy(slot, slots[1], 12), Copy(0, slot, 12)], "entry2 kept over entry1, then the copy"


def test_running_slots_stay_in_few_runs_under_random_traffic():
    """Whenever a resting slot neighbours a running one, a new sequence takes such a slot: placement never
    opens a gap that a neighbour could have closed. Checked against the fake runner's book of cells."""
    rng = random.Random(11)
    runner = FakeRunner(num_slots=8, max_step_tokens=64, context_window=200)
    s = Recording(8, 200, 64)
    systems = [[20 + k] * rng.randint(8, 40) for k in range(3)]
    placed = 0
    for i in range(400):
        arrive(s, rng, systems, f"r{i}")
        held = {sl.index for sl in s.cache.slots.slots if sl.seq is not None}
        could = bool(held) and any(sl.seq is None and (sl.index - 1 in held or sl.index + 1 in held)
                                   for sl in s.cache.slots.slots)
        run_step(s, token=rng.randint(1, 60), runner=runner)
        new = {sl.index for sl in s.cache.slots.slots if sl.seq is not None} - held
        for slot in new:
            placed += 1
            if could:
                assert slot - 1 in held | new or slot + 1 in held | new, f"step {i}: slot {slot} opened a gap"
        for g in list(s.running):
            for seq in g.live:
                if seq.num_generated >= 1 and rng.random() < 0.2:
                    s.finish(seq)
    assert placed > 50


def test_no_save_or_restore_touches_a_stream_before_its_copy_is_made_under_random_traffic():
    """llama.cpp makes a copy between two streams at its next forward pass, not when asked: a Save of the copy's
    destination before then would keep the cells it held before, and a Restore into either slot would be overwritten
    or copied on. The fake runner refuses both; long shared prompts, n > 1, entries moved aside, spilled and read
    back, random finishes and steps without chunks must never ask for either."""
    rng = random.Random(3)
    runner = FakeRunner(num_slots=4, max_step_tokens=48, context_window=400)
    s = Recording(4, 400, 48, spill=SpillStore("fake", 1 << 26))
    systems = [[20 + k] * rng.randint(70, 140) for k in range(5)]
    restored = 0
    for i in range(600):
        if rng.random() < 0.35:
            prompt = [*rng.choice(systems), *[rng.randint(1, 60) for _ in range(rng.randint(1, 12))]]
            ask(s, f"r{i}", prompt, max_tokens=rng.choice([1, 3, 8]), n=rng.choice([1, 1, 2]))
        run_step(s, token=rng.randint(1, 60), runner=runner)
        for g in list(s.running):
            for seq in g.live:
                if seq.num_generated >= 1 and rng.random() < 0.3:
                    s.finish(seq)
        restored = s.cache.spill.restored if s.cache.spill else 0
    assert restored > 0, "entries were spilled and read back"


# -- the PrefixCache on its own: its answers, the operations it queues, its counts ------------------------------
def group(rid: str, prompt, scope: str = "", **kw) -> SequenceGroup:
    return SequenceGroup(rid, tuple(prompt), SamplingParams(max_tokens=4, **kw), scope=scope)


def placed(c: PrefixCache, g: SequenceGroup) -> tuple[int, int]:
    """The cache places the group's first sequence and it takes the slot (as the scheduler's _admit does)."""
    slot, reuse = c.place(g, g.seqs[0].token_ids)
    c.take(slot, g.seqs[0])
    return slot, reuse


def test_the_cache_places_a_new_prompt_in_an_empty_slot_with_nothing_to_do():
    c = PrefixCache(2)
    assert placed(c, group("a", range(1, 11))) == (0, 0) and c.take_ops(False) == []
    assert c.free_slots == 1 and (c.cache_hits, c.cached_tokens) == (0, 0)


def test_a_released_slot_keeps_what_its_sequence_computed_and_the_next_turn_starts_there():
    c = PrefixCache(2)
    first = group("a", range(1, 21))
    slot, _ = placed(c, first)
    c.release(slot, list(range(1, 21)), pin_seconds=0.0)
    assert c.take_ops(True) == [Keep(slot, 20)] and c.cached_cells == 20 and c.free_slots == 2
    assert placed(c, group("b", [*range(1, 21), 99])) == (slot, 20)
    assert c.take_ops(True) == [Keep(slot, 20)], "the entry trimmed to what the new prompt reuses"
    assert (c.cache_hits, c.cached_tokens, c.resumed_tokens) == (1, 20, 0)


def test_a_preempted_request_counts_as_resumed_not_as_a_hit():
    c = PrefixCache(1)
    slot, _ = placed(c, group("a", range(1, 21)))
    c.release(slot, list(range(1, 31)))
    again = group("a", range(1, 21))
    again.seqs[0].token_ids = list(range(1, 32))
    again.preempted = 1
    assert placed(c, again) == (slot, 30)
    assert (c.cache_hits, c.cached_tokens, c.resumed_tokens) == (0, 0, 30)


def test_with_the_cache_off_a_released_slot_is_emptied_and_nothing_is_read():
    c = PrefixCache(1, enabled=False, spill=SpillStore("fp", 1 << 20))
    assert c.spill is None, "no spill store without a cache"
    slot, _ = placed(c, group("a", range(1, 21)))
    c.release(slot, list(range(1, 21)))
    assert c.take_ops(True) == [Clear(slot)] and c.cached_cells == 0
    assert placed(c, group("b", range(1, 25))) == (slot, 0) and not c.reads(group("c", [1]))


def test_a_prompt_logprobs_request_reads_everything():
    c = PrefixCache(2)
    slot, _ = placed(c, group("a", range(1, 21)))
    c.release(slot, list(range(1, 21)))
    echo = group("b", range(1, 25), prompt_logprobs=0)
    assert not c.reads(echo) and placed(c, echo)[1] == 0


def test_a_copy_is_pending_until_a_plan_with_chunks_is_read():
    c = PrefixCache(3)
    c.copy(0, 1, 5)
    c.trim(2, 3)
    assert c.copies_pending == {1}
    assert c.take_ops(False) == [Copy(0, 1, 5), Keep(2, 3)] and c.copies_pending == {1}, "no pass made it yet"
    assert c.ops == [] and c.take_ops(True) == [] and c.copies_pending == frozenset()


def test_a_sibling_gets_a_spare_slot_emptied():
    c = PrefixCache(3)
    slot, _ = placed(c, group("a", range(1, 11)))
    c.release(slot, list(range(1, 11)))
    c.take_ops(True)
    g = group("b", range(50, 60), n=3)
    first, _ = placed(c, g)
    spares = []
    for seq in g.seqs[1:]:
        spares.append(c.spare(g.adapters))
        c.take(spares[-1], seq)
    assert len({first, *spares}) == 3 and c.free_slots == 0
    assert Clear(slot) in c.take_ops(True), "the slot that held an entry is emptied for its new sequence"


def test_a_spilled_entry_comes_back_and_a_refused_restore_drops_it_and_takes_the_hit_back():
    c = PrefixCache(1, spill=SpillStore("fp", 1 << 20))
    system = list(range(100, 180))
    slot, _ = placed(c, group("a", system))
    c.release(slot, system)
    placed(c, group("b", range(1, 9)))  # the entry's slot is taken: its cells are saved first
    ops = c.take_ops(True)
    assert [type(op) for op in ops] == [Keep, Save, Clear]
    ops[1].into.data = b"state"  # the runner fills the Save
    c.settle()
    c.release(slot, list(range(1, 9)))
    c.take_ops(True)
    g = group("c", [*system, 1, 2])
    assert placed(c, g) == (slot, 80)
    assert c.take_ops(True) == [Restore(slot, b"state", 80), Keep(slot, 80)]
    assert (c.stats().cache_hits, c.stats().spill_restored, c.stats().spill_entries) == (1, 1, 1)
    c.restore_failed(frozenset({slot}), [80])
    stats = c.stats()
    assert (stats.cache_hits, stats.cached_tokens, stats.spill_restore_failures, stats.spill_entries) == (0, 0, 1, 0)


def test_a_request_waits_for_a_long_prefix_another_is_reading_of_its_scope_only():
    c = PrefixCache(2)
    system = list(range(1, 101))
    reader = group("a", [*system, 7])
    placed(c, reader)
    assert c.awaits(group("b", [*system, 8]), [reader]), "100 shared tokens not read yet"
    assert not c.awaits(group("c", [*system, 8], scope="other"), [reader])
    assert not c.awaits(group("d", [*system[:40], 8]), [reader]), "too few shared tokens to wait for"


def test_the_stats_name_what_the_cache_holds():
    c = PrefixCache(3, spill=SpillStore("fp", 1 << 20))
    slot, _ = placed(c, group("a", range(1, 13)))
    c.release(slot, list(range(1, 13)))
    assert c.stats() == CacheStats(kv_cells_cached=12, free_slots=3, cache_hits=0, cached_tokens=0, resumed_tokens=0)


def test_persisting_writes_each_resting_entry_but_not_one_a_copy_has_not_made(tmp_path):
    c = PrefixCache(3, spill=SpillStore("fp", 1 << 20, tmp_path, 1 << 20))
    for rid, base in (("a", 100), ("b", 300)):
        slot, _ = placed(c, group(rid, range(base, base + 70)))
        c.release(slot, list(range(base, base + 70)))
    c.copy(0, 2, 70)  # not made yet: slot 2 does not hold what its record says
    c.slots.release(c.slots.slots[2], list(range(500, 570)))
    saved = []
    c.persist(lambda slot: saved.append(slot) or f"state{slot}".encode())
    assert saved == [0, 1] and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
