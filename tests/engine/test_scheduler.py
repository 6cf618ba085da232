"""The scheduler is pure data: these tests drive it by hand, with no model."""

from __future__ import annotations

import pytest

from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SequenceGroup, SeqStatus
from servelm.engine.types import SamplingParams


def group(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 8) -> SequenceGroup:
    return SequenceGroup(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, n=n))


def sched(**kw) -> Scheduler:
    """A scheduler without the prefix cache (the default), for the tests of everything else."""
    return Scheduler(**kw)


def run_step(s: Scheduler, token: int = 7):
    """Schedule one step and pretend the model sampled `token` for every sampler."""
    plan = s.schedule()
    sampled = {seq: token for c in plan.chunks for seq in c.samplers}
    s.update(plan, sampled)
    return plan


def test_admits_up_to_the_slots_and_queues_the_rest():
    s = sched(num_slots=2, kv_cells=1000, max_step_tokens=100)
    for i in range(3):
        s.add(group(f"r{i}", 5))
    plan = run_step(s)
    assert {c.seq.group.request_id for c in plan.chunks} == {"r0", "r1"}
    assert s.num_waiting == 1 and s.num_running_seqs == 2
    s.finish(s.running[0].seqs[0])
    plan = run_step(s)
    assert "r2" in {c.seq.group.request_id for c in plan.chunks}
    assert plan.frees, "the finished sequence's slot is freed before the next forward pass"


def test_decode_tokens_come_first_and_prompts_are_chunked_under_the_budget():
    s = sched(num_slots=4, kv_cells=1000, max_step_tokens=16)
    s.add(group("short", 4))
    run_step(s)  # the short prompt is read and its first token sampled
    s.add(group("long", 40))
    plans = [run_step(s) for _ in range(3)]
    for plan in plans:
        assert plan.num_tokens <= 16
        kinds = [(c.seq.group.request_id, len(c.tokens)) for c in plan.chunks]
        assert kinds[0] == ("short", 1), "the decoding sequence keeps getting its token every step"
    long_chunks = [len(c.tokens) for p in plans for c in p.chunks if c.seq.group.request_id == "long"]
    assert long_chunks == [15, 15, 10]
    last = [c for c in plans[2].chunks if c.seq.group.request_id == "long"][0]
    assert last.wants_logits and not [c for c in plans[0].chunks if c.seq.group.request_id == "long"][0].wants_logits


def test_positions_follow_the_computed_tokens():
    s = sched(num_slots=1, kv_cells=1000, max_step_tokens=4)
    s.add(group("a", 6))
    starts = [run_step(s).chunks[0].start for _ in range(4)]
    assert starts == [0, 4, 6, 7]


def test_n_choices_prefill_once_then_fork_the_prompt_cells():
    s = sched(num_slots=4, kv_cells=1000, max_step_tokens=64)
    g = group("n3", 10, n=3)
    s.add(g)
    plan = s.schedule()
    assert len(plan.chunks) == 1 and len(plan.chunks[0].tokens) == 10
    assert [x.index for x in plan.chunks[0].samplers] == [0, 1, 2]
    s.update(plan, {seq: 20 + seq.index for seq in plan.chunks[0].samplers})
    assert [seq.token_ids[-1] for seq in g.seqs] == [20, 21, 22]
    assert s.kv_cells_used == 10, "the prompt's cells count once"
    plan = s.schedule()
    parent_slot = g.seqs[0].slot
    assert sorted(plan.forks) == sorted((parent_slot, seq.slot, 10) for seq in g.seqs[1:])
    assert [(c.start, c.tokens) for c in plan.chunks] == [(10, (20,)), (10, (21,)), (10, (22,))]


def test_finishing_frees_cells_and_slots():
    s = sched(num_slots=2, kv_cells=1000, max_step_tokens=64)
    g = group("a", 5)
    s.add(g)
    run_step(s)
    run_step(s)
    assert s.kv_cells_used == 6
    s.finish(g.seqs[0])
    assert s.kv_cells_used == 0 and len(s.free_slots) == 2 and not s.running
    plan = s.schedule()
    assert plan.frees == [0] or plan.frees == [1]


def test_abort_of_a_waiting_and_of_a_running_request():
    s = sched(num_slots=1, kv_cells=1000, max_step_tokens=64)
    s.add(group("run", 3))
    s.add(group("wait", 3))
    run_step(s)
    assert s.abort("wait") is not None and s.num_waiting == 0
    s.abort("run")
    assert not s.running and s.kv_cells_used == 0 and not s.has_unfinished() is False
    assert s.schedule().frees
    assert not s.has_unfinished()


def test_a_full_cache_preempts_the_newest_request_which_resumes_later():
    s = sched(num_slots=2, kv_cells=12, max_step_tokens=64)
    a, b = group("a", 4, max_tokens=100), group("b", 4, max_tokens=100)
    s.add(a)
    s.add(b)
    for _ in range(3):
        run_step(s)
    assert s.kv_cells_used <= 12
    # 2 × (4 prompt + growing output) soon exceeds 12 cells: b is preempted, a keeps going
    for _ in range(3):
        run_step(s)
        assert s.kv_cells_used <= 12
    assert b.seqs[0].status is SeqStatus.WAITING and b.seqs[0].num_computed == 0
    assert a.seqs[0].status is SeqStatus.RUNNING
    generated_by_b = list(b.seqs[0].token_ids)
    s.finish(a.seqs[0])
    plan = run_step(s)
    chunk = [c for c in plan.chunks if c.seq is b.seqs[0]][0]
    assert chunk.tokens == tuple(generated_by_b), "b recomputes its prompt and what it had generated"


def test_a_lone_request_that_fills_the_cache_is_cut_off():
    s = sched(num_slots=1, kv_cells=8, max_step_tokens=64)
    g = group("a", 6, max_tokens=100)
    s.add(g)
    finished = []
    for _ in range(5):
        plan = run_step(s)
        finished += plan.out_of_cells
    assert finished == [g.seqs[0]] and g.finished


def test_requests_with_more_choices_than_slots_are_refused():
    s = sched(num_slots=2, kv_cells=100, max_step_tokens=16)
    with pytest.raises(ValueError):
        s.add(group("big", 3, n=3))


def test_steps_stay_small_while_a_seeded_request_is_in_the_system():
    s = sched(num_slots=4, kv_cells=1000, max_step_tokens=100, seeded_step_tokens=20)
    s.add(group("plain", 90))
    assert run_step(s).num_tokens == 90
    seeded = SequenceGroup("seeded", tuple(range(1, 50)), SamplingParams(max_tokens=4, seed=7))
    s.add(seeded)
    s.add(group("plain2", 90))
    sizes = []
    while not seeded.finished:
        plan = run_step(s)
        sizes.append(plan.num_tokens)
        for seq in seeded.seqs:
            if seq.num_generated >= 4:
                s.finish(seq)
    assert max(sizes) <= 20, "every step, the seeded request's and everyone else's, stays under the cap"
    assert run_step(s).num_tokens > 20, "without a seeded request the full budget comes back"


def test_rebeam_keeps_a_first_child_in_place_and_shares_cells_with_further_ones():
    s = sched(num_slots=4, kv_cells=1000, max_step_tokens=100)
    g = SequenceGroup("beam", (1, 2, 3, 4), SamplingParams(max_tokens=8, n=1, best_of=3))
    s.add(g)
    run_step(s, token=9)  # the prompt is read once; the other two beams fork from it
    plan = s.schedule()
    s.update(plan, {})  # beams take no sampled token: rebeam gives each its next one
    assert len(plan.forks) == 2 and len(plan.chunks) == 3
    slots = [seq.slot for seq in g.seqs]
    before = [list(seq.token_ids) for seq in g.seqs]
    computed = [seq.num_computed for seq in g.seqs]
    # new beams: two children of beam 1, one of beam 0; beam 2 leaves no child
    host = s.rebeam(g, [1, 1, 0], [20, 21, 22])
    assert host[0] == 1 and host[2] == 0, "a parent's first child stays in the parent's sequence"
    assert host[1] == 2, "a further child takes the sequence of the beam that left no child"
    assert g.seqs[1].token_ids == before[1] + [20] and g.seqs[2].token_ids == before[1] + [21]
    assert g.seqs[0].token_ids == before[0] + [22]
    plan = s.schedule()
    assert plan.ops == [("rm", slots[2]), ("cp", slots[1], slots[2], computed[1])], "remove, then share the parent's cells"
    assert sorted(len(c.tokens) for c in plan.chunks) == [1, 1, 1], "each beam decodes only its new token"
    assert [seq.slot for seq in g.seqs] == slots


def test_a_request_that_cannot_fit_does_not_hold_back_smaller_ones_behind_it():
    """Found fuzzing the real model: two requests without max_tokens (up to the context window) each wanted most of
    the cache; the newer was preempted back to the head of the queue, and every small request waited behind it for
    the older one to finish (48 s). Now later requests fill the cells the head cannot use anyway."""
    s = sched(num_slots=4, kv_cells=100, max_step_tokens=100)
    s.add(group("giant-a", 50, max_tokens=400))
    s.add(group("giant-b", 40, max_tokens=400))
    run_step(s)
    assert [g.request_id for g in s.running] == ["giant-a", "giant-b"]
    for _ in range(10):  # both grow until the cache is full: the newer giant goes back to wait
        run_step(s)
    assert [g.request_id for g in s.running] == ["giant-a"] and [g.request_id for g in s.waiting] == ["giant-b"]
    s.add(group("small", 5, max_tokens=3))
    plan = run_step(s)
    assert "small" in {c.seq.group.request_id for c in plan.chunks}, "the small one goes ahead of the blocked giant"
    assert [g.request_id for g in s.waiting] == ["giant-b"]


def test_nothing_overtakes_a_head_that_would_fit_without_the_requests_behind_it():
    s = sched(num_slots=8, kv_cells=100, max_step_tokens=200)
    s.add(group("a", 45, max_tokens=400))
    s.add(group("b", 60, max_tokens=400))  # 61 cells: more than a leaves free
    run_step(s)
    s.add(group("s", 35, max_tokens=400))  # overtakes b: b could not fit even without it
    s.add(group("t", 5, max_tokens=400))
    run_step(s)
    assert {g.request_id for g in s.running} == {"a", "s", "t"} and [g.request_id for g in s.waiting] == ["b"]
    s.finish(s.running[0].seqs[0])  # a ends: b would fit, but for s and t, which came after it
    s.add(group("u", 3, max_tokens=400))
    run_step(s)
    assert [g.request_id for g in s.waiting] == ["b", "u"], "u waits: b goes first once s or t ends"
    s.finish(next(g for g in s.running if g.request_id == "s").seqs[0])
    run_step(s)
    assert "b" in {g.request_id for g in s.running}
