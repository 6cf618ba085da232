"""A prompt's leading whole tiles (64 positions each) are read on flash attention's tiled kernel, in chunks of whole
tiles; its tail and every generated token a few rows at a time on the row kernel. Which kernel computes a position
then depends on the prompt alone, so the prefix cache reuses only cells computed as a fresh read would compute
them. Driven by hand, and against the fake runner, which checks that a tiled chunk is whole tiles after tiled cells
only, a tile or more at a time, and that llama.cpp's micro-batches give each tiled chunk's stream all of it
(runners/fake.py)."""

from __future__ import annotations

import pytest

from servelm.engine.plan import ScheduledChunk, SeqKey, StepPlan
from servelm.engine.prefix_cache import spill_scope
from servelm.engine.sequence import SequenceGroup
from servelm.engine.slots import usable
from servelm.engine.types import SamplingParams
from servelm.runners.fake import FakeKVError, FakeRunner
from tests.engine.steps import Recording

TILE = 64


def tiles(num_slots: int = 2, max_step_tokens: int = 256, prefix_cache: bool = False) -> Recording:
    return Recording(num_slots, 1024, max_step_tokens, max_rows=63, tile_rows=TILE, prefix_cache=prefix_cache)


def ask(s: Recording, rid: str, prompt, max_tokens: int = 2, **kw) -> SequenceGroup:
    g = SequenceGroup(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **kw))
    s.add(g)
    return g


def step(s: Recording, runner: FakeRunner):
    plan = s.schedule()
    runner.step(plan)  # raises on a tiled chunk under a tile, after untiled cells, or cut by a micro-batch
    s.record(plan, {seq: 7 for c in plan.chunks for seq in c.samplers})
    return plan


def read(s: Recording, plans, g: SequenceGroup) -> list[tuple[int, bool]]:
    return [(len(c.tokens), c.tiled) for p in plans for c in p.chunks if s.group(c) is g]


@pytest.mark.parametrize(("a_len", "b_len"), [(200, 100), (64, 63), (128, 300)])
def test_whole_tiles_first_in_chunks_of_whole_tiles_then_the_tail_in_rows(a_len: int, b_len: int) -> None:
    s, runner = tiles(), FakeRunner(num_slots=2, context_window=1024, max_step_tokens=256)
    a, b = ask(s, "a", range(1, a_len + 1)), ask(s, "b", range(1, b_len + 1))
    # never a prompt's last two tokens: a single row right after the tiles may re-read the position before it
    assert (a.tiled_end, b.tiled_end) == ((a_len - 2) // TILE * TILE, (b_len - 2) // TILE * TILE)
    plans = [step(s, runner) for _ in range(6)]
    for g in (a, b):
        chunks = read(s, plans, g)
        assert sum(n for n, tiled in chunks if tiled) == g.tiled_end, "every whole tile on the tiled kernel"
        assert all(n % TILE == 0 for n, tiled in chunks if tiled)
        assert all(n <= 63 for n, tiled in chunks if not tiled), "the rest below a tile"
        rows = [n for n, tiled in chunks if not tiled]
        assert not g.tiled_end or rows[0] >= 2, "two rows or more right after the tiles"
        assert sum(n for n, _ in chunks[: len(chunks) - 1]) >= g.prompt_len, "then it decodes a row a step"
    for plan in plans:  # a call holds tiled chunks or others, never both
        for call in plan.calls():
            assert len({plan.chunks[i].tiled for i in call}) == 1


def test_a_budget_below_a_tile_still_reads_one_tile_a_step_when_no_other_prompt_is_read() -> None:
    s, runner = tiles(max_step_tokens=32), FakeRunner(num_slots=2, context_window=1024, max_step_tokens=32)
    a, b = ask(s, "a", range(1, 140)), ask(s, "b", range(1, 100))
    plans = [step(s, runner) for _ in range(8)]
    assert read(s, plans, a)[:3] == [(64, True), (64, True), (11, False)]
    for plan in plans:
        assert sum(len(c.tokens) for c in plan.chunks if c.tiled) <= TILE, "one tile past the budget, no more"
    assert (64, True) in read(s, plans, b) and b.seqs[0].num_computed >= 99


def test_no_tiles_for_a_prompt_read_for_its_logprobs_or_a_runner_without_them() -> None:
    s = tiles()
    assert ask(s, "p", range(1, 200), prompt_logprobs=1).tiled_end == 0
    plain = Recording(2, 1024, 256, max_rows=63, prefix_cache=False)
    assert ask(plain, "q", range(1, 200)).tiled_end == 0
    assert [len(c.tokens) for c in plain.schedule().chunks] == [63]


@pytest.mark.parametrize(("shared", "cells_tiled", "tiled_end", "want"), [
    (199, 192, 192, 199),  # the same prompt again: all but its last token
    (150, 192, 256, 150),  # a shared prefix ending inside the tiles: the rest (106) read as one tiled chunk
    (220, 256, 256, 192),  # ... but at least a tile of them is left to read (a tiled chunk is a tile or more)
    (34, 128, 128, 34),  # the chat template's opening, before a prompt's first tile ends
    (230, 192, 256, 192),  # a next turn: the entry's tiles, not its tail read in rows (the prompt reads them tiled)
    (230, 256, 192, 192),  # a shorter prompt: its own tiles; the entry's tiled cells past them are not its rows
    (40, 0, 0, 40),  # no tiles either side: any prefix
    (100, 0, 128, 0),  # an entry read in rows (a prompt read for its logprobs): none of the prompt's tiles
    (100, 0, 64, 0),
    (30, 64, 128, 30),  # less than a tile, with more than a tile after it
    (30, 64, 64, 0),  # ... and with less than a tile after it: none
])
def test_what_a_prompt_may_reuse(shared: int, cells_tiled: int, tiled_end: int, want: int) -> None:
    assert usable(shared, cells_tiled, tiled_end, TILE) == want


def test_a_cache_hit_inside_the_tiles_reads_the_rest_of_them_as_one_tiled_chunk_and_answers_read_the_same_cells(
) -> None:
    s = tiles(num_slots=3, prefix_cache=True)
    runner = FakeRunner(num_slots=3, context_window=1024, max_step_tokens=256)
    system = list(range(1, 151))
    first = ask(s, "first", [*system, *range(200, 250)], max_tokens=1)  # 200 tokens: tiles to 192
    while first.seqs[0].num_computed < 200:
        step(s, runner)
    s.finish(first.seqs[0])
    again = ask(s, "again", [*system, *range(200, 250)])
    later = ask(s, "later", [*system, *range(300, 450)])  # 300 tokens: tiles to 256, shares 150
    plan = step(s, runner)
    assert again.cached_tokens == 199 and later.cached_tokens == 150
    assert [(c.start, len(c.tokens), c.tiled) for c in plan.chunks] == [(199, 1, False), (150, 106, True)]


def test_an_entry_kept_in_the_spill_store_is_found_only_by_prompts_read_in_the_same_tiles() -> None:
    assert spill_scope("key", 0) == "key", "entries read in rows keep their scope (files from before tiles too)"
    assert spill_scope("key", 128) != spill_scope("key", 192) != spill_scope("other", 192)


def test_after_a_hit_inside_a_tile_a_small_budget_reads_the_odd_rows_and_a_tile_in_one_chunk_when_alone() -> None:
    s = Recording(3, 1024, 32, max_rows=63, tile_rows=TILE, prefix_cache=True)
    runner = FakeRunner(num_slots=3, context_window=1024, max_step_tokens=32)
    first = ask(s, "first", range(1, 200), max_tokens=1)  # tiles to 192
    while first.seqs[0].num_computed < 199:
        step(s, runner)
    s.finish(first.seqs[0])
    later = ask(s, "later", [*range(1, 101), *range(500, 700)])  # 300 tokens, tiles to 256: shares 100 of them
    plans = [step(s, runner) for _ in range(3)]
    assert later.cached_tokens == 100
    assert read(s, plans, later)[:2] == [(92, True), (64, True)], "the 28 odd rows and a tile, then a tile"


def test_tiled_chunks_share_a_call_only_with_tiled_chunks_of_their_length() -> None:
    """llama.cpp cuts a call into micro-batches of as many tokens from each stream as the shortest has left: a
    tiled chunk of 92 beside one of 128 would leave the second's last 36 rows a micro-batch on the row kernel."""
    odd = StepPlan([ScheduledChunk(SeqKey(0), 0, 0, tuple(range(92)), tiled=True),
                    ScheduledChunk(SeqKey(1), 1, 0, tuple(range(128)), tiled=True),
                    ScheduledChunk(SeqKey(2), 2, 0, tuple(range(92)), tiled=True)])
    assert sorted(sorted(call) for call in odd.calls()) == [[0, 2], [1]]
    mixed = FakeRunner(num_slots=3, context_window=1024, max_step_tokens=512)
    mixed.step(odd)  # as the plan cuts it: each micro-batch gives a stream its whole chunk
    with pytest.raises(FakeKVError, match="less than a tile"):
        FakeRunner(num_slots=2, context_window=1024, max_step_tokens=512).step(
            _OneCall([ScheduledChunk(SeqKey(0), 0, 0, tuple(range(92)), tiled=True),
                      ScheduledChunk(SeqKey(1), 1, 0, tuple(range(128)), tiled=True)]))


class _OneCall(StepPlan):
    """A plan that puts all its chunks in one call (as the plan did before calls split tiled chunks by length)."""

    def calls(self) -> list[list[int]]:
        return [list(range(len(self.chunks)))]
