"""The llama.cpp runner's calls, without a model: each step laid out as llama.cpp's own micro-batching cuts it (a
port of its split_equal below), every micro-batch in a shape that keeps its rows exact, every logits row at its
place. tests/runners/test_llamacpp_exactness.py and the self-check compare the rows themselves on real models."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from servelm.engine.plan import ScheduledChunk, SeqKey, StepPlan
from servelm.runners import llamacpp
from servelm.runners.llamacpp import LONE_ROW_FROM, MAX_ROWS, PAD_ROOM, Fence, LlamaCppRunner

BATCH = 256


def split_equal(seqs: list[int], n_ubatch: int = BATCH) -> list[list[int]]:
    """llama.cpp's llama_batch_allocr::split_equal(n_ubatch, sequential=true), as a KV cache of a stream a sequence
    calls it (src/llama-batch.cpp of the pinned llama-cpp-python 0.3.36), for tokens of one sequence id each: the
    batch indices of each micro-batch, in its order. From the first unused token, it takes the sequences that come
    next in id (last + 1), scanning the batch in order, then the same number of their unused tokens from each, as
    many as the shortest has."""
    used = [False] * len(seqs)
    out = []
    while not all(used):
        chain: list[int] = []
        for i, s in enumerate(seqs):
            if not used[i] and s not in chain and (not chain or s == chain[-1] + 1):
                chain.append(s)
                if len(chain) > n_ubatch:
                    break
        unused = {s: [i for i, t in enumerate(seqs) if t == s and not used[i]] for s in chain}
        taken: dict[int, list[int]] = {s: [] for s in chain}
        while all(len(taken[s]) < len(unused[s]) for s in chain):
            for s in chain:
                i = unused[s][len(taken[s])]
                taken[s].append(i)
                used[i] = True
            if (len(taken[chain[0]]) + 1) * len(chain) > n_ubatch:
                break
        out.append([i for s in chain for i in taken[s]])
    return out


def test_the_port_cuts_as_llama_cpp_does():
    assert split_equal([0, 1, 2, 2, 2, 3]) == [[0, 1, 2, 5], [3, 4]]
    assert split_equal([0, 2, 1]) == [[0, 2], [1]]  # sequence 1 comes later in the batch, and still next in id
    assert split_equal([1, 0]) == [[0], [1]]


class Shell(LlamaCppRunner):
    """The runner's batch and call cutting, with each llama_decode recorded instead of run."""

    def __init__(self, fence: Fence) -> None:  # no model: only what _step and _decode read
        self.fence = fence
        self.max_step_tokens = BATCH
        self.tile_rows = llamacpp.FA_TILE_ROWS
        self._capacity = max(BATCH, self.tile_rows) + PAD_ROOM
        self._tok, self._pos, self._seq, self._out, self._batch = llamacpp._batch(self._capacity, outputs=False)
        self._logits = np.empty((BATCH + 1, 1), dtype=np.float32)
        self._applied = ()
        self._mem = None
        self.forward_calls = 0
        self._held = None
        self.decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]] = []

    def _run(self, batch, places) -> None:
        """Recorded; its logits rows held as llama.cpp's buffer would hold them: each row's value is its call's
        number (from 1) times 1000 plus the row's place in the plan (-1 for a row asked only for the fence)."""
        self._flush()
        n = batch.n_tokens
        self.forward_calls += 1
        self.decoded.append((self._seq[:n].copy(), self._pos[:n].copy(), self._out[:n].copy(), list(places)))
        rows = [r for row, k in places for r in (range(row, row + k) if row >= 0 else [-1] * k)]
        if rows:
            self._held = (np.array([[self.forward_calls * 1000 + r] for r in rows], dtype=np.float32), list(places))


@pytest.fixture(autouse=True)
def no_kv_cache(monkeypatch):
    monkeypatch.setattr(llamacpp.C, "llama_memory_seq_rm", lambda *args: True)


def chunk(slot: int, start: int, n: int, *, logits: bool = True, all_logits: bool = False) -> ScheduledChunk:
    return ScheduledChunk(SeqKey(slot), slot, start, tuple(range(start, start + n)), start - 1 if start else None,
                          samplers=(SeqKey(slot),) if logits else (), all_logits=all_logits)


FENCES = [Fence(), Fence(min_rows=2), Fence(min_rows=4, multiple=4), Fence(min_rows=8), Fence(min_rows=8, multiple=4)]


def check(plan: StepPlan, fence: Fence) -> Shell:
    """Steps the plan on a shell and checks each call: llama.cpp cuts it into the micro-batches planned, in batch
    order (so its outputs need no reordering); none is a lone row (one row of one stream) the runner should have
    widened; with pair rows none has a single logits row; with a shape fence every micro-batch's rows and logits
    rows keep to its rule, a stream's rows stay below flash attention's tiled kernel, and its pads come after
    every position its chunk reads; and each logits row returned is its chunk's."""
    runner = Shell(fence)
    runner._step(plan)
    got: dict[int, tuple[int, int]] = {}
    ends = {c.slot: c.start + len(c.tokens) for c in plan.chunks}
    for seq, pos, out, places in runner.decoded:
        assert len(seq) <= BATCH + PAD_ROOM * fence.shape
        call = sorted((i for i, c in enumerate(plan.chunks) if c.slot in set(seq.tolist())), key=lambda i: plan.chunks[i].slot)
        micro = split_equal(seq.tolist(), BATCH + PAD_ROOM)
        assert [i for m in micro for i in m] == list(range(len(seq))), "micro-batches in batch order"
        assert [sorted({int(seq[i]) for i in m}) for m in micro] == \
            [[plan.chunks[i].slot for i, _, _ in m] for m in plan.micro_batches(call)]
        for m in micro:
            lone = len(m) == 1 and (fence.min_rows > 1 or pos[m[0]] >= LONE_ROW_FROM)
            assert not lone, f"a lone row at position {pos[m[0]]}"
            assert not (fence.pair and int(out[m].sum()) == 1), "a micro-batch with one logits row"
            if fence.shape:
                assert fence.fits(len(m)) and (not out[m].any() or fence.fits(int(out[m].sum()))), (len(m), out[m].sum())
                assert max(np.unique(seq[m], return_counts=True)[1]) <= MAX_ROWS
        pads = pos >= np.array([ends[int(s)] for s in seq])  # after every position the chunk reads; no row returned
        assert fence.shape or fence.pair or not pads.any(), "a pad where no fence asks for one"
        rows = [r for row, n in places for r in (range(row, row + n) if row >= 0 else [-1] * n)]
        for b, row in zip(np.flatnonzero(out), rows, strict=True):
            if row >= 0:
                got[row] = (int(seq[b]), int(pos[b]))
    want = {}
    row = 0
    for c in plan.chunks:
        for j in range(len(c.tokens) - c.num_rows, len(c.tokens)):
            want[row] = (c.slot, c.start + j)
            row += 1
    assert got == want
    return runner


@pytest.mark.parametrize("fence", FENCES, ids=str)
def test_a_step_with_decoding_and_prompt_reading_slots_interleaved_is_one_call(fence):
    """16 streams: slots 3 and 9 read prompts (their last chunk: a logits row), 12 and 13 read equal ones, the rest
    decode. One llama_decode, of the fewest micro-batches the rules allow: every stream's first row together, then
    the rest of each prompt (slots apart cannot share a micro-batch; 12 and 13 do)."""
    lengths = {s: 1 for s in range(16)} | {3: 40, 9: 12, 12: 20, 13: 20}
    plan = StepPlan([chunk(s, 300, n) for s, n in lengths.items()])
    runner = check(plan, fence)
    assert runner.forward_calls == len(plan.calls()) == 1
    assert len(split_equal(runner.decoded[0][0].tolist())) == 4


@pytest.mark.parametrize("fence", FENCES[:2], ids=str)
def test_a_lone_row_reads_its_previous_position_again_in_a_shared_call(fence):
    """Slot 7 decodes past LONE_ROW_FROM with no neighbour in the call: its micro-batch would be one row, so its
    previous position goes beside it, in the same llama_decode as the others' rows."""
    plan = StepPlan([chunk(0, 10, 1), chunk(1, 10, 1), chunk(7, LONE_ROW_FROM + 5, 1), chunk(4, 0, 30, logits=False)])
    runner = check(plan, fence)
    assert runner.forward_calls == len(plan.calls()) == 1
    seq, pos, _, _ = runner.decoded[0]
    assert pos[seq == 7].tolist() == [LONE_ROW_FROM + 4, LONE_ROW_FROM + 5]


@pytest.mark.parametrize("fence", FENCES, ids=str)
def test_random_steps_are_cut_as_llama_cpp_cuts_them(fence):
    rng = np.random.default_rng(7)
    for _ in range(300):
        chunks = []
        for s in range(16):
            if rng.random() < 0.2:
                continue
            n = 1 if rng.random() < 0.6 else int(rng.integers(2, 40))
            start = int(rng.integers(0, 2 * LONE_ROW_FROM))
            chunks.append(chunk(s, start, n, logits=bool(rng.random() < 0.7), all_logits=bool(rng.random() < 0.1)))
            if sum(len(c.tokens) for c in chunks) > BATCH:
                chunks.pop()
        rng.shuffle(chunks)
        check(StepPlan(chunks), fence)


def test_lone_rows_go_in_calls_of_their_own_where_the_step_leaves_no_room_to_widen_them():
    """A full step (BATCH tokens) whose isolated decode rows past LONE_ROW_FROM would each take a token more: they
    go alone, as calls of two rows, and the rest in one call."""
    plan = StepPlan([chunk(s, LONE_ROW_FROM, 1) for s in (0, 2, 4)] + [chunk(6, 0, 40), chunk(7, 0, 40),
                                                                       chunk(9, 0, 40), chunk(10, 0, 40),
                                                                       chunk(12, 0, 40), chunk(13, 0, 53)])
    assert plan.num_tokens == BATCH
    runner = check(plan, Fence())
    assert runner.forward_calls == 4


def test_a_shape_fence_pads_each_stream_after_its_last_row_and_asks_for_logits_rows_to_its_rule():
    """Rows by 4: slot 5 decodes alone (1 row, 3 pads after it, 4 logits rows); slots 0 to 2 read 9-token prompt
    chunks side by side (27 rows: as many pads after each, 3, make 36, the first multiple of 4 three streams share)."""
    plan = StepPlan([chunk(s, 20, 9) for s in (0, 1, 2)] + [chunk(5, 100, 1)])
    runner = check(plan, Fence(min_rows=4, multiple=4))
    assert runner.forward_calls == 1
    seq, pos, out, _ = runner.decoded[0]
    assert pos[seq == 5].tolist() == [100, 101, 102, 103] and out[seq == 5].tolist() == [1, 1, 1, 1]
    assert pos[seq == 0].tolist() == list(range(20, 32)) and int(out[seq <= 2].sum()) == 4


def test_a_chunk_with_rows_after_a_micro_batch_that_breaks_the_rule_goes_alone():
    """8 rows or more: slots 0 and 1 share a first micro-batch of 2 rows, but slot 1's chunk goes on after it, so no
    pad can follow its row there: slot 1 reads its chunk in a call of its own, slot 0 is padded to 8."""
    plan = StepPlan([chunk(0, 50, 1), chunk(1, 0, 30)])
    runner = check(plan, Fence(min_rows=8))
    assert runner.forward_calls == 2
    assert sorted(len(d[0]) for d in runner.decoded) == [8, 30]


def test_a_fence_s_rule_is_checked_and_read_as_the_server_reports_it():
    assert Fence(min_rows=4, multiple=4).words() == ("rows by 4 a call",)
    assert Fence(repack=False, min_rows=8).words() == ("no repacked weights", "8 rows or more a call")
    assert Fence(min_rows=8, multiple=4).words() == ("8 rows or more by 4 a call",)
    assert Fence(min_rows=2).words() == ("two rows a call",) and Fence().words() == ()
    for bad in ({"min_rows": 0}, {"min_rows": PAD_ROOM}, {"multiple": 3}):
        with pytest.raises(ValueError, match="a fence's rows"):
            Fence(**bad)


def test_a_step_of_one_call_hands_out_llama_cpps_rows_and_a_step_of_several_their_copies():
    """A step whose one call made its logits rows in the plan's order returns them where llama.cpp left them (no
    copy of a large vocabulary's rows); otherwise each call's rows are copied to their places before the next call
    overwrites them."""
    one = Shell(Fence())
    plan = StepPlan([chunk(s, 10, 1) for s in range(4)])
    out = one._step(plan)
    assert out is not None and not np.shares_memory(out, one._logits), "the call's own rows"
    assert out[:, 0].tolist() == [1000, 1001, 1002, 1003]
    several = Shell(Fence())
    # a full step whose lone rows past LONE_ROW_FROM have no room to be widened: calls of their own
    plan = StepPlan([chunk(s, LONE_ROW_FROM, 1) for s in (0, 2, 4)] + [chunk(6, 0, 40), chunk(7, 0, 40),
                                                                       chunk(9, 0, 40), chunk(10, 0, 40),
                                                                       chunk(12, 0, 40), chunk(13, 0, 53)])
    out = several._step(plan)
    assert several.forward_calls == 4 and np.shares_memory(out, several._logits)
    assert {int(v) // 1000 for v in out[:, 0]} == {1, 2, 3, 4}, "the rows of every call"
    assert [int(v) % 1000 for v in out[:, 0]] == list(range(len(plan.chunks))), "each at its place"


def test_llama_cpps_logits_buffer_is_viewed_once_for_each_address_and_number_of_rows():
    """The rows a call made are handed out as an array over llama.cpp's own buffer, made once for each (address,
    rows): later calls' rows read through the same array; a buffer llama.cpp moved gets new arrays and the old
    ones are dropped."""
    runner = object.__new__(LlamaCppRunner)
    runner.vocab_size, runner._views = 4, {}
    first = (ctypes.c_float * 12)(*range(12))
    at = ctypes.cast(first, ctypes.POINTER(ctypes.c_float))
    two = runner._view(at, 2)
    assert two.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and runner._view(at, 2) is two
    first[5] = 50.0  # the next call's rows, written where the last call's were
    assert two[1, 1] == 50.0, "an array over the buffer, not a copy"
    assert runner._view(at, 3).shape == (3, 4) and len(runner._views) == 2
    moved = (ctypes.c_float * 16)(*range(100, 116))
    assert runner._view(ctypes.cast(moved, ctypes.POINTER(ctypes.c_float)), 2).tolist() == [[100, 101, 102, 103],
                                                                                         [104, 105, 106, 107]]
    assert len(runner._views) == 1, "the old buffer's arrays are dropped"
