"""The stored responses' bounds: count, size and age, oldest out first; entries scoped by owner."""

from __future__ import annotations

from servelm.service.store import MemoryStore, StoredResponse


def entry(text: str = "x") -> StoredResponse:
    return StoredResponse({"id": text}, [{"text": text}], [])


def test_another_owner_sees_nothing():
    store = MemoryStore()
    store.put("alice", "resp_1", entry())
    assert store.get("alice", "resp_1") is not None
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None


def test_count_bound_drops_the_oldest():
    store = MemoryStore(max_entries=2)
    for i in range(3):
        store.put("", f"r{i}", entry())
    assert store.get("", "r0") is None and store.get("", "r2") is not None and len(store) == 2


def test_size_bound_drops_the_oldest_and_refuses_what_cannot_fit():
    size = entry("a" * 100).size
    store = MemoryStore(max_bytes=2 * size + 10)
    for i in range(3):
        store.put("", f"r{i}", entry("a" * 100))
    assert len(store) == 2 and store.get("", "r0") is None
    store.put("", "huge", entry("a" * 10 * size))
    assert store.get("", "huge") is None and len(store) == 2


def test_age_bound():
    now = [0.0]
    store = MemoryStore(max_age_s=60, clock=lambda: now[0])
    store.put("", "old", entry())
    now[0] = 30
    store.put("", "new", entry())
    now[0] = 61
    assert store.get("", "old") is None and store.get("", "new") is not None


def test_a_claim_is_its_owners_once_and_outlives_nothing_it_should_not():
    now = [0.0]
    store = MemoryStore(max_entries=1, max_age_s=60, clock=lambda: now[0])
    assert store.claim("alice", "approval:1") and not store.claim("alice", "approval:1")
    assert store.claim("bob", "approval:1")  # another owner's claim is its own
    for i in range(10):  # bounded: at most a few claims per entry the store may hold
        store.claim("alice", f"k{i}")
    assert len(store._claims) <= 4
    now[0] = 61
    assert store.claim("alice", "k9")  # past the store's age the claim is gone with what it answered
