"""The prefix cache: the sequence slots (engine/slots.py), the spill store below them (engine/spill.py), the
stream copies queued between two passes, and the KV operations that keep them (Keep, Clear, Copy, Save, Restore).

The scheduler decides who runs; the cache decides where in the KV streams. It answers the scheduler's questions
with slot indices and cell counts, and queues the KV operations its answers take, which the scheduler's next plan
carries (take_ops):

- placement: where a new sequence starts (place: a slot at rest and the leading tokens whose cells it holds there,
  kept in place, copied from another slot or read back from the spill store) and where its siblings go (spare);
- release: a slot a sequence leaves rests with the cells it computed as an entry of its scope (release), or is cut
  back to the cells that held (trim);
- copies (fork, beam moves) and what they forbid until a pass makes them (copies_pending);
- restore failures: entries whose saved state the model refused are dropped (restore_failed);
- persistence: at a stop, every entry it holds goes to the spill store's directory (persist);
- whether a request waits a step for a prefix another one is reading (awaits), and its own counts (stats).

It never changes a sequence: a sequence's status, slot and computed cells are the scheduler's to set, from these
answers (tests/test_layers.py checks it). A slot's own record (which sequence holds it, what it caches) is the
cache's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from servelm.engine.plan import Clear, Copy, Keep, KVOp, Restore, Save
from servelm.engine.sequence import Sequence, SequenceGroup
from servelm.engine.slots import MIN_REUSE, Adapters, Slot, Slots, common_prefix, usable
from servelm.engine.spill import Spilled, SpillStore

log = logging.getLogger("servelm.engine")

DEFER_PREFIX = 64  # shared prompt tokens still being read that are worth waiting a step or two for
MIN_RESTORE = 32  # prompt tokens a spilled entry must hold beyond the slots' best to be read back (about 10 ms)


def spill_scope(scope: str, tiled: int) -> str:
    """The spill store's scope of an entry whose cells below `tiled` were read in whole tiles: a request finds
    there only entries read as its own prompt would be (an entry of another `tiled` holds other cells)."""
    return f"{scope}\x1ftiled {tiled}" if tiled else scope


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The cache's counts, as EngineStats names them."""

    kv_cells_cached: int  # held by slots at rest
    free_slots: int
    cache_hits: int  # requests placed on cached cells since start, and the prompt tokens those cells saved
    cached_tokens: int
    resumed_tokens: int  # tokens preempted requests found cached again on resuming
    spill_ram_bytes: int = 0
    spill_disk_bytes: int = 0
    spill_entries: int = 0
    spill_restored: int = 0
    spill_restore_failures: int = 0


class PrefixCache:
    def __init__(self, num_slots: int, *, enabled: bool = True, spill: SpillStore | None = None,
                 tile: int = 1) -> None:
        self.enabled = enabled  # False: a slot keeps nothing, and no request reads cached cells
        self.slots = Slots(num_slots, tile)
        self.spill = spill if enabled else None  # where entries the slots give up go (None: they are lost)
        self.ops: list[KVOp] = []  # queued for the next plan
        self._restoring: dict[int, Spilled] = {}  # this step's Restore ops: the spilled entry by slot
        # slots a queued Copy writes or reads, until a plan with chunks is read: llama.cpp copies between streams at
        # its next forward pass, so until then no Save of the destination and no Restore into either (plan.Copy)
        self._copied_to: set[int] = set()
        self._copied_from: set[int] = set()
        self.cache_hits = 0  # requests placed on cached cells, and the prompt tokens those cells saved
        self.cached_tokens = 0
        self.resumed_tokens = 0  # tokens preempted requests found cached again on resuming

    # -- views ----------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots at rest: what new sequences may take."""
        return len(self.slots.idle)

    @property
    def cached_cells(self) -> int:
        return self.slots.cached_cells

    @property
    def copies_pending(self) -> frozenset[int]:
        """Slots a Copy writes that no forward pass has made yet (their cells are not what they hold)."""
        return frozenset(self._copied_to)

    def reads(self, group: SequenceGroup) -> bool:
        """Whether the request starts from cached cells (one that wants its prompt's logprobs reads every token)."""
        return self.enabled and group.params.prompt_logprobs is None

    def reusable(self, group: SequenceGroup) -> int:
        """How many of the request's leading prompt tokens a slot's cells hold now: about what placing it would
        reuse (a spilled entry aside), so the prompt left to read is the rest."""
        if not self.reads(group):
            return 0
        prompt = group.prompt_token_ids
        n = self.slots.best_match(prompt, len(prompt) - 1, group.scope, group.tiled_end)[1]
        return group.whole(n) if n >= MIN_REUSE else 0

    def stats(self) -> CacheStats:
        spill = self.spill
        counts = CacheStats(self.cached_cells, self.free_slots, self.cache_hits, self.cached_tokens,
                            self.resumed_tokens)
        if spill is None:
            return counts
        return dataclasses.replace(counts, spill_ram_bytes=spill.ram_used, spill_disk_bytes=spill.disk_used,
                                   spill_entries=len(spill.entries), spill_restored=spill.restored,
                                   spill_restore_failures=spill.restore_failures)

    # -- a step's bounds ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Before a step is planned: the states the last step saved are kept, and its restores are past."""
        self._restoring = {}
        if self.spill is not None:
            self.spill.settle()

    def take_ops(self, reads: bool) -> list[KVOp]:
        """The KV operations queued since the last plan, for the plan now made; a plan that `reads` chunks makes the
        queued copies (its forward pass)."""
        ops, self.ops = self.ops, []
        if reads:
            self._copied_to.clear()
            self._copied_from.clear()
        return ops

    # -- placement ------------------------------------------------------------------------------------
    def place(self, group: SequenceGroup, tokens: list[int]) -> tuple[int, int]:
        """Where a new sequence of `group` with these tokens starts (a slot at rest: the caller checked that one
        is), and how many of its leading tokens that slot's cells hold by then; the operations that get them there
        are queued (the entry given up saved first, a copy, a restore) and the hit counted."""
        placed = self.slots.place(tokens, group.scope, self.reads(group), group.adapters, group.tiled_end)
        assert placed is not None  # the caller checked that enough slots rest
        if group.whole(placed.reuse) != placed.reuse:  # not into the middle of an image
            placed = dataclasses.replace(placed, reuse=group.whole(placed.reuse))
        slot = placed.slot
        # a spilled entry is read back only into a slot no copy touches before the next pass (its own entry moved
        # aside is such a copy)
        restorable = placed.moved is None and slot.index not in self._copied_to | self._copied_from
        spilled = self._spilled(group, tokens, placed.reuse) if restorable else None
        reuse = spilled[2] if spilled is not None else placed.reuse
        if placed.moved is not None:  # the slot's own entry is kept elsewhere first
            self._save(placed.moved)
            self.copy(slot.index, placed.moved.index, len(slot.cached))
            self.slots.move(slot, placed.moved)
        elif spilled is not None or placed.source is not None or not placed.reuse:
            self._save(slot)  # its entry is given up
        if spilled is not None:  # a spilled entry holds more of the prompt than any slot: its cells come back
            self.ops += [Restore(slot.index, spilled[1], reuse), Keep(slot.index, reuse)]
            self._restoring[slot.index] = spilled[0]
        elif placed.source is not None:  # a copy replaces whatever the slot held
            self.copy(placed.source.index, slot.index, placed.reuse)
        elif placed.reuse:
            self.ops.append(Keep(slot.index, placed.reuse))
        elif slot.cached:
            self.ops.append(Clear(slot.index))
        if group.preempted:  # its tokens so far, not only its prompt, were cached
            self.resumed_tokens += reuse
        elif reuse:
            self.cache_hits += 1
            self.cached_tokens += reuse
        return slot.index, reuse

    def spare(self, adapters: Adapters) -> int:
        """A slot at rest for a sibling sequence, emptied (its entry saved first): it gets the prompt's cells by a
        copy once they are read."""
        slot = self.slots.spare(adapters=adapters)
        if slot.cached:
            self._save(slot)
            self.ops.append(Clear(slot.index))
        return slot.index

    def take(self, slot: int, seq: Sequence) -> None:
        """The sequence holds the slot from now on."""
        self.slots.take(self.slots.slots[slot], seq, seq.group.scope)

    def awaits(self, group: SequenceGroup, readers: list[SequenceGroup]) -> bool:
        """Whether a request still reading its prompt (of the same scope; `readers`) reads at least DEFER_PREFIX
        leading tokens of this group's prompt itself (not from the cache) that no slot holds yet: once they are
        read, this group copies them and reads only the rest (four requests arriving together with one new long
        system prompt read it once, not four times; the wait is a step or a few). Tokens the cache already held,
        and a few beyond them, are not worth a wait."""
        if not self.reads(group):
            return False
        prompt = group.prompt_token_ids
        for reader in readers:
            if reader.scope != group.scope:
                continue
            shared = usable(common_prefix(reader.prompt_token_ids, prompt, len(prompt) - 1), reader.tiled_end,
                            group.tiled_end, self.slots.tile)
            if shared - reader.cached_tokens >= DEFER_PREFIX and reader.seqs[0].num_computed < shared:
                return True
        return False

    # -- release and copies ---------------------------------------------------------------------------
    def release(self, slot: int, computed: Seq[int], pin_seconds: float = 0.0) -> None:
        """A sequence leaves the slot: it rests with the cells of `computed` (the sequence's computed tokens) as an
        entry of its scope, pinned for `pin_seconds`, its stream made exactly that (a request failed or aborted in
        the middle of a step has cells in it that its count does not hold yet); with the cache off, emptied."""
        keep = computed if self.enabled else ()
        self.ops.append(Keep(slot, len(keep)) if keep else Clear(slot))
        self.slots.release(self.slots.slots[slot], keep, pin_seconds)

    def trim(self, slot: int, cells: int) -> None:
        """A running sequence's stream keeps only its first `cells` (a failed guess's go)."""
        self.ops.append(Keep(slot, cells))

    def copy(self, src: int, dst: int, n: int) -> None:
        """The first n cells of src's stream into dst's (at the next forward pass)."""
        self.ops.append(Copy(src, dst, n))
        self._copied_to.add(dst)
        self._copied_from.add(src)

    def restore_failed(self, slots: frozenset[int], uncached: Seq[int]) -> None:
        """The runner refused this step's restores into `slots`: their spilled entries go (files too), and the hits
        of the requests placed there, which read their prompts now, are taken back (`uncached`: the tokens each
        had counted)."""
        self.cache_hits -= len(uncached)
        self.cached_tokens -= sum(uncached)
        if self.spill is not None:
            for slot in slots:
                entry = self._restoring.pop(slot, None)
                if entry is not None:
                    self.spill.discard(entry)

    def _save(self, slot: Slot) -> None:
        """The resting slot's entry is about to be given up: its cells go to the spill store first (a Save op ahead
        of the op that overwrites them), if they are worth keeping and in its stream already (not a copy's yet)."""
        scope = spill_scope(slot.scope, slot.tiled)
        if self.spill is not None and slot.seq is None and slot.index not in self._copied_to \
                and self.spill.wants(slot.cached, scope):
            self.ops.append(Save(slot.index, self.spill.spill(slot.cached, scope)))

    def _spilled(self, group: SequenceGroup, tokens: list[int], reuse: int) -> tuple[Spilled, bytes, int] | None:
        """A spilled entry, its state and how many of the sequence's `tokens` it holds, when it holds at least
        MIN_RESTORE more than the slots offer (`reuse`)."""
        if self.spill is None or not self.reads(group):
            return None
        entry, n = self.spill.best(tokens, spill_scope(group.scope, group.tiled_end), len(tokens) - 1)
        n = group.whole(usable(n, group.tiled_end, group.tiled_end, self.slots.tile))
        if entry is None or n < reuse + MIN_RESTORE:
            return None
        data = self.spill.load(entry)
        return (entry, data, n) if data is not None else None

    # -- persistence ----------------------------------------------------------------------------------
    def persist(self, save: Callable[[int], bytes]) -> None:
        """At a stop, the entries go to the spill store's directory, if it has one: each slot at rest (its state read
        by `save`, the runner's), then what is in RAM (a restarted server reads them back)."""
        spill = self.spill
        if spill is None or spill.directory is None:
            return
        spill.settle()
        for slot in self.slots.slots:  # cells a copy has not written yet are not what the slot holds
            scope = spill_scope(slot.scope, slot.tiled)
            if slot.seq is None and slot.index not in self._copied_to and spill.wants(slot.cached, scope):
                try:
                    spill.persist(slot.cached, scope, save(slot.index))
                except Exception:  # one slot's state must not keep the others from disk
                    log.exception("the prefix cache entry of slot %d was not saved", slot.index)
        spill.close()
