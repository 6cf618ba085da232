"""The prefix cache as pure data: which token sequences stay in the KV cache after their requests moved on.

Each entry is a run of tokens whose cells stay in llama.cpp's unified KV cache under a spare sequence id of
its own (ids `num_slots`, `num_slots + 1`, ...). A request whose prompt begins with an entry's tokens starts
with a copy of those cells (`("cp", entry.slot, seq.slot, n)`: in a unified cache a copied cell is the same
cell, so a copy costs nothing) and reads only the rest. Entries are made from a prompt as soon as it has been
read (so a shared system prompt helps requests that arrive while the first one still generates) and again,
longer, from a whole conversation turn when its sequence finishes (so the next turn, which begins with the
previous turn and its answer, reuses both).

Counting: an entry made from a sequence that had itself borrowed its first cells from another entry shares
those cells with it (`parent`, `shared`); its own cells are the rest. The cache holds `cells` distinct cells,
at most `budget`, in at most `len(slots)` entries; the least recently used entry goes first when either is
exceeded, or when running requests need the room (the scheduler asks). Every KV operation is appended to the
`ops` list the caller passes, in the order it must run.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PREFIX_REUSE = 4  # fewer shared tokens than this are not worth a copy


@dataclass(eq=False, slots=True)
class CacheEntry:
    tokens: tuple[int, ...]
    slot: int  # the spare llama.cpp sequence id that holds the cells
    scope: str = ""  # only requests of the same scope (API key, cache_salt) read it
    parent: CacheEntry | None = None  # the entry whose leading cells this one shares
    shared: int = 0  # leading cells shared with the parent (counted there)
    used: int = 0  # the cache's clock when it was last made or read

    @property
    def own(self) -> int:
        return len(self.tokens) - (self.shared if self.parent is not None else 0)


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int], limit: int) -> int:
    """Leading tokens a and b share, at most `limit`. Compares blocks of 64 as slices (in C) and walks only
    the block where they part: a 650-token system prompt is 11 slice compares, not 650 Python steps."""
    a, b = tuple(a), tuple(b)
    limit = min(limit, len(a), len(b))
    n = 0
    while n + 64 <= limit and a[n : n + 64] == b[n : n + 64]:
        n += 64
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    def __init__(self, slots: list[int], budget: int) -> None:
        self.free_slots = sorted(slots, reverse=True)
        self.num_entries = len(slots)
        self.budget = budget
        self.entries: list[CacheEntry] = []
        self._clock = 0
        self.evicted: list[CacheEntry] = []  # since the caller last read it: borrowers must be told

    @property
    def cells(self) -> int:
        return sum(e.own for e in self.entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def peek(self, tokens: tuple[int, ...] | list[int], limit: int, scope: str = "") -> int:
        """How many leading tokens of `tokens` (at most `limit`) the scope's entries could give; touches nothing."""
        return max((common_prefix(e.tokens, tokens, limit) for e in self.entries if e.scope == scope), default=0)

    def lookup(self, tokens: list[int], limit: int, scope: str = "") -> tuple[CacheEntry | None, int]:
        """The scope's entry sharing the longest prefix with `tokens` (at most `limit` tokens), and that length."""
        best, best_n = None, 0
        for entry in self.entries:
            if entry.scope != scope:
                continue
            n = common_prefix(entry.tokens, tokens, limit)
            if n > best_n:
                best, best_n = entry, n
        if best is None or best_n < MIN_PREFIX_REUSE:
            return None, 0
        best.used = self._tick()
        return best, best_n

    def insert(self, tokens: tuple[int, ...], src_slot: int, source: CacheEntry | None, borrowed: int,
               ops: list, scope: str = "") -> CacheEntry | None:
        """Keep the first len(tokens) cells of sequence `src_slot` (of which `borrowed` came from `source`)
        as an entry. Entries it makes redundant (its own prefixes) go; so does the least recently used one
        when no id is free or the budget would be exceeded. Returns the entry, or None if it cannot fit."""
        if not tokens or len(tokens) > self.budget:
            return None
        mine = [e for e in self.entries if e.scope == scope]
        for entry in mine:
            if entry.tokens[: len(tokens)] == tokens:
                entry.used = self._tick()  # already held (or a longer run that begins with it)
                return None
        new = CacheEntry(tokens, -1, scope, source if borrowed else None, borrowed, self._tick())
        self.entries.append(new)  # before evicting, so that its parent link is mended with the others'
        for entry in [e for e in mine if tokens[: len(e.tokens)] == e.tokens]:
            self.evict(entry, ops)  # the new entry answers every lookup this one could
        while not self.free_slots or self.cells > self.budget:
            others = [e for e in self.entries if e is not new]
            if not others:
                break
            self.evict(min(others, key=lambda e: e.used), ops)
        if not self.free_slots or self.cells > self.budget:
            self.entries.remove(new)
            return None
        new.slot = self.free_slots.pop()
        ops.append(("cp", src_slot, new.slot, len(tokens)))
        return new

    def lru(self) -> CacheEntry:
        return min(self.entries, key=lambda e: e.used)

    def evict(self, entry: CacheEntry, ops: list) -> None:
        """Drop an entry. Entries that shared its cells now share its parent's part of them, or own them."""
        self.entries.remove(entry)
        ops.append(("rm", entry.slot))
        self.free_slots.append(entry.slot)
        for other in self.entries:
            if other.parent is entry:
                other.shared = min(other.shared, entry.shared) if entry.parent is not None else 0
                other.parent = entry.parent if other.shared else None
        self.evicted.append(entry)

    def clear(self, ops: list) -> None:
        while self.entries:
            self.evict(self.entries[-1], ops)
