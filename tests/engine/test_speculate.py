"""Draft-free speculative decoding: the prompt-lookup drafter, when a draft is worth its rows, and verification in
the engine over the fake runner (which checks every KV operation: a failed guess's cell must be dropped)."""

from __future__ import annotations

import asyncio
import random

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.plan import Keep, ScheduledChunk, SeqKey, StepPlan
from servelm.engine.sequence import SeqStatus, SequenceGroup
from servelm.engine.speculate import PRIOR, Candidate, Drafter, Speculator, _best_draft, expected_kept
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import END_TOKEN, FakeRunner

# -- the drafter ----------------------------------------------------------------------------------


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert Drafter().propose(history, 3) == [7, 8, 2], "the latest 2,3,4 was followed by 7 8"
    assert Drafter().propose(history, 1) == [7]
    assert Drafter().propose([5, 6, 7, 8], 4) == [], "nothing repeats"


def test_a_longer_ngram_wins_over_a_later_shorter_one():
    history = [1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]
    assert Drafter().propose(history, 2) == [10, 11], "1,2,3 matched, not the later lone 2-gram 9,3"


def test_the_index_grows_with_the_history_and_stops_at_an_image():
    d = Drafter()
    history = [1, 2, 3, 4]
    assert d.propose(history, 4) == []
    history += [-7, -7, 6, 1, 2]
    assert d.propose(history, 4) == [3, 4], "the continuation stops before an image's placeholders"
    history += [3, 4, 8]
    assert d.propose(history, 2) == [], "4, 8 never occurred before"


def test_the_rate_falls_on_failed_guesses_and_rises_on_held_ones():
    d = Drafter()
    d.observe(0, rejected=True)
    d.observe(0, rejected=True)
    assert d.rate < PRIOR
    d.observe(5, rejected=False)
    assert d.rate > PRIOR


def test_a_guess_not_drafted_still_teaches_the_rate_by_the_token_that_came():
    """A sequence whose guess was not worth its row learns from it all the same, once its next token is known:
    the rate follows how its guesses would have done, with no row spent on them."""
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4]
    d = Drafter()
    assert d.propose(history, 2) == [5, 9]
    d.shadow(history, [5, 9])
    d.propose([*history, 5], 2)  # the guess held
    held = d.rate
    assert held > PRIOR
    d.shadow([*history, 5], d.propose([*history, 5], 2))
    d.propose([*history, 5, 7], 2)  # it failed
    assert d.rate < held
    before = d.rate
    d.shadow([*history, 5, 7], [1])
    d.propose([*history, 5, 7], 2)  # no token yet: nothing learned
    assert d.rate == before


def test_a_sequence_whose_unspent_guesses_hold_starts_drafting():
    plan, candidates = _decoding(1, HISTORY, 0.2)
    speculator = Speculator(1.5)
    assert speculator.draft(plan, 256, 63, candidates) == 0, "its rate is too low to spend a row"
    history = candidates[0].history
    for token in range(6, 20):  # the tokens come as the lookup guessed, step after step, none of them drafted
        history.append(token)
        plan = StepPlan([ScheduledChunk(plan.chunks[0].seq, 0, len(history) - 1, (token,), samplers=plan.chunks[0].samplers)])
        if speculator.draft(plan, 256, 63, {0: candidates[0]}):
            break
    else:
        pytest.fail("guesses that kept holding never earned a draft")
    assert candidates[0].drafter.rate > 0.4


def test_expected_kept_is_a_geometric_sum():
    assert expected_kept(1.0, 4) == 4
    assert expected_kept(0.5, 2) == pytest.approx(0.75)


def test_the_draft_length_search_stops_early_and_finds_what_trying_every_length_finds():
    """_best_draft stops at the first guess that lowers the step's tokens per row-time; trying every length (the
    definition) must pick the same length and expected tokens, bit for bit."""
    rng = random.Random(7)
    stopped_early = 0
    for _ in range(5000):
        made = float(rng.randint(1, 16))
        cost = made + rng.choice([0.5, 1.5, 3.0, 4.5]) + rng.randint(0, 6)
        first = rng.choice([0.0, 1.0, 2.5, 4.0])
        rate = rng.choice([1.0, 0.999, rng.random(), rng.random() ** 4])
        longest = rng.randint(0, 16)
        best, best_k = made / cost, 0
        for k in range(1, longest + 1):
            value = (made + expected_kept(rate, k)) / (cost + first + k - 1)
            if value > best:
                best, best_k = value, k
        got = _best_draft(made, cost + first - 1, made / cost, rate, longest)
        assert got == (best_k, expected_kept(rate, best_k) if best_k else 0.0), (made, cost, first, rate, longest)
        stopped_early += 0 < best_k < longest
    assert stopped_early > 100, "the cases must include drafts shorter than the longest guess"


# -- the policy -----------------------------------------------------------------------------------


def _decoding(n: int, history: list[int], rate: float, max_tokens: int = 100,
              window: int = 2048) -> tuple[StepPlan, dict[int, Candidate]]:
    """n sequences about to decode the last token of `history` (the one before it was their prompt's last), and
    each one's candidacy for a draft as the scheduler makes it."""
    chunks, candidates = [], {}
    for slot in range(n):
        group = SequenceGroup(f"r{slot}", tuple(history[:-1]), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        seq = group.seqs[0]
        seq.token_ids = list(history)
        seq.status = SeqStatus.RUNNING
        seq.slot, seq.num_computed = slot, len(history) - 1
        seq.drafter = Drafter(rates=[rate, rate])
        chunks.append(ScheduledChunk(seq.key, slot, seq.num_computed, (history[-1],), samplers=(seq.key,)))
        room = min(max_tokens - seq.num_generated - 1, window - seq.num_computed - 1)
        candidates[slot] = Candidate(seq.drafter, seq.token_ids, room)
    return StepPlan(chunks), candidates


HISTORY = list(range(1, 40)) + list(range(1, 6))  # the lookup proposes 6, 7, 8, ...


def test_one_stream_drafts_longer_the_more_its_guesses_hold():
    lengths = []
    for rate in (PRIOR, 0.5, 0.9, 0.99):
        plan, candidates = _decoding(1, HISTORY, rate)
        Speculator(1.5).draft(plan, 256, 63, candidates)
        lengths.append(plan.chunks[0].drafted)
    assert lengths[0] == 0, "a new sequence's guesses are shadows until they hold: not worth a row at one stream"
    assert lengths[1] >= 1 and lengths[1] < lengths[2] < lengths[3]
    assert plan.chunks[0].tokens == (5, *range(6, 6 + lengths[3]))


def test_a_guess_takes_the_place_of_a_lone_rows_reread():
    plan, candidates = _decoding(1, HISTORY, 0.2)
    assert Speculator(1.5, lone_row_from=len(HISTORY)).draft(plan, 256, 63, candidates) == 0, "not yet a lone row"
    plan, candidates = _decoding(1, HISTORY, 0.2)
    assert Speculator(1.5, lone_row_from=len(HISTORY) - 1).draft(plan, 256, 63, candidates) == 1, \
        "a lone row costs two rows: one guess, even a poor one, costs nothing more"
    plan, candidates = _decoding(2, HISTORY, 0.2)
    assert Speculator(1.5, lone_row_from=0).draft(plan, 256, 63, candidates) == 0, "two rows share a call: no re-read"


def test_under_load_a_draft_must_nearly_always_hold():
    plan, candidates = _decoding(16, HISTORY, 0.9)
    assert Speculator(1.5).draft(plan, 256, 63, candidates) == 0, "a guess's rows and split pass cost 16 sequences' step"
    assert len(plan.calls()) == 1
    plan, candidates = _decoding(2, HISTORY, 0.6)
    assert Speculator(1.5).draft(plan, 256, 63, candidates) == 0
    plan, candidates = _decoding(2, HISTORY, 0.99)
    assert Speculator(1.5).draft(plan, 256, 63, candidates) > 0


def test_a_draft_keeps_to_the_budget_the_rows_max_tokens_and_the_window():
    plan, candidates = _decoding(1, HISTORY, 0.999)
    assert Speculator(1.5).draft(plan, 3, 63, candidates) == 3
    plan, candidates = _decoding(1, HISTORY, 0.999)
    Speculator(1.5).draft(plan, 256, 4, candidates)
    assert len(plan.chunks[0].tokens) == 4, "a chunk holds at most max_rows tokens"
    plan, candidates = _decoding(1, HISTORY, 0.999, max_tokens=4)  # one made, three to go: the next and two guesses
    Speculator(1.5).draft(plan, 256, 63, candidates)
    assert plan.chunks[0].drafted == 2, "the draft never reaches past max_tokens"
    plan, candidates = _decoding(1, HISTORY, 0.999, window=len(HISTORY) + 2)
    Speculator(1.5).draft(plan, 256, 63, candidates)
    assert plan.chunks[0].drafted == 2, "nor past the context window"


# -- the engine -----------------------------------------------------------------------------------


async def _run(engine: LocalEngine, rid: str, prompt: list[int], **kw):
    params = SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **kw})
    tokens, last = [], None
    async for out in engine.generate(GenerationRequest(rid, tuple(prompt), params)):
        tokens += out.token_ids
        last = out
    return tokens, last


def _engine(speculative: bool, **kw) -> LocalEngine:
    eng = LocalEngine(FakeRunner(**{"num_slots": 4, "max_step_tokens": 64, **kw}), speculative=speculative)
    eng.start()
    return eng


# The fake model follows t with t + 1. ECHO's lookup guesses right (its tail repeats a run of successors);
# MISLEAD's guesses right until 15, then 30 where the model says 16: a draft that held at first, then failed.
ECHO = list(range(1, 36)) + list(range(1, 6))
MISLEAD = list(range(1, 16)) + [30, 31] + list(range(1, 6))


@pytest.mark.parametrize("prompt", [ECHO, MISLEAD], ids=["guesses-hold", "guesses-fail"])
async def test_greedy_and_seeded_answers_are_the_same_with_and_without_speculation(prompt):
    answers = {}
    for speculative in (False, True):
        eng = _engine(speculative)
        try:
            greedy = await _run(eng, "g", prompt)
            seeded = [await _run(eng, f"s{seed}", prompt, temperature=4.0, seed=seed) for seed in range(12)]
            answers[speculative] = (greedy[0], [s[0] for s in seeded])
            if speculative:
                assert greedy[1].draft_tokens > 0
                runner = eng.runner
                assert any(c.drafted for p in runner.steps for c in p.chunks), "drafts were read"
                if prompt is MISLEAD:
                    assert any(isinstance(op, Keep) for p in runner.steps for op in p.ops), "failed guesses dropped"
        finally:
            eng.stop()
    assert answers[True] == answers[False]


async def test_held_guesses_save_steps_and_are_counted():
    eng = _engine(True)
    try:
        tokens, last = await _run(eng, "e", ECHO, max_tokens=30)
        stats = eng.stats()
    finally:
        eng.stop()
    assert tokens == list(range(6, 36))
    assert last.draft_accepted >= 12 and last.draft_accepted <= last.draft_tokens
    assert stats.draft_tokens == last.draft_tokens and stats.draft_accepted == last.draft_accepted
    assert stats.forward_calls == 30 - last.draft_accepted, "a held guess is a token without a pass of its own"


# its lookup guesses 33 ... 40, 1, 2 where the model ends with EOS after 40: the answer ends inside the draft
ENDS_IN_DRAFT = list(range(30, END_TOKEN + 1)) + [1, 2] + list(range(30, 33))


@pytest.mark.parametrize(("prompt", "kw"), [(ENDS_IN_DRAFT, {}), (ECHO, {"stop_token_ids": (12,)}),
                                            (ECHO, {"max_tokens": 9})], ids=["eos", "stop-token", "length"])
async def test_an_answer_that_ends_inside_a_draft_ends_where_it_would_have(prompt, kw):
    results = []
    for speculative in (False, True):
        eng = _engine(speculative)
        try:
            tokens, last = await _run(eng, "x", prompt, **kw)
            results.append((tokens, last.finish_reason, last.stop_reason, last.completion_tokens))
            assert eng.scheduler.kv_cells_used == 0
        finally:
            eng.stop()
    assert results[0] == results[1]


async def test_seeded_answers_under_load_with_speculation_are_the_answers_alone():
    eng = _engine(True, num_slots=6)
    try:
        alone = [await _run(eng, f"a{i}", ECHO if i % 2 else MISLEAD, temperature=3.0, seed=i) for i in range(6)]
        crowd = await asyncio.gather(*[_run(eng, f"c{i}", ECHO if i % 2 else MISLEAD, temperature=3.0, seed=i)
                                       for i in range(6)])
    finally:
        eng.stop()
    assert [a[0] for a in alone] == [c[0] for c in crowd]


async def test_speculation_off_reads_one_token_a_step():
    eng = _engine(False)
    try:
        await _run(eng, "o", ECHO)
        assert not any(c.drafted for p in eng.runner.steps for c in p.chunks)
        assert eng.stats().draft_tokens == 0
    finally:
        eng.stop()


def test_a_kept_cost_is_the_cost_of_its_shape():
    """Speculator.cost keeps costs by the chunks' shape: whatever chunks share it, the cost is theirs."""
    rng = random.Random(1)
    kept = Speculator(1.5, 64)
    for _ in range(3000):
        slots = sorted(rng.sample(range(12), rng.randint(1, 10)))
        chunks = [ScheduledChunk(SeqKey(i), s, rng.choice([0, 10, 63, 64, 100]), (5,) * rng.choice([1, 1, 2, 3]), 4,
                                 samplers=(SeqKey(i),), adapters=rng.choice([(), (("a", 1.0),)]))
                  for i, s in enumerate(slots)]
        assert kept.cost(chunks) == Speculator(1.5, 64).cost(chunks)
