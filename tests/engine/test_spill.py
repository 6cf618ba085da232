"""The prefix cache's spill tiers over the fake runner (which checks every KV operation, restores included): entries
a slot gives up go to host RAM and to disk, come back on a hit, survive a restart, keep to their budgets and
scopes, and a file of another model or a corrupt one is never loaded."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from servelm.engine.local import LocalEngine
from servelm.engine.plan import Restore, Save
from servelm.engine.prefix_cache import spill_scope
from servelm.engine.spill import MIN_SPILL, SUFFIX, SpillStore, directory_key, read_header, write_state
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.runners.fake import FakeRunner

LONG = [1 + (i * 7) % 50 for i in range(MIN_SPILL + 20)]  # a prompt worth spilling
OTHERS = [[2 + k] * (MIN_SPILL + 5) for k in range(3)]


def engine(store: SpillStore | None, slots: int = 1) -> LocalEngine:
    eng = LocalEngine(FakeRunner(num_slots=slots, max_step_tokens=64, context_window=256), spill=store)
    eng.start()
    return eng


async def ask(eng: LocalEngine, rid: str, prompt: list[int], scope: str = ""):
    out, last = [], None
    async for o in eng.generate(GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=6, temperature=0.0),
                                                  cache_scope=scope)):
        out += o.token_ids
        last = o
    return out, last


def ops(eng: LocalEngine, kind: type) -> list:
    return [op for plan in eng.runner.steps for op in plan.ops if isinstance(op, kind)]


async def test_an_entry_given_up_goes_to_ram_and_comes_back_on_a_hit():
    eng = engine(SpillStore("fake-model", 1 << 20))
    try:
        first, _ = await ask(eng, "a", LONG)
        await ask(eng, "b", OTHERS[0])  # takes the only slot: LONG's entry is saved first
        assert len(ops(eng, Save)) == 1 and eng.stats().spill_entries == 1 and eng.stats().spill_ram_bytes > 0
        again, last = await ask(eng, "c", LONG)
        assert len(ops(eng, Restore)) == 1 and eng.stats().spill_restored == 1
        assert again == first and last.cached_tokens == len(LONG) - 1, "read back, not computed"
        assert eng.runner.cells[0] == LONG + again[:-1], "the restored cells are the prompt's"
    finally:
        eng.stop()


async def test_without_a_store_or_below_the_threshold_nothing_is_saved():
    eng = engine(None)
    try:
        await ask(eng, "a", LONG)
        await ask(eng, "b", OTHERS[0])
        assert not ops(eng, Save)
    finally:
        eng.stop()
    eng = engine(SpillStore("fake-model", 1 << 20))
    try:
        await ask(eng, "a", LONG[: MIN_SPILL // 2])
        await ask(eng, "b", OTHERS[0])
        assert not ops(eng, Save), "a short entry is cheaper to read again"
    finally:
        eng.stop()


async def test_ram_keeps_to_its_budget_least_recently_used_out():
    store = SpillStore("fake-model", 0)  # nothing may stay in RAM, and there is no disk
    eng = engine(store)
    try:
        for i, prompt in enumerate([LONG, *OTHERS]):
            await ask(eng, str(i), prompt)
        assert ops(eng, Save) and store.entries == [] and store.ram_used == 0
    finally:
        eng.stop()


async def test_a_request_never_reads_another_scopes_spilled_entry():
    eng = engine(SpillStore("fake-model", 1 << 20))
    try:
        await ask(eng, "a", LONG, scope="key-a")
        await ask(eng, "b", OTHERS[0], scope="key-a")
        _, last = await ask(eng, "c", LONG, scope="key-b")
        assert not ops(eng, Restore) and last.cached_tokens == 0
        _, last = await ask(eng, "d", LONG, scope="key-a")
        assert ops(eng, Restore) and last.cached_tokens == len(LONG) - 1
    finally:
        eng.stop()


async def test_a_restarted_engine_answers_a_cached_prompt_from_disk(tmp_path: Path):
    eng = engine(SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20))
    try:
        first, _ = await ask(eng, "a", LONG)
    finally:
        eng.stop()  # the slot's entry goes to the directory
    files = list(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) == 1 and read_header(files[0])["tokens"] == LONG + first[:-1]
    eng = engine(SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20))
    try:
        assert eng.stats().spill_disk_bytes > 0
        again, last = await ask(eng, "b", LONG)
        assert again == first and last.cached_tokens == len(LONG) - 1 and ops(eng, Restore)
    finally:
        eng.stop()


async def test_ram_overflow_goes_to_disk_within_the_disk_budget(tmp_path: Path):
    store = SpillStore("fake-model", 0, tmp_path, 1 << 20)
    eng = engine(store)
    try:
        for i, prompt in enumerate([LONG, *OTHERS]):
            await ask(eng, str(i), prompt)
        store.settle()
        store._writer.submit(lambda: None).result()  # the writes so far are done
        assert store.ram_used == 0 and store.disk_used > 0 and len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 3
        _, last = await ask(eng, "again", LONG)
        assert last.cached_tokens == len(LONG) - 1, "read back from its file"
    finally:
        eng.stop()
    small = SpillStore("fake-model", 0, tmp_path, 1)  # a disk budget of one byte: every file goes
    assert small.entries == [] and not list(tmp_path.glob(f"*{SUFFIX}"))


async def test_files_of_another_model_or_corrupt_ones_are_ignored_and_logged(tmp_path: Path, caplog):
    eng = engine(SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20))
    try:
        await ask(eng, "a", LONG)
    finally:
        eng.stop()
    (good,) = tmp_path.glob(f"*{SUFFIX}")
    with caplog.at_level(logging.WARNING, logger="servelm.engine.spill"):
        other = SpillStore("another-model", 1 << 20, tmp_path, 1 << 20)
        assert other.entries == [] and "another model" in caplog.text
        (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a state at all")
        data = bytearray(good.read_bytes())
        data[-3] ^= 0xFF  # one flipped byte in the state: its header still reads, its MAC does not
        good.write_bytes(bytes(data))
        caplog.clear()
        eng = engine(SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20))
        assert "junk" in caplog.text and eng.stats().spill_entries == 1
        try:
            _, last = await ask(eng, "b", LONG)
        finally:
            eng.stop()
    assert last.cached_tokens == 0 and not ops(eng, Restore), "the corrupt state was not loaded: the prompt was read"
    assert "MAC does not match" in caplog.text


async def test_a_state_the_runner_refuses_is_dropped_and_the_prompt_read_while_neighbours_go_on(tmp_path, caplog):
    """Issue 32: a file with this server's header, fingerprint and MAC around a state the model refuses (another
    model's). It failed every request in the step, kept reporting its cached tokens with a wrong answer, and stayed on
    disk. Now: the entry and its file go, the slot is emptied, its request reads its prompt and answers as without a
    cache, its neighbours never notice, and the failure is logged and counted."""
    # under the scope the prompt looks in: no key, its whole tiles read so (engine/prefix_cache.py)
    forged = write_state(tmp_path, "fake-model", spill_scope("", (len(LONG) - 2) // 64 * 64), tuple(LONG),
                         b'["another-models-state", [1, 2, 3]]',
                         directory_key(tmp_path))[0]
    eng = LocalEngine(FakeRunner(num_slots=5, max_step_tokens=64, context_window=256),
                      spill=SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20))
    eng.start()
    try:
        with caplog.at_level(logging.WARNING):
            results = await asyncio.gather(*[ask(eng, f"n{k}", OTHERS[k % 3][: 20 + k]) for k in range(4)],
                                           ask(eng, "forged", LONG))
        fresh = LocalEngine(FakeRunner(num_slots=1, max_step_tokens=64, context_window=256))
        fresh.start()
        try:
            reference = [await ask(fresh, f"r{k}", OTHERS[k % 3][: 20 + k]) for k in range(4)]
            expected, _ = await ask(fresh, "rl", LONG)
        finally:
            fresh.stop()
        assert [r[0] for r in results[:4]] == [r[0] for r in reference], "every neighbour answered"
        answer, last = results[4]
        assert answer == expected and last.cached_tokens == 0, "read from its prompt, not from the refused state"
        assert not forged.exists() and eng.stats().spill_entries == 0, "the entry and its file are gone"
        assert eng.stats().spill_restore_failures == 1 and "refused" in caplog.text
        again, last = await ask(eng, "again", LONG)
        assert again == expected and not forged.exists()
    finally:
        eng.stop()


def test_unfinished_files_a_crash_left_are_removed_at_start(tmp_path, caplog):
    """Issue 32: leftover *.tmp files were never removed nor counted against the disk budget."""
    old = [tmp_path / f"entry{k}.tmp" for k in range(3)]
    for path in old:
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / "writing.123.tmp"  # another server's write in progress
    fresh.write_bytes(b"y")
    with caplog.at_level(logging.INFO, logger="servelm.engine.spill"):
        SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20)
    assert not any(p.exists() for p in old) and fresh.exists()
    assert "removed 3 unfinished" in caplog.text
