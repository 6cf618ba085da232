"""The stored responses' bounds, per key: count, size and age, that key's oldest out first; entries scoped by
owner. Each test runs on both stores: in memory, and in the state directory's database (service/durable.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from servelm.batch.store import BatchStore
from servelm.service.durable import SqlResponses
from servelm.service.store import MemoryStore, ResponseStore, StoredResponse, StoreLimits

Make = Callable[..., ResponseStore]


@pytest.fixture(params=["memory", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    opened: list[BatchStore] = []

    def build(clock: Any = None, **limits: Any) -> ResponseStore:
        found = StoreLimits(**limits)
        now = {} if clock is None else {"clock": clock}
        if request.param == "memory":
            return MemoryStore(found.max_entries, found.max_bytes, found.max_age_s, **now)
        opened.append(BatchStore(tmp_path / f"state{len(opened)}"))
        return SqlResponses(opened[-1], found, **now)

    yield build
    for db in opened:
        db.close()


def entry(text: str = "x") -> StoredResponse:
    return StoredResponse({"id": text}, [{"text": text}], [{"type": "message", "content": text}])


def test_another_owner_sees_nothing(make):
    store = make()
    store.put("alice", "resp_1", entry("mine"))
    assert store.get("alice", "resp_1") == entry("mine")
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None
    assert not store.delete("alice", "resp_1")


def test_count_bound_drops_that_keys_oldest(make):
    store = make(max_entries=2)
    store.put("bob", "b0", entry())
    for i in range(3):
        store.put("alice", f"r{i}", entry())
    assert store.get("alice", "r0") is None and store.get("alice", "r1") is not None
    assert store.get("alice", "r2") is not None
    assert store.get("bob", "b0") is not None, "another key's entry is never what makes room"


def test_size_bound_drops_the_oldest_and_refuses_what_cannot_fit(make):
    size = entry("a" * 100).size
    store = make(max_bytes=2 * size + 10)
    for i in range(3):
        store.put("", f"r{i}", entry("a" * 100))
    assert store.get("", "r0") is None and store.get("", "r1") is not None and store.get("", "r2") is not None
    store.put("", "huge", entry("a" * 10 * size))
    assert store.get("", "huge") is None and store.get("", "r2") is not None


def test_a_put_again_replaces_the_entry(make):
    store = make(max_entries=2)
    store.put("", "r", entry("one"))
    store.put("", "r", entry("two"))
    store.put("", "s", entry())
    assert store.get("", "r") == entry("two") and store.get("", "s") is not None


def test_age_bound(make):
    now = [1000.0]
    store = make(clock=lambda: now[0], max_age_s=60)
    store.put("", "old", entry())
    now[0] += 30
    store.put("", "new", entry())
    now[0] += 31
    assert store.get("", "old") is None and store.get("", "new") is not None


def test_a_claim_is_its_owners_once_and_outlives_nothing_it_should_not(make):
    now = [1000.0]
    store = make(clock=lambda: now[0], max_entries=1, max_age_s=60)
    assert store.claim("alice", "approval:1") and not store.claim("alice", "approval:1")
    assert store.claim("bob", "approval:1")  # another owner's claim is its own
    for i in range(10):  # bounded: at most a few claims per entry the store may hold, the oldest out first
        now[0] += 0.001
        store.claim("alice", f"k{i}")
    assert not store.claim("alice", "k9") and store.claim("alice", "approval:1")
    now[0] += 61
    assert store.claim("alice", "k9")  # past the store's age the claim is gone with what it answered


def test_the_database_keeps_them_across_a_reopen(tmp_path):
    db = BatchStore(tmp_path)
    SqlResponses(db).put("alice", "resp_1", entry("kept"))
    SqlResponses(db).claim("alice", "approval:1")
    db.close()
    db = BatchStore(tmp_path)
    try:
        store = SqlResponses(db)
        assert store.get("alice", "resp_1") == entry("kept") and store.get("bob", "resp_1") is None
        assert not store.claim("alice", "approval:1"), "an approval answered before the restart stays answered"
    finally:
        db.close()
