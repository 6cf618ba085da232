"""Stored responses (the Responses API's `store: true`): bounded by count, size and age, and scoped per API key.

An entry is what GET /v1/responses/{id} answers, the input items it was asked with, and the conversation so far
as items (the history before it, its input, its output), which a later request's previous_response_id continues.
A key sees only its own entries: another key's id reads as not found. Past the bounds the oldest entries go
first. Under `--ray` a Ray actor holds one such store for every ingress replica (servelm/ray/store.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

CLAIMS_PER_ENTRY = 4  # claims kept (answered approvals) per entry the store may hold


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

    def __init__(self, max_entries: int = StoreLimits.max_entries, max_bytes: int = StoreLimits.max_bytes,
                 max_age_s: float = StoreLimits.max_age_s, clock: Any = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, int, StoredResponse]] = OrderedDict()
        self._bytes = 0
        self._claims: OrderedDict[tuple[str, str], float] = OrderedDict()  # at most CLAIMS_PER_ENTRY × max_entries
        self._lock = threading.Lock()

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        size = entry.size
        if size > self.max_bytes or self.max_entries == 0:
            return  # larger than the whole store: it is not kept (a later GET answers 404)
        with self._lock:
            self._remove((owner, response_id))
            self._entries[(owner, response_id)] = (self._clock(), size, entry)
            self._bytes += size
            self._expire()
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            found = self._entries.get((owner, response_id))
            return found[2] if found is not None else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            return self._remove((owner, response_id))

    def claim(self, owner: str, key: str) -> bool:
        with self._lock:
            oldest = self._clock() - self.max_age_s  # a claim outlives the entry that asked (kept as long)
            while self._claims and next(iter(self._claims.values())) < oldest:
                self._claims.popitem(last=False)
            if (owner, key) in self._claims:
                return False
            self._claims[(owner, key)] = self._clock()
            while len(self._claims) > CLAIMS_PER_ENTRY * max(1, self.max_entries):
                self._claims.popitem(last=False)
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        while self._entries:
            key, (at, _, _) = next(iter(self._entries.items()))
            if at >= oldest:
                return
            self._remove(key)

    def _remove(self, key: tuple[str, str]) -> bool:
        found = self._entries.pop(key, None)
        if found is None:
            return False
        self._bytes -= found[1]
        return True
