"""Continuous batching as pure data: which tokens of which sequences go into the next forward pass.

Its surface is four calls: add(group) and abort(request_id) between steps, schedule() → StepPlan before one, and
update(plan, sampled, result) after it, with what the sampler drew and what the output processor made of it. Only
these change a sequence's state (status, slot, tokens, cells computed, drafts) and queue KV operations; the rest
(the counts /health and /metrics show) is read-only. Each step carries one token for every decoding sequence (the
rows of work that yields only as far as the target holds: engine/fairness.py), then prompt chunks (running requests'
in admission order, then those admitted this step) under the step's token budget, so a long prompt is read a chunk
at a time while the others keep decoding; with a pacer (engine/pacing.py), a step reads only as much prompt as keeps
it within an inter-token target, whatever waits, so that neither the decoding streams nor another tenant's first
token waits for a burst's prompts (one tenant alone reads its own burst of short prompts at once: _catches_up). A
prompt's leading whole tiles (`tile_rows` each, SequenceGroup.tiled_end) are read in chunks of a tile or more, on
the runner's tiled kernel, one tile a step even past a smaller budget (a runner has tiles only where a tile's pass
fits the target: compose.py); the rest of it, and every generated token, at most
`max_rows` a step, on its row kernel (each kernel gives a row the same numerics whatever shares its step, and which
one reads a position depends on the prompt alone: docs/exactness.md). Sequences are admitted and retired between
steps.

Each sequence holds a slot: a KV stream of its own, as long as the context window, so a sequence can always
grow to the window; only a request ranked above it takes its slot away. A slot at rest keeps its cells as the prefix cache
(engine/prefix_cache.py, which owns the slots, the spill store and the KV operations; the scheduler asks it where a
sequence starts and applies its answers): a new request starts from the longest prefix of its prompt held by a slot
of its scope, reused in place or copied, and reads only the rest. `cached_tokens` counts what it did not read.
Requests for prompt logprobs read everything (each prompt token needs its row).

Waiting requests are admitted in the order engine/fairness.py gives: by rank (priority, less one level for every
`aging_s` seconds since the engine received it, then arrival), and between tenants (API keys, or client addresses),
the next slot to the tenant served least among requests of one priority (FairShare, its own room: its accounts, the
caps on a tenant's slots).

When the best-ranked waiting request finds no slot at rest, running requests of a lower priority that also rank
below it give theirs up, worst first (preemption: FairShare.victims): the slot rests with the cells the sequence computed as a prefix-
cache entry of its scope, saved to the spill store when another request takes the slot, and the sequence waits again
with every token it drew. On resuming it reads back what a slot or the spill still holds and computes the rest as
prompt: its answer is the same bitwise (docs/exactness.md), its sampler state untouched. Only a request of one
sequence without beam search, prompt logprobs or images is preempted. While a request reads its prompt, running
requests of a lower priority that also rank below it hold back (no row that step), so its first token comes about as
soon as on an idle engine.

An image in a prompt (a MediaSpan) is read as a chunk of its own, at most one image chunk a step, so that an image
delays the other sequences' steps by one image's forward pass at most: whole when its positions attend to each
other both ways, else in pieces of up to `max_rows`. Text stops where an image begins, and a cached prefix that
ends inside an image is cut back to the image's start.
"""

from __future__ import annotations

import time
from collections import deque

from servelm.engine.beam import beam_hosts
from servelm.engine.fairness import FairShare
from servelm.engine.output import BeamMove, Failed, Finish, StepResult
from servelm.engine.pacing import StepPacer
from servelm.engine.plan import LOGITS_ROWS, ScheduledChunk, SeqKey, StepPlan
from servelm.engine.prefix_cache import PrefixCache
from servelm.engine.sampler import SampledStep
from servelm.engine.sequence import SeqStatus, Sequence, SequenceGroup
from servelm.engine.speculate import Candidate, Drafter, Speculator
from servelm.engine.spill import SpillStore
from servelm.engine.types import MediaSpan

PROMPT_LOGPROBS_CHUNK = 32  # prompt tokens per step when every one needs its logits row (32 x 49k floats)
# One tenant alone reads all the prompts waiting past the pacer's limit when they are more than its streams decoding
# and this short, on average (_catches_up): requests sent together, then decoding together.
CATCH_UP_TOKENS = 256


class Scheduler:
    def __init__(self, num_slots: int, context_window: int, max_step_tokens: int, *, max_rows: int = 63,
                 tile_rows: int = 0, prefix_cache: bool = True, speculator: Speculator | None = None,
                 spill: SpillStore | None = None, pacer: StepPacer | None = None, aging_s: float = 60.0,
                 fair_share: bool = True) -> None:
        if num_slots < 1 or context_window < 1 or max_step_tokens < num_slots or max_rows < 1:
            raise ValueError("need num_slots, context_window and max_rows >= 1, and max_step_tokens >= num_slots")
        self.num_slots = num_slots
        self.context_window = context_window
        self.max_step_tokens = max_step_tokens
        self.max_rows = max_rows
        self.tile_rows = tile_rows  # a prompt's leading whole tiles are read in chunks of whole tiles (0: none)
        # the slots, where sequences run
        self.cache = PrefixCache(num_slots, enabled=prefix_cache, spill=spill, tile=tile_rows or 1)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in admission order
        self.speculator = speculator  # drafts for decoding sequences (None: no speculative decoding)
        self.pacer = pacer  # how much prompt a decoding step may read (None: its whole budget)
        self.draft_tokens = 0  # guesses read since start, and how many of them held
        self.draft_accepted = 0
        self._seqs: dict[SeqKey, Sequence] = {}  # every sequence of a waiting or running group
        self.share = FairShare(num_slots, aging_s, enabled=fair_share)  # the waiting ones' rank and order
        self.preemptions = 0  # requests that gave their slot up (the cache counts what they found on resuming)
        self.steps = 0  # plans made (a sequence's last_row is one of them)

    # -- bookkeeping -------------------------------------------------------------------------------
    @property
    def kv_cells_used(self) -> int:
        return sum(s.num_computed for g in self.running for s in g.seqs if s.holds_slot)

    @property
    def kv_cells(self) -> int:
        return self.num_slots * self.context_window

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.live) for g in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.cache.ops)

    def names_adapter(self, name: str) -> bool:
        """Whether scheduled work (running, or waiting here) runs with this LoRA adapter: it may not be freed."""
        return any(n == name for group in (*self.running, *self.waiting) for n, _ in group.adapters)

    def add(self, group: SequenceGroup) -> None:
        if len(group.seqs) > self.num_slots:
            raise ValueError(f"a request of {len(group.seqs)} choices exceeds the {self.num_slots} sequence slots")
        group.tiled_end = self._tiled_end(group)
        self.waiting.append(group)
        self.share.joined(group)
        for seq in group.seqs:
            self._seqs[seq.key] = seq

    def _tiled_end(self, group: SequenceGroup) -> int:
        """Where the prompt's whole tiles end: its positions before that are read in chunks of a tile or more (the
        runner's tiled kernel), the rest in chunks below a tile, so which kernel computes a position depends on the
        prompt alone (docs/exactness.md). Never its last two tokens: a single row (a prompt's last token, or an
        answer's) may be read with its previous position again beside it, on the row kernel (the llama.cpp runner's
        lone rows), so the position before it must be a row's (and _pending reads two or more right after the
        tiles). None for a prompt with images or read for its logprobs."""
        tile = self.tile_rows
        if not tile or group.media or group.params.prompt_logprobs is not None:
            return 0
        return max(group.prompt_len - 2, 0) // tile * tile

    def sequence(self, key: SeqKey) -> Sequence | None:
        """A waiting or running sequence, by key (a view: change it only through update)."""
        return self._seqs.get(key)

    def find(self, request_id: str) -> SequenceGroup | None:
        for group in (*self.running, *self.waiting):
            if group.request_id == request_id:
                return group
        return None

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = self.find(request_id)
        if group is not None:
            for seq in group.live:
                self._finish(seq)
        return group

    def _finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        seq.status = SeqStatus.FINISHED
        if seq.slot is not None:  # its cells stay as a cache entry of its scope
            self.cache.release(seq.slot, seq.token_ids[: seq.num_computed], seq.group.pin_seconds)
            seq.slot = None
        group = seq.group
        if group.finished:
            if group in self.running:
                self.running.remove(group)
            elif group in self.waiting:
                self.waiting.remove(group)
            for s in group.seqs:
                self._seqs.pop(s.key, None)
            self.share.left(group)

    # -- the step ----------------------------------------------------------------------------------
    def _suspend(self, group: SequenceGroup) -> None:
        """A running request gives its slot up and waits again: its cells stay as a cache entry of its scope."""
        seq = group.seqs[0]
        assert seq.slot is not None
        self.cache.release(seq.slot, seq.token_ids[: seq.num_computed])
        seq.slot, seq.status, seq.num_computed = None, SeqStatus.WAITING, 0
        self.running.remove(group)
        self.waiting.append(group)
        group.preempted += 1
        self.preemptions += 1

    def schedule(self) -> StepPlan:
        self.cache.settle()
        if self.waiting:  # the slots the best-ranked waiting requests take from running ones ranked below them
            for victim in self.share.victims(self.waiting, self.running, self.cache.free_slots):
                self._suspend(victim)
            self.waiting = deque(sorted(self.waiting, key=self.share.rank))
        plan = StepPlan()
        budget = self.max_step_tokens
        urgent = self.share.urgent(self.running, self.waiting, self.cache.free_slots)
        self.steps += 1
        # every decoding sequence's row, but while a more urgent prompt is read (they hold back), and those of work that
        # yields only as far as the target holds, while work that does not yield is there to wait for them
        decoding = [seq for group in self.running if not self.share.holds_back(group, urgent)
                    for seq in group.seqs if seq.status is SeqStatus.RUNNING and seq.num_pending == 1]
        only_yielding = all(map(self.share.yields, (*self.running, *self.waiting)))
        most = self.pacer.rows_within() if self.pacer is not None and not only_yielding else None
        for seq in self.share.rows(decoding, most):
            plan.chunks.append(self._chunk(seq, 1, seq.group.span_at(seq.num_computed)))
            seq.last_row = self.steps
            budget -= 1
        if self.speculator is not None and plan.chunks and budget > 0:  # each guess is a logits row, within the target
            room = min(budget, LOGITS_ROWS, budget if most is None else max(0, most - len(plan.chunks)))
            budget -= self.speculator.draft(plan, room, self.max_rows, self._draft_candidates(plan))
        plan.decode_tokens = self.max_step_tokens - budget
        # within the target whatever waits: the decoding streams' next token, and the first token of a prompt read
        # beside another's; but one tenant alone (none of its work yielding) reads its burst together: with nothing
        # to decode, or beside its own first streams (_catches_up)
        if self.pacer is not None and not (self.share.alone(self.running, self.waiting) and (
                not plan.decode_tokens or self._catches_up(budget, len(plan.chunks), urgent))):
            allowed = self.pacer.prompt_budget(plan.decode_tokens)
            budget = budget if allowed is None else min(budget, allowed)
        for group in self.running:
            if self.share.holds_back(group, urgent):
                continue
            for seq in group.seqs:
                if budget <= 0:
                    break
                if seq.reads_prompt:
                    budget -= self._read(seq, budget, plan)
        readers = self._prompt_readers()
        blocked = False  # a group ahead did not fit, and the ones behind may overtake it
        for group in self.share.order(self.waiting, self.running):
            if budget <= 0:
                break
            if self.share.holds_back(group, urgent):
                continue  # as the running ones it would hold back do: the urgent prompt is read alone
            if readers and self.cache.awaits(group, readers):
                continue  # a running request is reading the prompt this one begins with: reuse it, soon
            if len(group.live) > self.cache.free_slots:
                if blocked or self.share.may_overtake(group, self.running, self.cache.free_slots):
                    blocked = True
                    continue
                break
            self.waiting.remove(group)
            self._admit(group)
            if self.cache.reads(group):  # the ones behind may wait for what it is about to read
                readers.append(group)
            for seq in group.seqs:
                if seq.status is SeqStatus.RUNNING and budget > 0:
                    budget -= self._read(seq, budget, plan)
        # in slot order, as a runner lays a call out: a step of one call then makes its logits rows in the plan's
        # order, and they are sampled where the runner left them (a slot taken over by a later request would
        # otherwise put its rows out of order, and every step's rows would be copied before the draw)
        plan.chunks.sort(key=lambda c: c.slot)
        plan.ops = self.cache.take_ops(bool(plan.chunks))
        return plan

    def _catches_up(self, budget: int, decoding: int, urgent: SequenceGroup | None) -> bool:
        """Whether a decoding step of one tenant alone reads every prompt there is to read, past the pacer's limit: when
        those reading outnumber the streams decoding, every waiting request fits a slot, and what is left to read of
        the prompts (past the cells the cache holds: questions after a shared system prompt) is short
        (CATCH_UP_TOKENS a reader or fewer) and fits what is left of the step's budget. Requests sent together but
        received a moment apart are then read together and decode together from the next step on, one call a step,
        where paced they would be read a few tokens a step beside the first ones' decoding for tens of steps, each
        of them a call with few rows (the harness's 16 streams: 13% fewer tokens a second). The tenant's own decoding
        streams wait one slower step; long prompts are paced whatever their number. Beside another tenant's work, or
        work that yields, never (FairShare.alone): a neighbour's stream would wait for the whole burst."""
        if urgent is not None:
            return False
        readers = tokens = 0
        for group in self.running:
            for seq in group.seqs:
                if seq.reads_prompt:
                    readers += 1
                    tokens += seq.num_pending
        slots = 0
        for group in self.waiting:  # a walk of the free slots' worth at most, however long the queue
            slots += len(group.live)
            if slots > self.cache.free_slots:
                return False
            # what is left to read past the cells the cache holds (a fork copies the first sequence's)
            tokens += group.prompt_len - self.cache.reusable(group)
            if tokens > budget:
                return False
        readers += slots
        return readers > decoding and tokens <= min(budget, CATCH_UP_TOKENS * readers)


    def _draft_candidates(self, plan: StepPlan) -> dict[int, Candidate]:
        """The decode chunks (by index) that may carry guesses: a plain sequence's, sampled by it alone."""
        out = {}
        for i, chunk in enumerate(plan.chunks):
            seq = self._seqs[chunk.seq]
            params = seq.group.params
            if chunk.media is None and not chunk.all_logits and chunk.samplers == (chunk.seq,) and params.beam is None:
                if seq.drafter is None:
                    seq.drafter = Drafter()
                room = min(params.max_tokens - seq.num_generated - 1, self.context_window - chunk.start - 1)
                out[i] = Candidate(seq.drafter, seq.token_ids, room)
        return out

    def _read(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Put the sequence's next chunk in the plan, within the step's token budget; returns its length (0: none
        this step). An image goes whole when it must, whatever is left of the budget, and only as the step's one
        image chunk."""
        pos = seq.num_computed
        span = seq.group.span_at(pos)
        if span is None:
            take = self._pending(seq, budget, plan)
            if not take:
                return 0
        elif plan.has_media:
            return 0
        else:
            take = span.end - pos if not span.chunk.causal else min(span.end - pos, self.max_rows, budget)
        plan.chunks.append(self._chunk(seq, take, span))
        return take

    def _pending(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Tokens the sequence may read this step within `budget`: all pending, up to max_rows and up to its next
        image; a prompt read for its logprobs goes in chunks of PROMPT_LOGPROBS_CHUNK (each of its tokens is a
        vocabulary-wide logits row). Before its tiled_end, a tile or more, the rest of the tiled part a whole number
        of tiles (a cached prefix may end inside a tile: the first chunk takes the odd rows too): as many tiles as the
        budget holds, and one past it when no other prompt is read this step (so that a small budget still moves it
        on)."""
        end, tile = seq.group.tiled_end, self.tile_rows
        if seq.num_computed < end:
            left = end - seq.num_computed
            odd = left % tile
            tiles = max((min(left, budget) - odd) // tile, int(plan.num_tokens == plan.decode_tokens))
            return odd + tiles * tile if tiles else 0
        n = min(seq.num_pending, self.max_rows, budget)
        if end and seq.num_computed == end:  # never a single row right after the tiles (_tiled_end)
            n = max(n, 2)
        if seq.group.params.prompt_logprobs is not None and seq.num_computed < seq.prompt_len:
            n = min(n, PROMPT_LOGPROBS_CHUNK, LOGITS_ROWS - plan.logits_rows)  # a logits row each
            if n <= 0:
                return 0
        span = seq.group.next_span(seq.num_computed)
        return min(n, span.start - seq.num_computed) if span is not None else n

    def _admit(self, group: SequenceGroup) -> None:
        """The group's sequences take slots at rest: the first where the cache places it (its cached cells counted
        as computed), its siblings spare ones (they share the prompt once the first has read it: a copy, _fork)."""
        group.started_at = group.started_at or time.perf_counter()
        first, *others = group.live
        slot, reuse = self.cache.place(group, first.token_ids)
        self._occupy(first, slot)
        first.num_computed = reuse
        if not group.preempted:  # its prompt past what the cache holds is its tenant's (a resume is not charged again)
            self.share.charge(group, group.prompt_len - reuse)
            if reuse:
                group.cached_tokens = reuse
        for seq in others:
            self._occupy(seq, self.cache.spare(group.adapters))
            seq.status = SeqStatus.FORK_PENDING
        self.running.append(group)

    def _occupy(self, seq: Sequence, slot: int) -> None:
        self.cache.take(slot, seq)
        seq.slot = slot
        seq.status = SeqStatus.RUNNING

    def _prompt_readers(self) -> list[SequenceGroup]:
        """Running requests still reading their prompts (and reading the cache)."""
        if not self.cache.enabled:
            return []
        return [g for g in self.running if g.seqs[0].num_computed < g.prompt_len and self.cache.reads(g)]

    # -- after the forward pass -------------------------------------------------------------------
    def _chunk(self, seq: Sequence, take: int, span: MediaSpan | None = None) -> ScheduledChunk:
        assert seq.slot is not None
        start = seq.num_computed
        tokens = tuple(seq.token_ids[start : start + take])
        samplers: tuple[SeqKey, ...] = ()
        if start + take == len(seq.token_ids):
            pending = [s.key for s in seq.group.seqs if s.status is SeqStatus.FORK_PENDING]
            samplers = (seq.key, *pending)
        all_logits = seq.group.params.prompt_logprobs is not None and start < seq.prompt_len
        prev = seq.token_ids[start - 1] if start > 0 and seq.token_ids[start - 1] >= 0 else None  # not an image's
        media, offset = (span.chunk, start - span.start) if span is not None else (None, 0)
        return ScheduledChunk(seq.key, seq.slot, start, tokens, prev, samplers, all_logits, media, offset,
                              adapters=seq.group.adapters, tiled=start < seq.group.tiled_end)

    def update(self, plan: StepPlan, sampled: SampledStep, result: StepResult) -> list[SequenceGroup]:
        """Record a step: the cells its pass computed (and its refused restores), the tokens drawn (a drafted chunk's
        guesses that held count as computed), forks of fresh siblings, then the output's events in their order
        (finished sequences, failed requests, beam moves), then the failed guesses' cells dropped. Returns the
        requests that ended."""
        if plan.refused:
            self._restore_failed(plan.refused)
        for chunk in plan.chunks:
            seq = self._seqs.get(chunk.seq)
            if seq is None or seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed += len(chunk.tokens) - chunk.drafted  # a guess's cell counts once it holds
            self.draft_tokens += chunk.drafted
            for key in chunk.samplers:
                sampler = self._seqs[key]
                if sampler.status is SeqStatus.FORK_PENDING:
                    self._fork(seq, sampler)
                drawn = sampled.drawn.get(key)
                if drawn is not None:
                    sampler.token_ids += drawn.tokens
                    self.share.charge(sampler.group, len(drawn.tokens))
            if chunk.drafted and chunk.seq in sampled.drawn:
                accepted = sampled.drawn[chunk.seq].accepted
                seq.num_computed += accepted
                self.draft_accepted += accepted
        touched: list[SequenceGroup] = []
        for event in result.events:
            if isinstance(event, Finish):
                seq = self._seqs.get(event.seq)
                if seq is not None:
                    touched.append(seq.group)
                    self._finish(seq)
            elif isinstance(event, Failed):
                group = self.abort(event.request_id)
                if group is not None:
                    touched.append(group)
            elif isinstance(event, BeamMove):
                group = self.find(event.request_id)
                if group is not None:
                    self._rebeam(group, list(event.parents), list(event.tokens))
        for chunk in plan.chunks:
            if chunk.drafted:
                self._settle(chunk)
        return list({id(g): g for g in touched if g.finished}.values())

    def _restore_failed(self, slots: frozenset[int]) -> None:
        """The runner refused this step's restores into `slots` (and emptied them, and any slot copied from them): the
        sequences there read their prompts from the start, reported as uncached, and the spilled entries go (their
        files too). Their chunks of this step were not read."""
        uncached: list[int] = []
        for group in self.running:
            for seq in group.seqs:
                if seq.slot in slots and seq.status is SeqStatus.RUNNING:
                    if group.cached_tokens and seq is group.seqs[0] and not group.preempted:
                        uncached.append(group.cached_tokens)
                        group.cached_tokens = 0
                    seq.num_computed = 0
        self.cache.restore_failed(slots, uncached)

    def _settle(self, chunk: ScheduledChunk) -> None:
        """A drafted chunk is verified: its sequence learns how its guesses did, and the cells of those that failed
        go."""
        seq = self._seqs.get(chunk.seq)
        if seq is None:
            return
        kept = max(0, seq.num_computed - chunk.start - 1)  # (-1: it failed before its first row was taken)
        running = seq.status is SeqStatus.RUNNING
        if seq.drafter is not None:
            seq.drafter.observe(kept, rejected=running and kept < chunk.drafted)
        if running and seq.slot is not None and seq.num_computed < chunk.start + len(chunk.tokens):
            self.cache.trim(seq.slot, seq.num_computed)

    def _rebeam(self, group: SequenceGroup, parents: list[int], tokens: list[int]) -> None:
        """Beam search moved on: new beam i continues beam parents[i] with tokens[i], held by the sequence
        beam_hosts names, which gets a copy of the parent's cells when it is not the parent's own."""
        seqs = group.seqs
        old = [(list(s.token_ids), s.num_computed) for s in seqs]
        host = beam_hosts(parents, len(seqs))
        for i, p in enumerate(parents):
            src, dst = seqs[p].slot, seqs[host[i]].slot
            if host[i] != p and src is not None and dst is not None:
                self.cache.copy(src, dst, old[p][1])
        for i, p in enumerate(parents):
            seq = seqs[host[i]]
            seq.token_ids = old[p][0] + [tokens[i]]
            seq.num_computed = old[p][1] if seq.slot is not None else 0

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        group = parent.group
        group.forked = True
        child.num_computed = group.prompt_len
        child.status = SeqStatus.RUNNING
        assert parent.slot is not None and child.slot is not None
        self.cache.copy(parent.slot, child.slot, group.prompt_len)
