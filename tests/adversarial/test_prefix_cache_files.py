"""Attacks on the prefix cache's files (--prefix-cache-dir), which several servers may share.

A file re-signed around another valid state of the same model (two entries' states swapped, or a state cut to
fewer cells, the header's size and checksum recomputed) was served as a hit with wrong answers: the checksum
covered the state alone. The MAC now covers the fingerprint, the scope and the tokens with the state, keyed by the
directory's key file, so whoever cannot read the key cannot move a state under other tokens or re-sign a file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path

from servelm.engine.plan import Restore
from servelm.engine.spill import KEY_FILE, MAGIC, MIN_SPILL, SUFFIX, SpillStore, read_header
from tests.engine.test_spill import ask, engine, ops

FIRST = [1 + (i * 7) % 50 for i in range(MIN_SPILL + 20)]
SECOND = [3 + (i * 5) % 40 for i in range(MIN_SPILL + 20)]


def resign(path: Path, state: bytes, **fields) -> None:
    """What an attacker who can write the directory but not read its key does: a new state under the old header,
    its size and a SHA-256 recomputed (the old format's checksum), every other field kept."""
    header = read_header(path)
    header.update(size=len(state), sha256=hashlib.sha256(state).hexdigest(), **fields)
    raw = json.dumps(header).encode()
    path.write_bytes(MAGIC + len(raw).to_bytes(8, "little") + raw + state)


def state_of(path: Path) -> bytes:
    return path.read_bytes()[-read_header(path)["size"]:]


async def two_entries(directory: Path) -> dict[tuple[int, ...], Path]:
    eng = engine(SpillStore("fake-model", 1 << 20, directory, 1 << 20))
    try:
        first, _ = await ask(eng, "a", FIRST)
        second, _ = await ask(eng, "b", SECOND)
    finally:
        eng.stop()
    files = {tuple(read_header(p)["tokens"]): p for p in directory.glob(f"*{SUFFIX}")}
    assert len(files) == 2
    return files


async def answers_from(directory: Path, prompt: list[int]):
    eng = engine(SpillStore("fake-model", 1 << 20, directory, 1 << 20))
    try:
        answer, last = await ask(eng, "x", prompt)
    finally:
        eng.stop()
    return answer, last, ops(eng, Restore)


async def test_swapped_states_with_their_headers_recomputed_are_never_served(tmp_path: Path, caplog):
    files = await two_entries(tmp_path)
    a, b = (files[k] for k in sorted(files, key=len))
    state_a, state_b = state_of(a), state_of(b)
    resign(a, state_b)
    resign(b, state_a)
    with caplog.at_level(logging.WARNING, logger="servelm.engine.spill"):
        for tokens in files:
            fresh = engine(None)
            try:
                truth, _ = await ask(fresh, "r", list(tokens))
            finally:
                fresh.stop()
            answer, last, restores = await answers_from(tmp_path, list(tokens))
            assert answer == truth and last.cached_tokens == 0 and not restores, \
                "a swapped state is never restored: the prompt is read"
    assert "MAC does not match" in caplog.text


async def test_a_state_moved_under_other_tokens_with_a_valid_mac_format_fails_its_mac(tmp_path: Path, caplog):
    """The same swap by someone who knows the format but not the key: each header keeps its own MAC."""
    files = await two_entries(tmp_path)
    a, b = (files[k] for k in sorted(files, key=len))
    state_a, state_b = state_of(a), state_of(b)
    for path, state in ((a, state_b), (b, state_a)):
        header = read_header(path)
        header["size"] = len(state)
        raw = json.dumps(header).encode()
        path.write_bytes(MAGIC + len(raw).to_bytes(8, "little") + raw + state)
    with caplog.at_level(logging.WARNING, logger="servelm.engine.spill"):
        _, last, restores = await answers_from(tmp_path, FIRST)
    assert last.cached_tokens == 0 and not restores
    assert "MAC does not match" in caplog.text


async def test_a_file_signed_with_another_directorys_key_is_not_loaded(tmp_path: Path):
    files = await two_entries(tmp_path / "one")
    other = tmp_path / "two"
    other.mkdir()
    SpillStore("fake-model", 1 << 20, other, 1 << 20)  # a key of its own
    for path in files.values():
        os.replace(path, other / path.name)
    _, last, restores = await answers_from(other, FIRST)
    assert last.cached_tokens == 0 and not restores


async def test_a_fifo_or_a_broken_key_file_neither_hangs_nor_crashes_start_up(tmp_path: Path, caplog):
    files = await two_entries(tmp_path)
    os.mkfifo(tmp_path / f"fifo{SUFFIX}")
    os.symlink(tmp_path / "nowhere", tmp_path / f"dangling{SUFFIX}")
    with caplog.at_level(logging.WARNING, logger="servelm.engine.spill"):
        store = await asyncio.wait_for(asyncio.to_thread(SpillStore, "fake-model", 1 << 20, tmp_path, 1 << 20), 10)
    assert len(store.entries) == len(files) and "not a regular file" in caplog.text
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with caplog.at_level(logging.WARNING, logger="servelm.engine.spill"):
        store = SpillStore("fake-model", 1 << 20, tmp_path, 1 << 20)
    assert "moved to" in caplog.text and len((tmp_path / KEY_FILE).read_bytes()) == 32
    assert all(p.exists() for p in files.values()), "a new key deletes nothing at start"
    _, last, _ = await answers_from(tmp_path, FIRST)
    assert last.cached_tokens == 0, "and never loaded under the new key"
