"""The sequence slots, and the prefix cache they make: pure data.

Every slot is a llama.cpp sequence id with a KV stream of its own. A running sequence holds one; when it ends,
its stream keeps what it computed (the prompt and the answer) until the slot is given to another request, so
a slot at rest is a cache entry, as llama-server's slots are. A new request is placed where the longest part of
its prompt already is. An idle slot whose cells the prompt continues (a conversation's next turn, the same
prompt again) is reused in place; a prefix shared with a slot whose entry goes on differently (a shared system
prompt, then another question), or with a running slot, is copied into another slot, so the entry stays whole (a
stream copy costs milliseconds, reading the tokens again costs seconds); otherwise a request takes an empty slot,
or the least recently used one (an entry pinned by Anthropic's cache_control goes last). Entries are scoped: a request reads only cells
written under its own scope (its API key and cache_salt).

Where a sequence runs matters for speed as well: llama.cpp decodes consecutive sequence ids in one pass, and
every gap between running slots costs a pass of its own each step (a whole read of the weights). So a new
sequence goes next to the running ones: into a neighbouring slot at rest, its entry copied (one stream copy) to
the slot that would have been given up otherwise; an entry the prompt continues that lies elsewhere is copied
next to them too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from servelm.engine.sequence import Sequence

Adapters = tuple[tuple[str, float], ...]  # a sequence's LoRA adapters (name, scale); () for the base model

MIN_REUSE = 4  # fewer shared tokens than this are not worth keeping a slot's cells for
MIN_COPY = 8  # nor a stream copy: about 10 ms for a 2,048-cell stream of the default model, reading 8 tokens more


def common_prefix(a: Seq[int], b: Seq[int], limit: int) -> int:
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


def usable(shared: int, cells_tiled: int, tiled_end: int, tile: int) -> int:
    """Of `shared` leading cells that hold a prompt's tokens, how many the prompt may reuse: those computed on the
    flash-attention kernel its own read would take. Cells below `cells_tiled` were read on the tiled kernel, and so
    are the prompt's own positions below `tiled_end` (Scheduler.add), the rest a few rows at a time. A cut inside
    the prompt's tiled part leaves at least a tile of it to read, so that the rest is read on the tiled kernel too
    (a chunk of a tile or more; where it starts does not matter to a row's result)."""
    n = shared if cells_tiled == tiled_end else min(shared, cells_tiled, tiled_end)
    return n if n >= tiled_end or tiled_end - n >= tile else tiled_end - tile


@dataclass(eq=False, slots=True)
class Slot:
    index: int
    seq: Sequence | None = None  # the running Sequence that holds it, or None: at rest
    cached: tuple[int, ...] = ()  # at rest: the tokens whose cells its stream still holds, positions 0..
    scope: str = ""  # whose cells they are
    used: int = 0  # the clock when it last held or lent cells
    pinned_until: float = 0.0  # monotonic time: until then its entry is given up only after unpinned ones
    tiled: int = 0  # at rest: its cells below this were read in whole tiles (SequenceGroup.tiled_end)

    @property
    def tokens(self) -> Seq[int]:
        """The tokens its cells hold now: a running sequence's computed ones, or what was kept at rest."""
        if self.seq is not None:
            return self.seq.token_ids[: self.seq.num_computed]
        return self.cached

    @property
    def cells(self) -> int:
        return self.seq.num_computed if self.seq is not None else len(self.cached)

    @property
    def tiled_cells(self) -> int:
        """Its cells below this were read in whole tiles."""
        return self.seq.group.tiled_end if self.seq is not None else self.tiled


@dataclass(frozen=True, slots=True)
class Placement:
    slot: Slot
    reuse: int = 0  # leading prompt tokens whose cells it starts with
    source: Slot | None = None  # where they are copied from (None: the slot's own, kept in place)
    moved: Slot | None = None  # where the slot's own entry is copied first, to keep it (None: it is given up)


@dataclass
class Slots:
    count: int
    tile: int = 1  # the runner's tile_rows (1: none)
    slots: list[Slot] = field(init=False)
    _clock: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.slots = [Slot(i) for i in range(self.count)]

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def idle(self) -> list[Slot]:
        return [s for s in self.slots if s.seq is None]

    @property
    def cached_cells(self) -> int:
        return sum(len(s.cached) for s in self.slots if s.seq is None)

    def best_match(self, tokens: Seq[int], limit: int, scope: str, tiled_end: int = 0) -> tuple[Slot | None, int]:
        """The slot (idle or running) whose cells share the longest usable prefix with `tokens` (a prompt read in
        whole tiles below `tiled_end`), within `scope`."""
        best, best_key = None, (0, False)
        for slot in self.slots:
            if slot.scope != scope or not slot.cells:
                continue
            n = usable(common_prefix(slot.tokens, tokens, limit), slot.tiled_cells, tiled_end, self.tile)
            key = (n, slot.seq is None)  # equal: one at rest, no copy
            if key > best_key:
                best, best_key = slot, key
        return (best, best_key[0]) if best_key[0] else (None, 0)

    def place(self, tokens: Seq[int], scope: str, reads_cache: bool,
              adapters: Adapters = (), tiled_end: int = 0) -> Placement | None:
        """Where a sequence with this prompt starts, or None when no slot is at rest. The last prompt token is
        always read (its logits are needed). `adapters`: its LoRA adapters (it shares passes only with slots of
        the same ones); `tiled_end`: its prompt is read in whole tiles below that (SequenceGroup.tiled_end)."""
        idle = self.idle
        if not idle:
            return None
        best, n = self.best_match(tokens, len(tokens) - 1, scope, tiled_end) if reads_cache else (None, 0)
        if best is None or n < MIN_REUSE:
            return self._make_room(Placement(self.spare(adapters=adapters)))
        near = self._nearest(idle, adapters)
        continues = len(best.cached) <= len(tokens) and tuple(tokens[: len(best.cached)]) == best.cached
        if best in near and (continues or near == [best]):
            return Placement(best, n)  # the prompt continues the entry (or no other slot will do): nothing is lost
        other = self.spare(besides=best, adapters=adapters)
        if self._worth(other)[0] and not self._worth(best)[0]:
            return Placement(best, n)  # the only other slot holds a pinned entry: this unpinned one's tail goes
        return self._make_room(Placement(other, n, best) if n >= MIN_COPY else Placement(other), besides=best)

    def spare(self, besides: Slot | None = None, adapters: Adapters = ()) -> Slot:
        """A slot at rest to give a new sequence: next to running ones (of its adapters) first, then an empty one
        (the lowest), else the one whose cells were used least recently."""
        idle = [s for s in self.idle if s is not besides] or self.idle
        return min(self._nearest(idle, adapters), key=self._worth)

    def _make_room(self, placed: Placement, besides: Slot | None = None) -> Placement:
        """Keep the entry of the slot a sequence takes by copying it to the slot that would have been given up
        otherwise (the empty or least recently used one), when that one's entry is worth less."""
        target = placed.slot
        if len(target.cached) < MIN_COPY:
            return placed
        rest = [s for s in self.idle if s is not target and s is not besides]
        victim = min(rest, key=self._worth, default=None)
        if victim is None or self._worth(victim) >= self._worth(target):
            return placed
        return Placement(placed.slot, placed.reuse, placed.source, moved=victim)

    @staticmethod
    def _worth(slot: Slot) -> tuple[bool, bool, int]:
        """Which resting slot to give up first: empty ones (the lowest first), then the least recently used, pinned
        entries (Anthropic's cache_control) last."""
        pinned = bool(slot.cached) and slot.pinned_until > time.monotonic()
        return (pinned, bool(slot.cached), slot.used if slot.cached else slot.index)

    def _nearest(self, idle: list[Slot], adapters: Adapters = ()) -> list[Slot]:
        """The slots among `idle` with the most running neighbours of the same LoRA adapters (a slot that joins two
        runs of running slots saves a pass a step; one beside a run costs none; one apart from every run costs
        one: runs of other adapters are passes of their own). Beside none, those farthest from other adapters' runs,
        so that each adapter's run has room to grow."""
        running = {s.index for s in self.slots if s.seq is not None and s.seq.group.adapters == adapters}
        others = [s.index for s in self.slots if s.seq is not None and s.seq.group.adapters != adapters]
        score = {s.index: (s.index - 1 in running) + (s.index + 1 in running) for s in idle}
        top = max(score.values())
        near = [s for s in idle if score[s.index] == top]
        if top == 0 and others:
            far = {s.index: min(abs(s.index - o) for o in others) for s in near}
            most = max(far.values())
            near = [s for s in near if far[s.index] == most]
        return near

    def move(self, src: Slot, dst: Slot) -> None:
        """src's entry now lies in dst (the caller copies the cells)."""
        dst.cached, dst.scope, dst.used, dst.pinned_until = src.cached, src.scope, src.used, src.pinned_until
        dst.tiled = src.tiled

    def take(self, slot: Slot, seq: Sequence, scope: str) -> None:
        slot.seq, slot.cached, slot.scope, slot.used, slot.pinned_until = seq, (), scope, self.tick(), 0.0

    def release(self, slot: Slot, keep: Seq[int], pin_seconds: float = 0.0) -> None:
        """The sequence is over: the slot rests, keeping the cells of `keep` (what it computed) as a cache entry,
        pinned for `pin_seconds`."""
        slot.tiled = slot.tiled_cells
        slot.seq, slot.cached, slot.used = None, tuple(keep), self.tick()
        slot.pinned_until = time.monotonic() + pin_seconds if pin_seconds else 0.0
