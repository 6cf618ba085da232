"""The scheduler is pure data: these tests drive it by hand, with no model."""

from __future__ import annotations

import pytest

from servelm.engine.pacing import FLOOR, MIN_STEPS, StepPacer
from servelm.engine.plan import LOGITS_ROWS, Clear, Copy, Keep, StepPlan
from servelm.engine.scheduler import CATCH_UP_TOKENS
from servelm.engine.sequence import SeqStatus, SequenceGroup
from servelm.engine.types import SamplingParams, Tenant
from tests.engine.steps import Recording


def group(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 8) -> SequenceGroup:
    return SequenceGroup(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, n=n))


def sched(**kw) -> Recording:
    """A scheduler whose slots keep no cache (the prefix cache's own tests are in test_prefix_cache.py)."""
    kw.setdefault("context_window", 512)
    kw.setdefault("prefix_cache", False)
    return Recording(**kw)


def run_step(s: Recording, token: int = 7):
    """Schedule one step and pretend the model sampled `token` for every sampler."""
    plan = s.schedule()
    sampled = {seq: token for c in plan.chunks for seq in c.samplers}
    s.record(plan, sampled)
    return plan


def test_admits_up_to_the_slots_and_queues_the_rest():
    s = sched(num_slots=2, max_step_tokens=100)
    for i in range(3):
        s.add(group(f"r{i}", 5))
    plan = run_step(s)
    assert {s.group(c).request_id for c in plan.chunks} == {"r0", "r1"}
    assert s.num_waiting == 1 and s.num_running_seqs == 2
    s.finish(s.running[0].seqs[0])
    plan = run_step(s)
    assert "r2" in {s.group(c).request_id for c in plan.chunks}
    assert isinstance(plan.ops[0], Clear), "the finished sequence's stream is emptied before the next forward pass"


def test_decode_tokens_come_first_and_prompts_are_chunked_under_the_budget():
    s = sched(num_slots=4, max_step_tokens=16)
    s.add(group("short", 4))
    run_step(s)  # the short prompt is read and its first token sampled
    s.add(group("long", 40))
    plans = [run_step(s) for _ in range(3)]
    for plan in plans:
        assert plan.num_tokens <= 16
        kinds = [(s.group(c).request_id, len(c.tokens)) for c in plan.chunks]
        assert kinds[0] == ("short", 1), "the decoding sequence keeps getting its token every step"
    long_chunks = [len(c.tokens) for p in plans for c in p.chunks if s.group(c).request_id == "long"]
    assert long_chunks == [15, 15, 10]
    last = [c for c in plans[2].chunks if s.group(c).request_id == "long"][0]
    assert last.wants_logits and not [c for c in plans[0].chunks if s.group(c).request_id == "long"][0].wants_logits


def test_a_plans_chunks_are_in_slot_order_when_a_later_request_takes_an_earlier_slot():
    """The runner lays a call out slot by slot: in slot order, a step of one call makes its logits rows in the plan's
    order, and the sampler reads them where llama.cpp left them instead of a copy of every row."""
    s = sched(num_slots=3, max_step_tokens=100)
    for i in range(3):
        s.add(group(f"r{i}", 5))
    run_step(s)
    first = s.running[0]
    freed = first.seqs[0].slot
    s.finish(first.seqs[0])
    s.add(group("late", 5))
    run_step(s)  # the late request reads its prompt in the slot r0 left
    plan = run_step(s)
    slots = [c.slot for c in plan.chunks]
    assert len(slots) == 3 and slots == sorted(slots)
    assert s.group(plan.chunks[slots.index(freed)]).request_id == "late"
    assert [len(c.tokens) for c in plan.chunks] == [1, 1, 1], "every sequence decodes"


def test_a_sequence_reads_at_most_max_rows_a_step():
    s = sched(num_slots=2, max_step_tokens=256, max_rows=63)
    s.add(group("a", 200))
    s.add(group("b", 100))
    plan = run_step(s)
    assert [len(c.tokens) for c in plan.chunks] == [63, 63]


def test_positions_and_previous_tokens_follow_the_computed_tokens():
    s = sched(num_slots=1, max_step_tokens=4)
    g = group("a", 6)
    s.add(g)
    chunks = [run_step(s).chunks[0] for _ in range(4)]
    assert [c.start for c in chunks] == [0, 4, 6, 7]
    assert [c.prev_token for c in chunks] == [None, 4, 6, 7], "the token just before each chunk"
    assert all(c.slot == g.seqs[0].slot for c in chunks)


def test_n_choices_prefill_once_then_copy_the_prompt_cells():
    s = sched(num_slots=4, max_step_tokens=64)
    g = group("n3", 10, n=3)
    s.add(g)
    plan = s.schedule()
    assert len(plan.chunks) == 1 and len(plan.chunks[0].tokens) == 10
    assert [s.seq(x).index for x in plan.chunks[0].samplers] == [0, 1, 2]
    s.record(plan, {seq: 20 + s.seq(seq).index for seq in plan.chunks[0].samplers})
    assert [seq.token_ids[-1] for seq in g.seqs] == [20, 21, 22]
    plan = s.schedule()
    parent = g.seqs[0].slot
    assert plan.ops == [Copy(parent, seq.slot, 10) for seq in g.seqs[1:]], "the prompt was read once, then copied"
    assert [(c.start, c.tokens) for c in plan.chunks] == [(10, (20,)), (10, (21,)), (10, (22,))]


def test_finishing_frees_the_slot():
    s = sched(num_slots=2, max_step_tokens=64)
    g = group("a", 5)
    s.add(g)
    run_step(s)
    run_step(s)
    assert s.kv_cells_used == 6
    slot = g.seqs[0].slot
    s.finish(g.seqs[0])
    assert s.kv_cells_used == 0 and s.cache.free_slots == 2 and not s.running
    assert s.schedule().ops == [Clear(slot)]


def test_abort_of_a_waiting_and_of_a_running_request():
    s = sched(num_slots=1, max_step_tokens=64)
    s.add(group("run", 3))
    s.add(group("wait", 3))
    run_step(s)
    assert s.abort("wait") is not None and s.num_waiting == 0
    s.abort("run")
    assert not s.running and s.kv_cells_used == 0 and s.has_unfinished(), "its stream is yet to be emptied"
    assert s.schedule().ops == [Clear(0)]
    assert not s.has_unfinished()


def test_nothing_is_preempted_each_sequence_grows_in_its_own_stream():
    s = sched(num_slots=2, max_step_tokens=64, context_window=64)
    a, b = group("a", 30, max_tokens=100), group("b", 30, max_tokens=100)
    s.add(a)
    s.add(b)
    for _ in range(30):
        plan = run_step(s)
        assert not plan.ops
    assert a.seqs[0].num_computed == b.seqs[0].num_computed == 59, "both grow side by side, to the window"


def test_requests_with_more_choices_than_slots_are_refused():
    s = sched(num_slots=2, max_step_tokens=16)
    with pytest.raises(ValueError):
        s.add(group("big", 3, n=3))


def test_rebeam_keeps_a_first_child_in_place_and_copies_cells_for_further_ones():
    s = sched(num_slots=4, max_step_tokens=100)
    g = SequenceGroup("beam", (1, 2, 3, 4), SamplingParams(max_tokens=8, n=1, best_of=3))
    s.add(g)
    run_step(s, token=9)  # the prompt is read once; the other two beams get copies of it
    plan = s.schedule()
    s.record(plan, {})  # beams take no sampled token: rebeam gives each its next one
    assert sum(isinstance(op, Copy) for op in plan.ops) == 2 and len(plan.chunks) == 3
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
    assert plan.ops == [Copy(slots[1], slots[2], computed[1])], "the parent's cells copied over the spare beam's"
    assert sorted(len(c.tokens) for c in plan.chunks) == [1, 1, 1], "each beam decodes only its new token"
    assert [seq.slot for seq in g.seqs] == slots


def test_a_request_needing_more_slots_than_rest_lets_smaller_ones_go_first_while_it_could_not_fit():
    s = sched(num_slots=4, max_step_tokens=100)
    s.add(group("long-a", 5, max_tokens=400))
    s.add(group("long-b", 5, max_tokens=400))
    run_step(s)
    s.add(group("n3", 5, n=3, max_tokens=3))  # needs three slots: two rest
    s.add(group("small", 5, max_tokens=3))
    plan = run_step(s)
    assert "small" in {s.group(c).request_id for c in plan.chunks}, "it could not fit even without the small one"
    assert [g.request_id for g in s.waiting] == ["n3"]


def test_nothing_overtakes_a_head_that_would_fit_without_the_requests_behind_it():
    s = sched(num_slots=4, max_step_tokens=100)
    s.add(group("a", 5, max_tokens=400))
    s.add(group("b", 5, max_tokens=400))
    s.add(group("c", 5, max_tokens=400))
    run_step(s)
    s.add(group("n2", 5, n=2, max_tokens=400))  # needs two slots: one rests
    s.add(group("small", 5, max_tokens=400))  # may go first: n2 could not fit even were it not there
    run_step(s)
    assert [g.request_id for g in s.waiting] == ["n2"]
    s.finish(next(g for g in s.running if g.request_id == "a").seqs[0])  # one rests; with small's, n2 would fit
    s.add(group("later", 5, max_tokens=400))
    run_step(s)
    assert [g.request_id for g in s.waiting] == ["n2", "later"], "later waits: n2 came first and needs that slot"
    s.finish(next(g for g in s.running if g.request_id == "small").seqs[0])
    run_step(s)
    assert "n2" in {g.request_id for g in s.running}


def test_a_finished_sequences_stream_is_trimmed_to_what_it_counted():
    """A request failed in the middle of a step has cells computed that num_computed does not count yet: finishing
    keeps exactly what it counted (or clears the stream)."""
    s = Recording(num_slots=1, context_window=64, max_step_tokens=64)  # prefix cache on
    g = group("a", 10)
    s.add(g)
    s.schedule()  # 10 prompt tokens go into the forward pass...
    s.finish(g.seqs[0])  # ...and the request fails before update() counts them
    assert s.schedule().ops == [Clear(0)]
    g2 = group("b", 10)
    s.add(g2)
    run_step(s)
    s.finish(g2.seqs[0])
    assert s.schedule().ops == [Keep(0, 10)] and s.cache.cached_cells == 10
    assert g2.seqs[0].status is SeqStatus.FINISHED


# -- priorities and preemption ----------------------------------------------------------------------
def ranked(rid: str, prompt_len: int, priority: int, max_tokens: int = 8, received: float = 0.0) -> SequenceGroup:
    g = group(rid, prompt_len, max_tokens=max_tokens)
    g.priority, g.received_at = priority, received
    return g


def test_waiting_requests_run_by_priority_then_first_come_first_served():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=0)
    for rid, prio in (("late-low", 5), ("first-0", 0), ("urgent", -1), ("second-0", 0)):
        s.add(ranked(rid, 4, prio, max_tokens=1))
    order = []
    while s.has_unfinished():
        plan = run_step(s)
        for c in plan.chunks:
            g = s.group(c)
            if g.request_id not in order:
                order.append(g.request_id)
            s.finish(g.seqs[0])
    assert order == ["urgent", "first-0", "second-0", "late-low"]


def test_a_higher_priority_takes_the_slot_of_a_lower_one_which_resumes_where_it_stopped():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=0, prefix_cache=True)
    low = ranked("low", 40, 5, max_tokens=50)
    s.add(low)
    for _ in range(4):
        run_step(s)
    seq = low.seqs[0]
    tokens, computed = list(seq.token_ids), seq.num_computed
    assert computed == 43 and len(tokens) == 44
    s.add(ranked("high", 10, 0, max_tokens=2))
    plan = run_step(s)
    assert [s.group(c).request_id for c in plan.chunks] == ["high"], "the low one waits; the high one reads"
    assert Keep(0, 43) in plan.ops, "the low one's cells stay in the slot as its cache entry"
    assert seq.status is SeqStatus.WAITING and seq.slot is None and seq.token_ids == tokens
    assert s.preemptions == 1 and low.preempted == 1
    s.finish(s.running[0].seqs[0])
    plan = run_step(s)
    (chunk,) = plan.chunks
    assert s.group(chunk).request_id == "low"
    assert chunk.samplers == (seq.key,), "its next token is drawn from the row after all it had"
    assert chunk.start + len(chunk.tokens) == len(tokens), "it goes on from every token it drew"
    assert low.cached_tokens == 0, "its usage reports the cache as its first start found it"


def test_resuming_reads_back_cells_the_spill_kept_or_computes_them_again():
    from servelm.engine.plan import Restore, Save
    from servelm.engine.spill import SpillStore

    s = sched(num_slots=1, max_step_tokens=64, aging_s=0, prefix_cache=True,
              spill=SpillStore("fp", 1 << 20, None, 0))
    low = ranked("low", 90, 5, max_tokens=50)
    s.add(low)
    for _ in range(4):
        run_step(s)
    computed = low.seqs[0].num_computed
    assert computed == 92
    high = SequenceGroup("high", tuple(range(100, 170)), SamplingParams(max_tokens=1))  # nothing in common
    s.add(high)
    plan = run_step(s)
    saved = [op for op in plan.ops if isinstance(op, Save)]
    assert len(saved) == 1 and saved[0].slot == 0, "the high one takes the slot: the low one's cells are saved first"
    saved[0].into.data = b"state"  # what the runner writes into it
    s.finish(s.running[0].seqs[0])
    plan = run_step(s)
    restores = [op for op in plan.ops if isinstance(op, Restore)]
    assert restores and restores[0].n == computed, "its cells come back from host RAM"
    assert s.cache.resumed_tokens == computed and [len(c.tokens) for c in plan.chunks] == [1]


def test_nothing_is_preempted_for_an_equal_or_lower_priority():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=0)
    s.add(ranked("first", 5, 0, max_tokens=20))
    run_step(s)
    s.add(ranked("same", 5, 0))
    s.add(ranked("lower", 5, 3))
    for _ in range(3):
        plan = run_step(s)
        assert [s.group(c).request_id for c in plan.chunks] == ["first"]
    assert s.preemptions == 0


def test_aging_lets_a_low_priority_that_waited_long_enough_go_first():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=10)
    s.add(ranked("old-low", 5, 3, max_tokens=1, received=0.0))  # waited 40 s more: four levels
    s.add(ranked("new-high", 5, 0, max_tokens=1, received=40.0))
    plan = run_step(s)
    assert [s.group(c).request_id for c in plan.chunks] == ["old-low"]
    s.add(ranked("newer-high", 5, 0, max_tokens=5, received=45.0))
    assert s.preemptions == 0


def test_a_running_low_priority_is_not_preempted_once_its_age_outranks_the_newcomer():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=10)
    s.add(ranked("low", 5, 2, max_tokens=20, received=0.0))
    run_step(s)
    s.add(ranked("high", 5, 0, received=30.0))  # 2 - 0 < 0 - 3: the low one ranks above it by now
    plan = run_step(s)
    assert [s.group(c).request_id for c in plan.chunks] == ["low"] and s.preemptions == 0


def test_only_a_single_plain_sequence_is_preempted():
    s = sched(num_slots=2, max_step_tokens=64, aging_s=0)
    many = group("n2", 5, n=2, max_tokens=20)
    many.priority = 5
    s.add(many)
    for _ in range(3):
        run_step(s)
    s.add(ranked("high", 5, 0))
    plan = run_step(s)
    assert "high" not in {s.group(c).request_id for c in plan.chunks}
    assert s.preemptions == 0


def test_preemption_takes_the_worst_ranked_running_request_first():
    s = sched(num_slots=2, max_step_tokens=64, aging_s=0)
    s.add(ranked("mid", 5, 3, max_tokens=20))
    s.add(ranked("worst", 5, 7, max_tokens=20))
    run_step(s)
    s.add(ranked("high", 5, 0, max_tokens=20))
    run_step(s)
    assert {g.request_id for g in s.running} == {"mid", "high"}
    assert [g.request_id for g in s.waiting] == ["worst"]


def test_lower_priorities_hold_back_while_a_more_urgent_prompt_is_read():
    s = sched(num_slots=3, max_step_tokens=64, aging_s=0)
    s.add(ranked("low-a", 5, 5, max_tokens=50))
    s.add(ranked("low-b", 5, 5, max_tokens=50))
    for _ in range(2):
        run_step(s)
    high = SequenceGroup("high", tuple(range(100, 230)), SamplingParams(max_tokens=4))  # 130 tokens: three steps
    s.add(high)
    for _ in range(3):
        plan = run_step(s)
        assert {s.group(c).request_id for c in plan.chunks} == {"high"}, "only the urgent prompt moves"
    plan = run_step(s)
    assert {s.group(c).request_id for c in plan.chunks} == {"high", "low-a", "low-b"}, "then all decode together"
    assert s.preemptions == 0


def test_a_waiting_request_that_cannot_fit_holds_no_one_back():
    s = sched(num_slots=3, max_step_tokens=64, aging_s=0)
    pair = group("pair", 5, n=2, max_tokens=30)  # two sequences: never preempted
    pair.priority = 5
    s.add(pair)
    for _ in range(2):
        run_step(s)
    urgent = group("urgent-pair", 5, n=2, max_tokens=4)  # needs two slots; one rests
    s.add(urgent)
    for _ in range(3):
        plan = run_step(s)
        assert {s.group(c).request_id for c in plan.chunks} == {"pair"}, "the running pair goes on"


def test_sequences_of_one_lora_adapter_gather_in_neighbouring_slots():
    """Issue 36: a pass holds one adapter set and runs of neighbouring slots, so requests on 4 adapters arriving
    interleaved (a0, a1, a2, a3, a0, …) take 4 runs of slots, one pass each a step (placed side by side, 16 passes)."""
    s = sched(num_slots=16, max_step_tokens=256)
    names = [f"a{i % 4}" for i in range(16)]
    for i, name in enumerate(names):
        g = group(f"r{i}", 5)
        g.adapters = ((name, 1.0),)
        s.add(g)
    run_step(s)
    plan = run_step(s)  # every sequence decodes
    assert len(plan.chunks) == 16
    assert len(plan.calls()) == 4
    for call in plan.calls():
        assert len({plan.chunks[i].adapters for i in call}) == 1


def test_base_sequences_still_fill_slots_side_by_side():
    s = sched(num_slots=8, max_step_tokens=256)
    for i in range(8):
        s.add(group(f"r{i}", 5))
    run_step(s)
    assert len(run_step(s).calls()) == 1


def test_a_steps_logits_rows_stay_bounded_whatever_its_token_budget():
    """Every token of a prompt read for its logprobs is a vocabulary-wide logits row (1 MiB each on a 262k
    vocabulary), so a large step budget must not become as many logits rows: past LOGITS_ROWS a step reads no more
    of such prompts, and only the one row a sequence a prompt's end or a decoding step makes."""
    s = sched(num_slots=16, max_step_tokens=2048)
    for i in range(16):
        s.add(SequenceGroup(f"r{i}", tuple(range(1, 101)), SamplingParams(max_tokens=4, prompt_logprobs=0)))
    for _ in range(10):  # 1,600 prompt rows, LOGITS_ROWS a step at most
        plan = run_step(s)
        assert sum(c.num_rows for c in plan.chunks) <= LOGITS_ROWS + 16, [c.num_rows for c in plan.chunks]
    assert all(seq.num_computed > 100 for g in s.running for seq in g.seqs), "every prompt was read, and decodes"


def slow_decoding_pacer() -> StepPacer:
    """A pacer fitted to steps of 5 ms, plus 200 ms a decoding row and 2 ms a prompt token, with a 200 ms
    target: a decoding step may read its floor of prompt."""
    pacer = StepPacer(0.2)
    for i in range(3 * MIN_STEPS):
        d, p = 1 + i % 16, (i * 37) % 200
        pacer.observe(d, 0, 0.005 + 0.2 * d)
        pacer.observe(d, p, 0.005 + 0.2 * d + 0.002 * p)
    assert pacer.prompt_budget(1) == FLOOR
    return pacer


ALICE, BOB = Tenant("key:a", "alice"), Tenant("key:b", "bob")


def decoding_with(arrivals: int, prompt_len: int, decoding: int = 1, budget: int = 2048, tenant: Tenant = BOB,
                  priority: int = 0) -> tuple[Recording, StepPlan]:
    """`decoding` requests of ALICE's decode on a paced scheduler when `arrivals` requests of `prompt_len` tokens
    arrive from `tenant`: the scheduler and the plan of the step after they arrive."""
    s = sched(num_slots=16, max_step_tokens=budget, pacer=slow_decoding_pacer())
    for i in range(decoding):
        s.add(SequenceGroup(f"d{i}", tuple(range(1, 11)), SamplingParams(max_tokens=64), tenant=ALICE))
    run_step(s)
    for i in range(arrivals):
        s.add(SequenceGroup(f"a{i}", tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), tenant=tenant,
                            priority=priority))
    return s, run_step(s)


def test_another_keys_burst_of_short_prompts_beside_a_decoding_stream_is_read_within_the_pacers_budget():
    """Another key's requests, however many and however short: a step that decodes reads no more of them than the
    pacer allows (here its floor), so the decoding stream's next token stays within the target; it gets its token
    every step until all are read (they were read in one step, and a neighbour's stream waited 7 s)."""
    s, plan = decoding_with(arrivals=6, prompt_len=40)
    steps = [plan]
    while any(seq.reads_prompt for g in s.running for seq in g.seqs) or s.waiting:
        steps.append(run_step(s))
        assert len(steps) < 100
    for step in steps:
        assert step.decode_tokens >= 1 and step.num_tokens - step.decode_tokens <= FLOOR
        assert any(s.group(c).request_id == "d0" and len(c.tokens) == 1 for c in step.chunks), "d0 decodes each step"


def test_one_keys_own_burst_that_outnumbers_its_decoding_is_read_at_once_then_decodes_together():
    """Requests one key sends together reach the engine a moment apart: the first decodes while the rest arrive.
    With nobody else's work there, the short prompts that outnumber its decoding and fit the step's budget are read in
    one step, and decode together from the next: one step a token for all of them (paced, 13% fewer tokens a second
    at 16 streams)."""
    s, plan = decoding_with(arrivals=6, prompt_len=40, tenant=ALICE)
    assert plan.decode_tokens == 1 and plan.num_tokens == 1 + 6 * 40, "every arrival read whole beside the decoding"
    after = run_step(s)
    assert after.decode_tokens == after.num_tokens == 7, "from then on all seven decode in each step"


def _cached_questions(tenant: Tenant) -> tuple[Recording, list[StepPlan]]:
    """Questions past a long system prompt the cache holds, arriving beside ALICE's decoding stream."""
    system = tuple(range(1000, 1600))
    s = sched(num_slots=16, max_step_tokens=2048, pacer=slow_decoding_pacer(), prefix_cache=True, context_window=1024)
    first = SequenceGroup("first", system + (1,) * 20, SamplingParams(max_tokens=1), tenant=tenant)
    s.add(first)
    while first.seqs[0].num_pending > 1:
        run_step(s)
    s.finish(first.seqs[0])  # its cells rest in its slot, the system prompt's among them
    s.add(SequenceGroup("decoding", tuple(range(1, 11)), SamplingParams(max_tokens=64), tenant=ALICE))
    run_step(s)
    for i in range(3):
        s.add(SequenceGroup(f"q{i}", system + (2 + i,) * 20, SamplingParams(max_tokens=8), tenant=tenant))
    return s, [run_step(s) for _ in range(3 * 20 // FLOOR + 2)]


def test_another_keys_questions_after_its_cached_system_prompt_are_read_within_the_pacers_budget():
    s, plans = _cached_questions(BOB)
    read = []
    for plan in plans:
        assert plan.decode_tokens >= 1 and plan.num_tokens - plan.decode_tokens <= FLOOR
        read += [c for c in plan.chunks if s.group(c).request_id.startswith("q") and c.start < 620]
    assert sum(len(c.tokens) for c in read) == 3 * 20 and min(c.start for c in read) == 600, "past the cached prompt"


def test_one_keys_own_questions_after_its_cached_system_prompt_count_only_what_is_left_to_read():
    """Each has a few tokens left to read past the cached cells, not its whole prompt, so they are read at once (counted
    whole, 3 x 620 tokens would be long prompts)."""
    s, plans = _cached_questions(ALICE)
    plan = plans[0]
    assert plan.decode_tokens == 1 and plan.num_tokens == 1 + 3 * 20, "every question read whole beside the decoding"
    assert all(c.start == 600 for c in plan.chunks if len(c.tokens) > 1), "past the cached system prompt"


@pytest.mark.parametrize("why, kw", [
    ("another key's short prompts outnumbering the decoding stream", dict(arrivals=6, prompt_len=40)),
    ("the key's own batch lines (a priority above 0 yields)", dict(arrivals=6, prompt_len=40, tenant=ALICE,
                                                                    priority=10)),
    ("too many tokens for the step's budget", dict(arrivals=6, prompt_len=40, budget=200, tenant=ALICE)),
    ("no more readers than decoding streams", dict(arrivals=3, prompt_len=40, decoding=3, tenant=ALICE)),
    ("a long prompt", dict(arrivals=2, prompt_len=400, budget=512, tenant=ALICE)),
    ("prompts longer than CATCH_UP_TOKENS on average", dict(arrivals=3, prompt_len=CATCH_UP_TOKENS + 30,
                                                           tenant=ALICE)),
    ("another key's longer prompts", dict(arrivals=3, prompt_len=286)),
])
def test_otherwise_the_pacer_keeps_the_decoding_streams_next_token_within_its_target(why, kw):
    s, plan = decoding_with(**kw)
    read = plan.num_tokens - plan.decode_tokens
    assert plan.decode_tokens and 0 < read <= FLOOR, (why, read)
