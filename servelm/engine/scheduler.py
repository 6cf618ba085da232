"""Continuous batching as pure data: which tokens of which sequences go into the next forward pass.

schedule() → StepPlan; the engine runs the plan through the model, samples, then calls update().
Each step carries one token for every decoding sequence first, then prompt chunks (FCFS) under the
token budget, so a long prompt is read a chunk at a time while the others keep decoding. Sequences
are admitted and retired between steps. KV cells are counted here: a group's shared prompt counts
once; when the cache would overflow, the newest group is preempted (its cells freed, recomputed later).

Prefix cache (engine/prefix_cache.py): prompts, and whole turns once they finish, stay in the KV cache
under spare sequence ids, least recently used first out, within a cell budget, and give their cells back
first when running requests need room. A new request whose prompt begins with an entry's tokens (a shared
system prompt, a chat template's preamble, a conversation that grew by a turn) starts with a copy of those
cells (`llama_memory_seq_cp`: in a unified cache a shared cell costs nothing) and reads only the rest.
Seeded requests and requests for prompt logprobs do not read it (see seeded_step_tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from servelm.engine.prefix_cache import PrefixCache, common_prefix
from servelm.engine.sequence import Sequence, SequenceGroup, SeqStatus

DEFER_PREFIX = 64  # shared prompt tokens still being read that are worth waiting a step or two for
PROMPT_LOGPROBS_CHUNK = 32  # prompt tokens per step when every one needs its logits row (32 x 49k floats)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token
    tokens: tuple[int, ...]
    samplers: tuple[Sequence, ...] = ()  # who samples from the logits of the chunk's last token
    all_logits: bool = False  # a logits row for every token (prompt logprobs), not only the last

    @property
    def wants_logits(self) -> bool:
        return bool(self.samplers)


KVOp = tuple  # ("cp", src slot, dst slot, cells) or ("rm", slot): run in order, before the forward pass


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    ops: list[KVOp] = field(default_factory=list)  # in the order they were decided
    out_of_cells: list[Sequence] = field(default_factory=list)  # cannot grow at all: finish as "length"

    @property
    def forks(self) -> list[tuple[int, int, int]]:
        return [op[1:] for op in self.ops if op[0] == "cp"]

    @property
    def frees(self) -> list[int]:
        return [op[1] for op in self.ops if op[0] == "rm"]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.ops or self.out_of_cells)


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        kv_cells: int,
        max_step_tokens: int,
        *,
        seeded_step_tokens: int | None = None,
        prefix_cache: bool = False,
        prefix_cache_entries: int = 8,
        prefix_cache_cells: int | None = None,
    ) -> None:
        if num_slots < 1 or kv_cells < 1 or max_step_tokens < num_slots:
            raise ValueError("need num_slots >= 1, kv_cells >= 1 and max_step_tokens >= num_slots")
        self.num_slots = num_slots
        self.kv_cells = kv_cells
        self.max_step_tokens = max_step_tokens
        # While a seeded request is in the system every step stays this small, so that the runner's
        # kernels (and so the logits) do not depend on what else shares the step.
        self.seeded_step_tokens = max(seeded_step_tokens or max_step_tokens, num_slots)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in admission order
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._ops: list[KVOp] = []
        # Entries hold sequence ids num_slots.. num_slots + entries - 1; by default up to half the cells.
        self.cache: PrefixCache | None = None
        if prefix_cache and prefix_cache_entries > 0:
            budget = prefix_cache_cells if prefix_cache_cells is not None else kv_cells // 2
            self.cache = PrefixCache(list(range(num_slots, num_slots + prefix_cache_entries)), budget)

    # -- bookkeeping -------------------------------------------------------------------------------
    @property
    def kv_cells_cached(self) -> int:
        return self.cache.cells if self.cache is not None else 0

    @property
    def kv_cells_used(self) -> int:
        used = self.kv_cells_cached
        for group in self.running:
            if group.forked and group.holds_kv():
                used += group.prefix_cells
            used += sum(s.own_cells for s in group.seqs if s.holds_slot)
        return used

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.live) for g in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._ops)

    def add(self, group: SequenceGroup) -> None:
        if len(group.seqs) > self.num_slots:
            raise ValueError(f"a request of {len(group.seqs)} choices exceeds the {self.num_slots} sequence slots")
        self.waiting.append(group)

    def find(self, request_id: str) -> SequenceGroup | None:
        for group in (*self.running, *self.waiting):
            if group.request_id == request_id:
                return group
        return None

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = self.find(request_id)
        if group is not None:
            for seq in group.live:
                self.finish(seq)
        return group

    def finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        seq.status = SeqStatus.FINISHED
        if len(seq.group.seqs) == 1 and seq.slot is not None and seq.num_computed > seq.prompt_len:
            self._remember(seq, seq.num_computed)  # the whole turn, for the conversation's next one
        self._release(seq)
        group = seq.group
        if group.finished:
            if group in self.running:
                self.running.remove(group)
            elif group in self.waiting:
                self.waiting.remove(group)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._ops.append(("rm", seq.slot))
            self.free_slots.append(seq.slot)
            seq.slot = None

    def preempt_newest(self) -> bool:
        """Give back the newest group's cells (the runner found the cache fuller than counted)."""
        if not self.running:
            return False
        self._preempt(self.running[-1])
        return True

    def _preempt(self, group: SequenceGroup) -> None:
        """Free every cell of the group; it waits at the head of the queue to be recomputed."""
        for seq in group.live:
            self._release(seq)
            seq.num_computed = 0
            seq.shared = 0
            seq.cached = 0
            seq.source = None
            seq.status = SeqStatus.WAITING
        group.prefix_cells = 0
        self.running.remove(group)
        self.waiting.appendleft(group)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.step_budget()
        free_cells = self._make_room_for_decode(plan)
        for group in self.running:
            for seq in group.seqs:
                if seq.status is SeqStatus.RUNNING and seq.num_pending == 1:
                    plan.chunks.append(self._chunk(seq, 1))
                    budget -= 1
                    free_cells -= 1
        for group in self.running:
            for seq in group.seqs:
                if budget <= 0 or free_cells <= 0:
                    break
                if seq.status is SeqStatus.RUNNING and seq.num_pending > 1:
                    take = min(self._pending(seq), budget, free_cells)
                    plan.chunks.append(self._chunk(seq, take))
                    budget -= take
                    free_cells -= take
        readers = self._prompt_readers()
        blocked = False  # a group ahead did not fit, and the ones behind may overtake it
        for group in list(self.waiting):
            if budget <= 0:
                break
            if readers and self._waits_for_prefix(group, readers):
                continue  # a running request is reading the prompt this one begins with: reuse it, soon
            need = self._admission_cells(group)
            if need > free_cells and need <= free_cells + self.kv_cells_cached:
                while need > free_cells:
                    used = self.kv_cells_used
                    if not self._evict_lru():
                        break
                    free_cells += used - self.kv_cells_used
            if len(group.live) > len(self.free_slots) or need > free_cells:
                if blocked or self._may_overtake(group, need, free_cells):
                    blocked = True
                    continue
                break
            self.waiting.remove(group)
            self._admit(group)
            for seq in group.seqs:
                if seq.status is SeqStatus.RUNNING and budget > 0:
                    take = min(self._pending(seq), budget)
                    plan.chunks.append(self._chunk(seq, take))
                    budget -= take
            free_cells -= need
        plan.ops, self._ops = self._ops, []
        return plan

    @staticmethod
    def _pending(seq: Sequence) -> int:
        """Tokens the sequence may read this step: all pending, except that a prompt read for its logprobs
        goes in chunks of PROMPT_LOGPROBS_CHUNK (each of its tokens is a vocabulary-wide logits row)."""
        if seq.group.params.prompt_logprobs is not None and seq.num_computed < seq.prompt_len:
            return min(seq.num_pending, PROMPT_LOGPROBS_CHUNK)
        return seq.num_pending

    def step_budget(self) -> int:
        seeded = any(g.params.seed is not None for g in (*self.running, *self.waiting))
        return min(self.max_step_tokens, self.seeded_step_tokens) if seeded else self.max_step_tokens

    def _make_room_for_decode(self, plan: StepPlan) -> int:
        """Preempt the newest groups until every decoding sequence has a cell for its next token."""
        while True:
            free = self.kv_cells - self.kv_cells_used
            decoding = [s for g in self.running for s in g.seqs if s.status is SeqStatus.RUNNING and s.num_pending == 1]
            if len(decoding) <= free:
                return free
            if self._evict_lru():
                continue
            if len(self.running) > 1:
                self._preempt(self.running[-1])
                continue
            # A single group that has filled the whole cache: it cannot grow any further.
            for seq in decoding[free:] if free > 0 else decoding:
                plan.out_of_cells.append(seq)
                self.finish(seq)

    def _may_overtake(self, head: SequenceGroup, need: int, free_cells: int) -> bool:
        """Whether groups behind a head that does not fit may go first: only while the head could not fit even if
        every group admitted after it gave back its cells and slots. They then take nothing the head could use
        (it waits for an older, larger request to end), and once it could fit without them, nothing overtakes
        it any more: FCFS holds wherever it costs the head anything."""
        cells, slots = free_cells + self.kv_cells_cached, len(self.free_slots)
        for g in self.running:
            if g.arrival > head.arrival:
                cells += (g.prefix_cells if g.forked and g.holds_kv() else 0) + sum(
                    s.own_cells for s in g.seqs if s.holds_slot)
                slots += sum(1 for s in g.seqs if s.holds_slot)
        return need > cells or len(head.live) > slots

    def _admission_cells(self, group: SequenceGroup) -> int:
        """Cells the group needs to (re)compute what it has, plus one new token for each live sequence."""
        live = group.live
        if group.forked:
            return sum(len(s.token_ids) + 1 for s in live)
        return len(live[0].token_ids) + len(live)

    def _admit(self, group: SequenceGroup) -> None:
        for seq in group.live:
            seq.slot = self.free_slots.pop()
            seq.status = SeqStatus.RUNNING
        if not group.forked:
            for seq in group.live[1:]:
                seq.status = SeqStatus.FORK_PENDING
            self._reuse_prefix(group.live[0])
        self.running.append(group)

    # -- the prefix cache -------------------------------------------------------------------------
    def _reuse_prefix(self, seq: Sequence) -> None:
        if not self._reads_cache(seq.group) or seq.num_computed:
            return
        entry, n = self.cache.lookup(seq.token_ids, len(seq.token_ids) - 1, seq.group.scope)  # the last is read for its logits
        if entry is None:
            return
        self._ops.append(("cp", entry.slot, seq.slot, n))
        seq.num_computed = seq.cached = n
        seq.source = entry
        seq.group.cached_tokens = n

    def _reads_cache(self, group: SequenceGroup) -> bool:
        return self.cache is not None and group.params.seed is None and group.params.prompt_logprobs is None

    def _prompt_readers(self) -> list[tuple[str, tuple[int, ...]]]:
        """Prompts (with their scope) that running requests are still reading and will keep in the cache."""
        if self.cache is None:
            return []
        return [(g.scope, g.prompt_token_ids) for g in self.running
                if g.seqs[0].num_computed < g.prompt_len and self._reads_cache(g)]

    def _waits_for_prefix(self, group: SequenceGroup, readers: list[tuple[str, tuple[int, ...]]]) -> bool:
        """Whether a prompt still being read shares at least DEFER_PREFIX more leading tokens with this group's
        prompt than the cache holds: once that prompt is read and kept, this group reads only the rest (four
        requests arriving together with one long system prompt read it once, not four times)."""
        if not self._reads_cache(group) or group.forked or group.seqs[0].num_computed:
            return False
        prompt = group.prompt_token_ids
        # only readers of the same scope: waiting on another key's prompt would tell this key that it exists
        shared = max((common_prefix(r, prompt, len(prompt) - 1) for scope, r in readers if scope == group.scope),
                     default=0)
        return shared >= DEFER_PREFIX and shared >= self.cache.peek(prompt, shared, group.scope) + DEFER_PREFIX  # type: ignore[union-attr]

    def _remember(self, seq: Sequence, length: int) -> None:
        """Keep the sequence's first `length` cells (its prompt, or its whole turn) in the prefix cache."""
        if self.cache is None or seq.slot is None:
            return
        tokens = tuple(seq.token_ids[:length])
        entry = self.cache.insert(tokens, seq.slot, seq.source, seq.cached, self._ops, seq.group.scope)
        self._settle_evictions()
        if entry is not None:
            seq.cached, seq.source = length, entry  # those cells are now counted once, as the cache's

    def _evict_lru(self) -> bool:
        """Give back the least recently used entry's cells; False if the cache holds none."""
        if self.cache is None or not self.cache.entries:
            return False
        self.cache.evict(self.cache.lru(), self._ops)
        self._settle_evictions()
        return True

    def _settle_evictions(self) -> None:
        """Cells borrowed from an evicted entry are counted under its parent's, or as the borrower's own."""
        assert self.cache is not None
        gone, self.cache.evicted = self.cache.evicted, []
        for entry in gone:
            for group in self.running:
                for seq in group.seqs:
                    if seq.source is entry:
                        keep = min(seq.cached, entry.shared) if entry.parent is not None else 0
                        seq.cached, seq.source = keep, entry.parent if keep else None

    def _chunk(self, seq: Sequence, take: int) -> ScheduledChunk:
        start = seq.num_computed
        tokens = tuple(seq.token_ids[start : start + take])
        samplers: tuple[Sequence, ...] = ()
        if start + take == len(seq.token_ids):
            pending = [s for s in seq.group.seqs if s.status is SeqStatus.FORK_PENDING]
            samplers = (seq, *pending)
        all_logits = seq.group.params.prompt_logprobs is not None and start < seq.prompt_len
        return ScheduledChunk(seq, start, tokens, samplers, all_logits)

    def update(self, plan: StepPlan, sampled: Mapping[Sequence, int]) -> None:
        """Record a finished forward pass: computed cells, sampled tokens, and forks of fresh siblings."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed += len(chunk.tokens)
            if chunk.start < seq.prompt_len <= seq.num_computed:
                self._remember(seq, seq.prompt_len)
            for sampler in chunk.samplers:
                if sampler.status is SeqStatus.FORK_PENDING:
                    self._fork(seq, sampler)
                if sampler in sampled and sampler.status is not SeqStatus.FINISHED:
                    sampler.token_ids.append(sampled[sampler])

    def rebeam(self, group: SequenceGroup, parents: list[int], tokens: list[int]) -> list[int]:
        """Beam search moved on: new beam i continues beam parents[i] with tokens[i].

        A parent's first child stays in the parent's slot; each further child takes the slot of a beam that
        left no child and gets the parent's cells (shared, not copied). Returns, for each new beam, the
        index of the sequence that now holds it.
        """
        seqs = group.seqs
        old = [(list(s.token_ids), s.num_computed) for s in seqs]
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        spare = [j for j in range(len(seqs)) if j not in children]
        host = [0] * len(parents)
        for p, kids in children.items():
            host[kids[0]] = p
            for k in kids[1:]:
                j = spare.pop()
                host[k] = j
                src, dst = seqs[p].slot, seqs[j].slot
                if src is not None and dst is not None:
                    self._ops.append(("rm", dst))
                    self._ops.append(("cp", src, dst, old[p][1]))
        for i, p in enumerate(parents):
            seq = seqs[host[i]]
            seq.token_ids = old[p][0] + [tokens[i]]
            seq.num_computed = old[p][1] if seq.slot is not None else 0
            seq.shared = min(group.prompt_len, seq.num_computed)  # counted as the group's, conservatively
        return host

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        group = parent.group
        n = group.prompt_len
        group.forked = True
        group.prefix_cells = n
        parent.shared = n
        child.num_computed = n
        child.shared = n
        child.status = SeqStatus.RUNNING
        assert parent.slot is not None and child.slot is not None
        self._ops.append(("cp", parent.slot, child.slot, n))
