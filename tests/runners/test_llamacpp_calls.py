"""The llama.cpp runner's calls, without a model: each step laid out as llama.cpp's own micro-batching cuts it (a
port of its split_equal below), every micro-batch in a shape that keeps its rows exact, every logits row at its
place. tests/runners/test_llamacpp_exactness.py and the self-check compare the rows themselves on real models."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.engine.plan import ScheduledChunk, SeqKey, StepPlan
from servelm.runners import llamacpp
from servelm.runners.llamacpp import LONE_ROW_FROM, LlamaCppRunner

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

    def __init__(self, pair: bool) -> None:  # no model: only what _step and _decode read
        self.pair_rows = pair
        self.max_step_tokens = BATCH
        self._tok, self._pos, self._seq, self._out, self._batch = llamacpp._batch(BATCH + 1, outputs=False)
        self._logits = np.empty((BATCH + 1, 1), dtype=np.float32)
        self._applied = ()
        self._mem = None
        self.forward_calls = 0
        self.decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]] = []

    def _run(self, batch, places) -> None:
        n = batch.n_tokens
        self.forward_calls += 1
        self.decoded.append((self._seq[:n].copy(), self._pos[:n].copy(), self._out[:n].copy(), list(places)))


@pytest.fixture(autouse=True)
def no_kv_cache(monkeypatch):
    monkeypatch.setattr(llamacpp.C, "llama_memory_seq_rm", lambda *args: True)


def chunk(slot: int, start: int, n: int, *, logits: bool = True, all_logits: bool = False) -> ScheduledChunk:
    return ScheduledChunk(SeqKey(slot), slot, start, tuple(range(start, start + n)), start - 1 if start else None,
                          samplers=(SeqKey(slot),) if logits else (), all_logits=all_logits)


def check(plan: StepPlan, pair: bool) -> Shell:
    """Steps the plan on a shell and checks each call: llama.cpp cuts it into the micro-batches planned, in batch
    order (so its outputs need no reordering); none is a lone row (one row of one stream) the runner should have
    widened; with pair rows none has a single logits row; and each logits row returned is its chunk's."""
    runner = Shell(pair)
    runner._step(plan)
    got: dict[int, tuple[int, int]] = {}
    for seq, pos, out, places in runner.decoded:
        assert len(seq) <= BATCH
        call = sorted((i for i, c in enumerate(plan.chunks) if c.slot in set(seq.tolist())), key=lambda i: plan.chunks[i].slot)
        micro = split_equal(seq.tolist())
        assert [i for m in micro for i in m] == list(range(len(seq))), "micro-batches in batch order"
        assert [sorted({int(seq[i]) for i in m}) for m in micro] == \
            [[plan.chunks[i].slot for i, _, _ in m] for m in plan.micro_batches(call)]
        for m in micro:
            lone = len(m) == 1 and (pair or pos[m[0]] >= LONE_ROW_FROM)
            assert not lone, f"a lone row at position {pos[m[0]]}"
            assert not (pair and int(out[m].sum()) == 1), "a micro-batch with one logits row"
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


@pytest.mark.parametrize("pair", [False, True])
def test_a_step_with_decoding_and_prompt_reading_slots_interleaved_is_one_call(pair):
    """16 streams: slots 3 and 9 read prompts (their last chunk: a logits row), 12 and 13 read equal ones, the rest
    decode. One llama_decode, of the fewest micro-batches the rules allow: every stream's first row together, then
    the rest of each prompt (slots apart cannot share a micro-batch; 12 and 13 do)."""
    lengths = {s: 1 for s in range(16)} | {3: 40, 9: 12, 12: 20, 13: 20}
    plan = StepPlan([chunk(s, 300, n) for s, n in lengths.items()])
    runner = check(plan, pair)
    assert runner.forward_calls == len(plan.calls()) == 1
    assert len(split_equal(runner.decoded[0][0].tolist())) == 4


@pytest.mark.parametrize("pair", [False, True])
def test_a_lone_row_reads_its_previous_position_again_in_a_shared_call(pair):
    """Slot 7 decodes past LONE_ROW_FROM with no neighbour in the call: its micro-batch would be one row, so its
    previous position goes beside it, in the same llama_decode as the others' rows."""
    plan = StepPlan([chunk(0, 10, 1), chunk(1, 10, 1), chunk(7, LONE_ROW_FROM + 5, 1), chunk(4, 0, 30, logits=False)])
    runner = check(plan, pair)
    assert runner.forward_calls == len(plan.calls()) == 1
    seq, pos, _, _ = runner.decoded[0]
    assert pos[seq == 7].tolist() == [LONE_ROW_FROM + 4, LONE_ROW_FROM + 5]


@pytest.mark.parametrize("pair", [False, True])
def test_random_steps_are_cut_as_llama_cpp_cuts_them(pair):
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
        check(StepPlan(chunks), pair)


def test_lone_rows_go_in_calls_of_their_own_where_the_step_leaves_no_room_to_widen_them():
    """A full step (BATCH tokens) whose isolated decode rows past LONE_ROW_FROM would each take a token more: they
    go alone, as calls of two rows, and the rest in one call."""
    plan = StepPlan([chunk(s, LONE_ROW_FROM, 1) for s in (0, 2, 4)] + [chunk(6, 0, 40), chunk(7, 0, 40),
                                                                       chunk(9, 0, 40), chunk(10, 0, 40),
                                                                       chunk(12, 0, 40), chunk(13, 0, 53)])
    assert plan.num_tokens == BATCH
    runner = check(plan, False)
    assert runner.forward_calls == 4
