"""Stored responses (the Responses API's `store: true`): scoped per API key, and bounded per key by count, size and
age.

An entry is what GET /v1/responses/{id} answers, the input items it was asked with, and the conversation so far
as items (the history before it, its input, its output), which a later request's previous_response_id continues.
A key sees only its own entries: another key's id reads as not found. Past a key's bounds its own oldest entries
go first (never another key's). MemoryStore keeps them in this process; with --state-dir, service/durable.py's
SqlResponses keeps them in the state directory's database, where they survive a restart; under `--ray` a Ray actor
holds one MemoryStore for every ingress replica (servelm/ray/store.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

CLAIMS_PER_ENTRY = 4  # claims kept (answered approvals) per entry a key may hold


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as JSON
    input_items: list[dict[str, Any]]  # the request's input items, with ids
    history: list[dict[str, Any]]  # the conversation as input items: everything before, this input, this output

    @property
    def size(self) -> int:
        return len(json.dumps([self.response, self.input_items, self.history]))


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (ServerSettings' responses_store_*)."""

    max_entries: int = 1000
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 3600.0

    @classmethod
    def from_settings(cls, settings: Any) -> StoreLimits:
        return cls(settings.responses_store_entries, settings.responses_store_mib * 1024 * 1024,
                   settings.responses_store_ttl)


class ResponseStore(Protocol):
    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None: ...

    def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    def delete(self, owner: str, response_id: str) -> bool: ...

    def claim(self, owner: str, key: str) -> bool:
        """True the first time an owner claims a key (an MCP approval answered), False ever after: atomic."""
        ...


class MemoryStore:
    """The store in this process's memory: thread-safe (services read it from worker threads)."""

    kept = "memory"  # what /health's `kept` says of it: a restart loses it

    def __init__(self, max_entries: int = StoreLimits.max_entries, max_bytes: int = StoreLimits.max_bytes,
                 max_age_s: float = StoreLimits.max_age_s, clock: Any = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self._clock = clock
        self._owners: dict[str, _Owned] = {}
        self._lock = threading.Lock()

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        size = entry.size
        if size > self.max_bytes or self.max_entries == 0:
            return  # larger than all a key may keep: it is not kept (a later GET answers 404)
        with self._lock:
            mine = self._mine(owner)
            mine.remove(response_id)
            mine.entries[response_id] = (self._clock(), size, entry)
            mine.bytes += size
            while len(mine.entries) > self.max_entries or mine.bytes > self.max_bytes:
                mine.remove(next(iter(mine.entries)))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._mine(owner).entries.get(response_id)
            return found[2] if found is not None else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            return self._mine(owner).remove(response_id)

    def claim(self, owner: str, key: str) -> bool:
        with self._lock:
            claims = self._mine(owner).claims
            if key in claims:
                return False
            claims[key] = self._clock()
            while len(claims) > CLAIMS_PER_ENTRY * max(1, self.max_entries):
                claims.popitem(last=False)
            return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(self._mine(owner).entries) for owner in list(self._owners))

    def _mine(self, owner: str) -> _Owned:
        """The owner's entries and claims, those older than max_age_s gone (a claim is kept as long as an entry)."""
        mine = self._owners.setdefault(owner, _Owned())
        oldest = self._clock() - self.max_age_s
        while mine.entries and next(iter(mine.entries.values()))[0] < oldest:
            mine.remove(next(iter(mine.entries)))
        while mine.claims and next(iter(mine.claims.values())) < oldest:
            mine.claims.popitem(last=False)
        return mine


@dataclass
class _Owned:
    """One key's entries (oldest first: id → (stored at, bytes, entry)), their bytes, and its claims."""

    entries: OrderedDict[str, tuple[float, int, StoredResponse]] = field(default_factory=OrderedDict)
    bytes: int = 0
    claims: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def remove(self, response_id: str) -> bool:
        found = self.entries.pop(response_id, None)
        if found is None:
            return False
        self.bytes -= found[1]
        return True
