"""The prefix cache: several prompts and finished turns kept under spare sequence ids, least recently used
first out, within a cell budget, given back when running requests need the room. Driven by hand (pure data)
and, for the cell counting, against the fake runner, which tracks every cell's identity."""

from __future__ import annotations

import random

from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SequenceGroup
from servelm.engine.types import SamplingParams
from servelm.runners.fake import FakeRunner


def run_step(s: Scheduler, token: int = 7, runner: FakeRunner | None = None):
    plan = s.schedule()
    if runner is not None:
        counted = s.kv_cells_used + plan.num_tokens  # what the scheduler believes the step leaves in use
        runner.step(plan)  # raises on a copy of cells that are not there, or more cells than the cache has
        assert counted >= runner.cells_in_use(), "the scheduler counted fewer cells than the cache holds"
    s.update(plan, {seq: token for c in plan.chunks for seq in c.samplers})
    return plan


def ask(s: Scheduler, rid: str, prompt, max_tokens: int = 2, **kw) -> SequenceGroup:
    g = SequenceGroup(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **kw))
    s.add(g)
    return g


def cache_tokens(s: Scheduler) -> list[tuple[int, ...]]:
    return [e.tokens for e in s.cache.entries]


def test_a_prompt_is_kept_once_read_and_a_later_one_reuses_its_cells():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    first = ask(s, "first", range(1, 21))
    run_step(s)
    (entry,) = s.cache.entries
    second = ask(s, "second", [*range(1, 16), 99, 98])
    plan = run_step(s)
    seq = second.seqs[0]
    keep, reuse = ("cp", first.seqs[0].slot, entry.slot, 20), ("cp", entry.slot, seq.slot, 15)
    assert entry.slot >= 2 and keep in plan.ops and reuse in plan.ops
    assert plan.ops.index(keep) < plan.ops.index(reuse), "kept before the forward pass that reads from it"
    assert [(c.start, c.tokens) for c in plan.chunks if c.seq is seq] == [(15, (99, 98))]
    assert second.cached_tokens == 15 and first.cached_tokens == 0
    assert set(cache_tokens(s)) == {tuple(range(1, 21)), (*range(1, 16), 99, 98)}, "both prompts are kept"
    # counted once: 20 + 1 decoded for the first, the second's 2 own cells, its 15 borrowed ones not again
    assert s.kv_cells_used == 20 + 1 + 2


def test_a_finished_turn_replaces_its_prompt_and_the_next_turn_reuses_prompt_and_answer():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    turn1 = ask(s, "t1", range(1, 21), max_tokens=4)
    for _ in range(3):
        run_step(s, token=50)
    seq = turn1.seqs[0]
    assert seq.token_ids[20:] == [50, 50, 50] and seq.num_computed == 22
    s.finish(seq)
    assert cache_tokens(s) == [(*range(1, 21), 50, 50)], "the turn's computed cells, answer included"
    assert s.kv_cells_used == 22 and s.kv_cells_cached == 22
    turn2 = ask(s, "t2", [*range(1, 21), 50, 50, 50, 60, 61])
    run_step(s)
    assert turn2.cached_tokens == 22


def test_several_prefixes_are_kept_and_each_is_found():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    systems = [[100 + k] * 10 for k in range(3)]
    for k, system in enumerate(systems):
        g = ask(s, f"a{k}", [*system, 1, 2])
        run_step(s)
        s.finish(g.seqs[0])
    for k in (2, 0, 1):
        g = ask(s, f"b{k}", [*systems[k], 3, 4])
        run_step(s)
        assert g.cached_tokens == 10, f"system prompt {k} comes from the cache"
        s.finish(g.seqs[0])


def test_the_least_recently_used_entry_goes_when_no_sequence_id_is_free():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True, prefix_cache_entries=2)
    a = [1] * 10
    b = [2] * 10
    for rid, prompt in (("a", a), ("b", b), ("a2", [*a, 5, 6])):  # a is read again: b is now the older
        g = ask(s, rid, prompt, max_tokens=1)
        run_step(s)
        s.finish(g.seqs[0])
    ask(s, "c", [3] * 10, max_tokens=1)
    plan = run_step(s)
    assert len(s.cache.entries) == 2 and tuple(b) not in cache_tokens(s)
    assert any(op[0] == "rm" and op[1] >= 2 for op in plan.ops), "the evicted entry's id is freed"
    assert any(t[:10] == tuple(a) for t in cache_tokens(s))


def test_entries_stay_within_the_cell_budget():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True, prefix_cache_cells=25)
    for k in range(3):
        g = ask(s, f"r{k}", [10 + k] * 20, max_tokens=1)
        run_step(s)
        s.finish(g.seqs[0])
        assert s.kv_cells_cached <= 25
    assert cache_tokens(s) == [(12,) * 20]
    too_long = ask(s, "long", [9] * 30, max_tokens=1)
    run_step(s)
    s.finish(too_long.seqs[0])
    assert cache_tokens(s) == [(12,) * 20], "a prompt longer than the budget is not kept, and evicts nothing"


def test_the_cache_gives_its_cells_back_when_a_request_needs_them():
    s = Scheduler(num_slots=2, kv_cells=30, max_step_tokens=64, prefix_cache=True)
    a = ask(s, "a", range(1, 16), max_tokens=1)
    run_step(s)
    s.finish(a.seqs[0])
    assert s.kv_cells_used == 15
    b = ask(s, "b", range(50, 70), max_tokens=5)
    plan = run_step(s)
    assert any(op[0] == "rm" and op[1] >= 2 for op in plan.ops) and [c.seq.group for c in plan.chunks] == [b]
    assert s.kv_cells_used <= 30


def test_seeded_and_prompt_logprob_requests_do_not_read_the_cache():
    s = Scheduler(num_slots=3, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    ask(s, "a", range(1, 11), max_tokens=1)
    run_step(s)
    seeded = ask(s, "s", range(1, 11), max_tokens=1, seed=3)
    echoed = ask(s, "e", range(1, 11), max_tokens=1, prompt_logprobs=0)
    plan = run_step(s)
    assert {c.seq.group.request_id: c.start for c in plan.chunks if c.start == 0} == {"s": 0, "e": 0}
    assert seeded.cached_tokens == echoed.cached_tokens == 0


def test_an_identical_prompt_still_computes_its_last_token():
    s = Scheduler(num_slots=2, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    for rid in ("a", "b"):
        g = ask(s, rid, range(1, 11), max_tokens=1)
        plan = run_step(s)
        s.finish(g.seqs[0])
    assert [(c.start, len(c.tokens)) for c in plan.chunks] == [(9, 1)] and plan.chunks[0].wants_logits


def test_cells_are_never_undercounted_under_random_traffic():
    """Conversations over a few shared system prompts, random lengths and finishes, a small cache: the
    fake runner checks every copy and counts distinct cells; the scheduler's count must never be lower."""
    rng = random.Random(7)
    runner = FakeRunner(num_slots=4, kv_cells=160, max_step_tokens=32, spare_seqs=3)
    s = Scheduler(4, 160, 32, prefix_cache=True, prefix_cache_entries=3, prefix_cache_cells=90)
    systems = [[20 + k] * rng.randint(5, 25) for k in range(4)]
    hits = 0
    for i in range(300):
        if rng.random() < 0.3:
            ask(s, f"r{i}", [*rng.choice(systems), *[rng.randint(1, 60) for _ in range(rng.randint(1, 12))]],
                max_tokens=8)
        run_step(s, token=rng.randint(1, 60), runner=runner)
        for g in list(s.running):
            for seq in g.live:
                if seq.num_generated >= 1 and rng.random() < 0.2:
                    s.finish(seq)
        hits += sum(g.cached_tokens > 0 for g in s.running)
    assert hits > 0, "the traffic did reuse cached prefixes"


def test_requests_arriving_together_with_one_long_prefix_read_it_once():
    s = Scheduler(num_slots=4, kv_cells=2000, max_step_tokens=64, prefix_cache=True)
    system = list(range(100, 300))
    groups = [ask(s, f"r{k}", [*system, k + 1, k + 2], max_tokens=4) for k in range(4)]
    read = 0
    for _ in range(12):
        read += sum(len(c.tokens) for c in run_step(s).chunks if c.start < c.seq.prompt_len)
    assert [g.cached_tokens for g in groups] == [0, 200, 200, 200]
    assert read == 202 + 3 * 2, "the shared 200 tokens were read once"


def test_a_request_does_not_wait_for_a_prefix_too_short_to_matter():
    s = Scheduler(num_slots=4, kv_cells=2000, max_step_tokens=256, prefix_cache=True)
    a = ask(s, "a", [*range(100, 130), *range(1, 100)], max_tokens=4)
    b = ask(s, "b", [*range(100, 130), *range(200, 240)], max_tokens=4)
    plan = run_step(s)
    assert {c.seq.group for c in plan.chunks} == {a, b}, "30 shared tokens are not worth a wait"


def test_entries_are_read_only_within_the_scope_that_wrote_them():
    """Another key's request with the same prompt reads nothing (not even a length it could time); the same
    scope reads the entry; the same prompt under two scopes is kept twice."""
    s = Scheduler(num_slots=3, kv_cells=1000, max_step_tokens=64, prefix_cache=True)
    a = SequenceGroup("a", tuple(range(1, 21)), SamplingParams(max_tokens=1), scope="key-a")
    s.add(a)
    run_step(s)
    other = SequenceGroup("b", tuple(range(1, 25)), SamplingParams(max_tokens=1), scope="key-b")
    same = SequenceGroup("a2", tuple(range(1, 25)), SamplingParams(max_tokens=1), scope="key-a")
    s.add(other)
    s.add(same)
    run_step(s)
    assert other.cached_tokens == 0 and same.cached_tokens == 20
    assert sorted(e.scope for e in s.cache.entries) == ["key-a", "key-b"]


def test_a_request_waits_only_for_a_prompt_of_its_own_scope():
    """Waiting for a shared prompt still being read would tell a second key that the first key sent it."""
    s = Scheduler(num_slots=3, kv_cells=2000, max_step_tokens=64, prefix_cache=True)
    long_prompt = tuple(range(1, 101))
    s.add(SequenceGroup("a", long_prompt, SamplingParams(max_tokens=1), scope="key-a"))
    run_step(s)  # "a" has read 64 of its 100 tokens; the next step reads the rest and has room for more
    stranger = SequenceGroup("b", long_prompt, SamplingParams(max_tokens=1), scope="key-b")
    colleague = SequenceGroup("a2", long_prompt, SamplingParams(max_tokens=1), scope="key-a")
    s.add(stranger)
    s.add(colleague)
    plan = s.schedule()
    started = {c.seq.group.request_id for c in plan.chunks}
    assert "b" in started, "another scope's request is not held back"
    assert "a2" not in started, "the same scope waits to reuse what is being read"
