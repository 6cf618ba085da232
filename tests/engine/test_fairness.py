"""Fair share between tenants (engine/fairness.py), driven through the scheduler by hand: who takes a free slot."""

from __future__ import annotations

import pytest

from servelm.engine.fairness import MAX_LABELS, OTHER, FairShare
from servelm.engine.pacing import MIN_STEPS, StepPacer
from servelm.engine.sequence import SequenceGroup
from servelm.engine.types import SamplingParams, Tenant
from tests.engine.steps import Recording

A, B, C = Tenant("key:a", "alice"), Tenant("key:b", "bob"), Tenant("key:c", "carol")


def group(rid: str, tenant: Tenant, prompt_len: int = 8, max_tokens: int = 4, priority: int = 0,
          received: float | None = None, n: int = 1) -> SequenceGroup:
    g = SequenceGroup(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, n=n), tenant=tenant,
                      priority=priority)
    if received is not None:
        g.received_at = received
    return g


def sched(slots: int = 4, **kw) -> Recording:
    kw.setdefault("context_window", 256)
    kw.setdefault("prefix_cache", False)
    kw.setdefault("max_step_tokens", 256)
    return Recording(slots, **kw)


def step(s: Recording) -> set[str]:
    """One step, every sampler drawing a token, then every sequence that has drawn its max_tokens finished: the ids
    of the requests read or decoded."""
    plan = s.schedule()
    s.record(plan, {seq: 7 for c in plan.chunks for seq in c.samplers})
    for g in list(s.running):
        for seq in g.live:
            if seq.num_generated >= g.params.max_tokens:
                s.finish(seq)
    return {s.group(c).request_id for c in plan.chunks}


def admitted_order(s: Recording, steps: int = 400) -> list[str]:
    """Request ids in the order they first took a slot, until nothing is left."""
    seen: list[str] = []
    for _ in range(steps):
        for g in s.running:
            if g.request_id not in seen:
                seen.append(g.request_id)
        if not s.has_unfinished():
            break
        step(s)
        for g in s.running:
            if g.request_id not in seen:
                seen.append(g.request_id)
    return seen


def test_a_lone_request_of_another_tenant_takes_the_next_free_slot_beside_a_flood():
    """Tenant A's 32 requests arrive at once and fill the 4 slots; tenant B's one request arrives a step later.
    First come, first served it would wait for all 32; here it takes the first slot that frees."""
    s = sched(slots=4)
    for i in range(32):
        s.add(group(f"a{i}", A, received=0.0))
    step(s)
    s.add(group("b", B, received=1.0))
    order = admitted_order(s)
    assert order.index("b") == 4, order[:8]
    assert sorted(order) == sorted([f"a{i}" for i in range(32)] + ["b"]), "everyone is served"


def test_without_fair_share_the_same_flood_is_served_first_come_first_served():
    s = sched(slots=4, fair_share=False)
    for i in range(32):
        s.add(group(f"a{i}", A, received=0.0))
    step(s)
    s.add(group("b", B, received=1.0))
    assert admitted_order(s)[-1] == "b"


def test_two_floods_take_turns_and_a_weight_of_two_gets_about_twice_the_tokens():
    """Both tenants flood; while both have work waiting, B (weight 2) is computed about twice A's tokens."""
    heavy = Tenant("key:b", "bob", weight=2.0)
    s = sched(slots=4)
    for i in range(60):
        s.add(group(f"a{i}", A, max_tokens=6, received=0.0))
        s.add(group(f"b{i}", heavy, max_tokens=6, received=0.0))
    for _ in range(60):  # both keep work waiting throughout
        step(s)
    assert sum(g.tenant is A for g in s.waiting) and sum(g.tenant is heavy for g in s.waiting)
    tokens = {t.label: t.tokens for t in s.share.stats(s.running, s.waiting)}
    assert 1.6 <= tokens["bob"] / tokens["alice"] <= 2.4, tokens


def test_a_cap_on_a_tenants_share_keeps_its_slots_below_it_even_with_slots_free():
    capped = Tenant("key:a", "alice", max_share=0.5)
    s = sched(slots=4)
    for i in range(8):
        s.add(group(f"a{i}", capped))
    for _ in range(30):
        step(s)
        held = sum(1 for g in s.running for q in g.seqs if q.holds_slot)
        assert held <= 2
    assert s.has_unfinished() is False or s.waiting, "it still runs, two at a time"


def test_a_request_of_more_choices_than_its_cap_runs_while_its_tenant_holds_no_slot():
    capped = Tenant("key:a", "alice", max_share=0.25)  # one slot of 4
    s = sched(slots=4)
    s.add(group("wide", capped, n=3))
    assert "wide" in step(s)


def test_priorities_still_order_work_across_tenants():
    """B is served least, but its request's priority is 1: A's priority-0 requests go first."""
    s = sched(slots=1)
    s.add(group("a0", A, received=0.0))
    step(s)  # a0 takes the slot
    for i in range(1, 4):
        s.add(group(f"a{i}", A, received=0.0))
    s.add(group("b", B, priority=1, received=0.0))
    assert admitted_order(s).index("b") == 4


def test_fairness_never_puts_a_request_ahead_of_one_received_a_level_of_aging_before_it():
    """Aging's one level (aging_s) is as far as fairness reorders: A's request received more than that before B's
    goes first, however little B got."""
    s = sched(slots=1, aging_s=10.0)
    s.add(group("a0", A, received=0.0))
    step(s)
    s.add(group("a-old", A, received=0.0))
    s.add(group("b-late", B, received=11.0))  # received past one level after a-old
    s.add(group("b-soon", B, received=5.0))  # within it
    order = admitted_order(s)
    assert order.index("b-soon") < order.index("a-old") < order.index("b-late"), order


def test_a_tenant_that_comes_back_starts_level_with_the_least_served_not_with_its_old_account():
    share = FairShare(4)
    g = group("a0", A)
    share.joined(g)
    share.charge(g, 10_000)
    share.left(g)
    assert not share._accounts, "a tenant with no work is forgotten"
    b = group("b0", B)
    share.joined(b)
    share.charge(b, 50)
    again = group("a1", A)
    share.joined(again)
    assert share._accounts["key:a"].served == pytest.approx(50), "level with B, neither its 10,000 nor nothing"


def test_the_report_names_at_most_max_labels_tenants_and_counts_the_rest_together():
    share = FairShare(4)
    for i in range(MAX_LABELS + 10):
        g = group(f"r{i}", Tenant(f"addr:10.0.0.{i}", f"addr:10.0.0.{i}"))
        share.joined(g)
        share.charge(g, 3)
        share.left(g)
    stats = share.stats([], [])
    assert len(stats) == MAX_LABELS + 1
    assert {t.label: t.tokens for t in stats}[OTHER] == 30


def test_a_tenants_waiting_requests_and_slots_are_reported():
    s = sched(slots=2)
    for i in range(3):
        s.add(group(f"a{i}", A))
    s.add(group("b", B))
    step(s)
    stats = {t.label: t for t in s.share.stats(s.running, s.waiting)}
    assert stats["alice"].slots + stats["bob"].slots == 2
    assert stats["alice"].waiting + stats["bob"].waiting == 2
    assert stats["alice"].tokens > 0


# -- work that yields: a priority above 0 keeps every step within the target -------------------------------------
def paced(target_s: float = 0.1, step_s: float = 0.005, row_s: float = 0.02, token_s: float = 0.002) -> StepPacer:
    """A pacer fitted to steps of `step_s`, plus `row_s` a decoding row and `token_s` a prompt token."""
    pacer = StepPacer(target_s)
    for i in range(3 * MIN_STEPS):
        d, p = 1 + i % 8, (i * 37) % 200
        pacer.observe(d, 0, step_s + row_s * d)
        pacer.observe(d, p, step_s + row_s * d + token_s * p)
    return pacer


def test_batch_rows_fill_a_step_only_up_to_the_target_beside_interactive_ones_and_take_turns():
    """Two interactive streams and six batch lines decode; the target holds four rows: each step carries both
    interactive rows and two batch rows, and every batch line gets its row within three steps."""
    s = sched(slots=8, pacer=paced(), max_step_tokens=256)
    assert s.pacer.rows_within() == 4
    for i in range(2):
        s.add(group(f"i{i}", A, max_tokens=40))
    for i in range(6):
        s.add(group(f"b{i}", B, max_tokens=40, priority=10))
    while any(q.reads_prompt or q.status.name == "WAITING" for g in (*s.running, *s.waiting) for q in g.seqs):
        step(s)
    seen: dict[str, int] = {}
    for n in range(6):
        ids = step(s)
        assert {"i0", "i1"} <= ids and len(ids) == 4, ids
        for rid in ids:
            seen.setdefault(rid, n)
    assert all(f"b{i}" in seen and seen[f"b{i}"] < 3 for i in range(6)), seen


def test_a_batch_line_still_decodes_when_interactive_rows_alone_fill_the_target():
    s = sched(slots=8, pacer=paced(), max_step_tokens=256)
    for i in range(6):
        s.add(group(f"i{i}", A, max_tokens=40))
    s.add(group("b", B, max_tokens=40, priority=10))
    for _ in range(10):
        step(s)
    rows = [step(s) for _ in range(4)]
    assert all("b" in ids for ids in rows), "one row a step for the work that yields"


def test_a_batchs_lines_alone_decode_together_not_one_row_a_step():
    """With no stream of the default priority decoding, the rows of the work that yields are not cut down to what
    the target holds beside others' (a batch alone decoded a few of its 16 lines a step)."""
    s = sched(slots=8, pacer=paced(), max_step_tokens=256)
    for i in range(8):
        s.add(group(f"b{i}", B, max_tokens=40, priority=10))
    for _ in range(30):
        step(s)
    most = s.pacer.rows_within()
    assert most is not None and most < 8, "the pacer's target holds fewer rows than the batch decodes"
    assert all(len(step(s)) == 8 for _ in range(3))


def test_with_nothing_to_decode_one_tenants_burst_is_read_at_once_and_decodes_together():
    """The throughput rule: nobody's next token waits on the step, and nobody else's first token."""
    s = sched(slots=8, pacer=paced(), max_step_tokens=2048, context_window=1024)
    for i in range(4):
        s.add(group(f"p{i}", A, prompt_len=60, max_tokens=40))
    plan = s.schedule()
    assert plan.decode_tokens == 0 and plan.num_tokens == 4 * 60


@pytest.mark.parametrize("why, second", [("another tenant's prompt waits", dict(tenant=B)),
                                         ("work that yields (a batch line)", dict(tenant=A, priority=10))])
def test_with_nothing_to_decode_a_burst_beside_another_tenants_prompt_keeps_within_the_target(why, second):
    """Read at once, three prompts would make the fourth's first token wait for all of them (key B's request beside
    key A's burst waited 15 s): the first in the fair order is read first, within the target, then decodes while
    the rest go on."""
    s = sched(slots=8, pacer=paced(), max_step_tokens=2048, context_window=1024)
    for i in range(3):
        s.add(group(f"p{i}", A, prompt_len=60, max_tokens=40, priority=second.get("priority", 0)))
    s.add(group("other", prompt_len=60, max_tokens=40, **second))
    plan = s.schedule()
    assert plan.decode_tokens == 0 and plan.num_tokens <= s.pacer.prompt_budget(0), why
    assert len({s.group(c).request_id for c in plan.chunks}) == 1, "one prompt at a time: its first token comes first"


def test_speculative_guesses_keep_to_the_rows_the_target_holds():
    """A stream whose guesses hold drafts several a step: never past the rows the target holds (a step of 37
    decoding rows took 436 ms against a 200 ms target)."""
    from servelm.engine.speculate import Drafter, Speculator

    history = tuple(range(1, 40)) + tuple(range(1, 6))  # its prompt-lookup proposes 6, 7, 8, ...
    s = sched(slots=4, pacer=paced(row_s=0.03), speculator=Speculator(1.5))
    most = s.pacer.rows_within()
    assert most == 3
    g = SequenceGroup("spec", history, SamplingParams(max_tokens=40, temperature=0.0), tenant=A)
    s.add(g)
    while g.seqs[0].reads_prompt or g.seqs[0].status.name == "WAITING":
        step(s)
    g.seqs[0].drafter = Drafter(rates=[0.99, 0.99])
    plan = s.schedule()
    assert 1 < plan.decode_tokens <= most, plan.decode_tokens
