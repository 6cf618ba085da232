"""Who goes next: a waiting request's rank (its priority and its age), who gives a slot up to it or holds back for it,
and each tenant's fair share of the slots.

Rank. A waiting request stands at its priority (lower first, vLLM's) less one level for every `aging_s` seconds since
the engine received it, then its priority, then arrival. As the age counts from receipt, two requests compare the
same at every moment, and a low priority still runs once it has waited long enough. Aging counts a priority within
±AGING_SPAN (one further out breaks ties only), so it makes up at most 2 × AGING_SPAN levels: nothing received more
than that many `aging_s` after a request ranks above it, however urgent.

Fair share. A tenant (engine.types.Tenant: an API key, or a client's address on a server without keys) with work
waiting or running has an account of the service it got: the tokens the engine computed for it, divided by its
weight (virtual token counters, as in Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). A
request's prompt is charged when it takes a slot (what the prefix cache held is not charged; a preempted request
resuming is not charged again), and each token its sequences draw as it is drawn. When slots are free, the next one
goes to the best-ranked request of the tenant served least, among the requests of the best-ranked request's own
priority that were received up to one level (`aging_s`) after it; a tie goes to the tenant holding fewer slots, then
to rank. So:
- a burst from one tenant takes turns with the others' requests, and a lone request from another tenant gets the
  next slot that frees;
- priorities order work across tenants as within one: fairness reorders only requests of one priority, and never
  puts a request ahead of one received more than `aging_s` before it (without aging, `aging_s` 0, it reorders
  within a priority freely);
- a tenant with nothing waiting or running is forgotten, and comes back level with the least served tenant that has
  work: no credit for its idle time, no debt for what it got earlier (and the accounts' memory follows the work in
  flight);
- a tenant's sequences hold at most ceil(max_share × slots) slots (at least one) at once; its requests past that
  wait, even while a slot is free (a request of more choices than that goes while the tenant holds none).

Work that yields. The decoding rows of requests of a priority above 0 (less urgent than the default: a batch's lines,
at --batch-priority) fill a step only up to the rows the inter-token target holds beside the others' (at least one
of them a step, so that it always moves on; those that waited longest since their last row first), so that a request
of the default priority decodes beside them within the target, and one arriving waits about one target for the step
in flight (with nothing else running or waiting, they all decode together: engine/scheduler.py). And when one
tenant alone has work, none of it yielding (`alone`), the scheduler may read its burst of short prompts at once:
nobody else's token waits on it.

Priorities also decide who gives a slot up (`victims`: running requests of a lower priority ranked below a waiting
one that finds no slot) and who holds back a step while a more urgent prompt is read (`urgent`); preemption goes by
priority alone, not by service. No order changes an answer: a row's logits do not depend on its step
(docs/exactness.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from servelm.engine.sequence import Sequence, SequenceGroup
from servelm.engine.types import Tenant, TenantStats

AGING_SPAN = 10  # the priorities aging tells apart: -10..10 (a priority further out ages as the nearer end)
MAX_LABELS = 64  # tenants /metrics names one by one; any more are counted together as OTHER
OTHER = "other"
SERVER = "server"  # the label of the server's own work (Tenant.id "")

Rank = tuple[float, int, int]


@dataclass(eq=False)
class _Account:
    tenant: Tenant
    served: float  # tokens computed for it, divided by its weight, since it last came (level with the least then)
    groups: int = 0  # its requests waiting or running


class FairShare:
    """The waiting requests' rank and admission order, and the tenants' accounts (the scheduler tells it of each
    request that comes and goes, and of the tokens computed for it)."""

    def __init__(self, num_slots: int, aging_s: float = 60.0, *, enabled: bool = True) -> None:
        self.num_slots = num_slots
        self.aging_s = aging_s  # waiting this long counts as one priority level (0: no aging)
        self.enabled = enabled  # False: admission in rank order alone (each tenant's cap still holds)
        self._accounts: dict[str, _Account] = {}  # by Tenant.id: the tenants with work
        self._tokens: dict[str, int] = {}  # by label: tokens computed since start (MAX_LABELS labels at most)

    def rank(self, group: SequenceGroup) -> Rank:
        """Where a request stands: lower first. Its priority (within ±AGING_SPAN) less its age in levels
        (now - received) / aging_s; `now` is the same for all, so the time it was received stands for it. Then its
        priority itself, then arrival. The priority is never a float: any integer compares."""
        if self.aging_s <= 0:
            return (0.0, group.priority, group.arrival)
        level = min(max(group.priority, -AGING_SPAN), AGING_SPAN)
        return (level + group.received_at / self.aging_s, group.priority, group.arrival)

    def holds_back(self, group: SequenceGroup, urgent: SequenceGroup | None) -> bool:
        """Whether `group` gives its rows up this step to the urgent prompt (engine/scheduler.py: _urgent_reader)."""
        return urgent is not None and group.priority > urgent.priority and self.rank(group) > self.rank(urgent)

    @staticmethod
    def yields(group: SequenceGroup) -> bool:
        """Whether its work keeps every step within the target: a priority less urgent than the default (0)."""
        return group.priority > 0

    def alone(self, running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup]) -> bool:
        """Whether one tenant alone has work (running or waiting), none of it yielding: its burst may then be read
        together (engine/scheduler.py), costing nobody else's next token or first token."""
        first: str | None = None
        for group in (*running, *waiting):
            if self.yields(group) or (first is not None and group.tenant.id != first):
                return False
            first = group.tenant.id
        return True

    def rows(self, decoding: list[Sequence], most: int | None) -> list[Sequence]:
        """Of the sequences with a token to decode, those that get their row this step: all, but that the ones that
        yield fill only what is left of `most` rows (at least one of them), longest waiting first."""
        if most is None or len(decoding) <= most:
            return decoding
        keep = [s for s in decoding if not self.yields(s.group)]
        rest = [s for s in decoding if self.yields(s.group)]
        room = max(1, most - len(keep))
        if room >= len(rest):
            return decoding
        rest.sort(key=lambda s: (s.last_row, s.group.arrival))
        return keep + rest[:room]

    def victims(self, waiting: Collection[SequenceGroup], running: list[SequenceGroup], free: int) -> list[SequenceGroup]:
        """The running requests that give their slots up before a step, worst first: while the best-ranked waiting
        requests find no slot at rest (`free` of them), running ones of a lower priority ranked below them, when
        that makes room (engine/scheduler.py suspends them)."""
        taken: list[SequenceGroup] = []
        idle = free
        for group in sorted(waiting, key=self.rank):
            need = len(group.live)
            if need <= idle:
                idle -= need
                continue
            rank = self.rank(group)
            below = sorted((g for g in running if g not in taken and g.preemptible and g.priority > group.priority
                            and self.rank(g) > rank), key=self.rank, reverse=True)
            freed, mine = idle, []
            for victim in below:
                if freed >= need:
                    break
                mine.append(victim)
                freed += 1
            if freed < need:
                break  # nothing ranked below it holds enough; the ones behind rank lower still
            taken += mine
            idle = freed - need
        return taken

    def urgent(self, running: list[SequenceGroup], waiting: deque[SequenceGroup], free: int) -> SequenceGroup | None:
        """The best-ranked of the requests that read a prompt now (running ones not through theirs, and the
        best-ranked waiting one when enough slots rest for it), when running ones of a lower priority that rank below
        it run beside it: those hold back (no row this step), and waiting ones below it are not admitted, until it
        is read, so a request's first token comes as soon as it would on an idle engine. None: no one holds back.
        Holding back changes no answer (a row's logits do not depend on its step). A request that has waited long
        enough to outrank it does not hold back."""
        readers = [g for g in running if any(s.reads_prompt for s in g.seqs)]
        if waiting and len(waiting[0].live) <= free:  # (one that cannot fit holds no one)
            readers.append(waiting[0])
        if not readers:
            return None
        first = min(readers, key=self.rank)
        return first if any(self.holds_back(g, first) for g in running) else None

    @staticmethod
    def may_overtake(head: SequenceGroup, running: Iterable[SequenceGroup], free: int) -> bool:
        """Whether groups behind a head that does not fit may go first: only while it could not fit even if every
        group admitted after it gave its slots back (they take nothing it could use; once it could fit without
        them, nothing overtakes it any more)."""
        slots = free
        for g in running:
            if g.arrival > head.arrival:
                slots += sum(1 for s in g.seqs if s.holds_slot)
        return len(head.live) > slots

    def cap(self, tenant: Tenant) -> int:
        """The slots a tenant's sequences may hold at once."""
        return max(1, math.ceil(tenant.max_share * self.num_slots - 1e-9))

    # -- accounts ----------------------------------------------------------------------------------
    def joined(self, group: SequenceGroup) -> None:
        """A request came: its tenant's account, opened level with the least served one when it had no work."""
        account = self._accounts.get(group.tenant.id)
        if account is None:
            least = min((a.served for a in self._accounts.values()), default=0.0)
            account = self._accounts[group.tenant.id] = _Account(group.tenant, least)
        account.groups += 1

    def left(self, group: SequenceGroup) -> None:
        """A request ended (finished, failed or aborted, waiting or running): a tenant with no more work is forgotten."""
        account = self._accounts.get(group.tenant.id)
        if account is not None:
            account.groups -= 1
            if account.groups <= 0:
                del self._accounts[group.tenant.id]

    def charge(self, group: SequenceGroup, tokens: int) -> None:
        """Tokens the engine computed for the request's tenant."""
        if tokens <= 0:
            return
        account = self._accounts.get(group.tenant.id)
        if account is not None:
            account.served += tokens / account.tenant.weight
        label = self._label(group.tenant)
        self._tokens[label] = self._tokens.get(label, 0) + tokens

    def _label(self, tenant: Tenant) -> str:
        label = tenant.label or tenant.id or SERVER
        return label if label in self._tokens or len(self._tokens) < MAX_LABELS else OTHER

    # -- the order ---------------------------------------------------------------------------------
    def order(self, waiting: Collection[SequenceGroup], running: Iterable[SequenceGroup]) -> Iterator[SequenceGroup]:
        """The waiting requests (in rank order) in the order they take the free slots, each tenant within its cap.
        Lazy: the accounts are read at each pick, so a prompt charged as its request takes a slot counts for the
        next pick of the same step. What it yields and the caller does not admit only makes the caps stricter for
        the rest of the step."""
        held: dict[str, int] = {}
        for group in running:
            held[group.tenant.id] = held.get(group.tenant.id, 0) + sum(1 for s in group.seqs if s.holds_slot)
        capped = any(g.tenant.max_share < 1 for g in waiting)
        if not capped and (not self.enabled or len(self._accounts) < 2):
            yield from list(waiting)  # (a copy: the caller removes what it admits)
            return
        ranks = {id(g): self.rank(g) for g in waiting}
        queues: dict[str, deque[SequenceGroup]] = {}
        for group in waiting:
            queues.setdefault(group.tenant.id, deque()).append(group)
        while queues:
            for tid in [t for t, q in queues.items() if not self._room(q[0].tenant, held.get(t, 0), 1)]:
                del queues[tid]  # at its cap: nothing more of it this step
            if not queues:
                return
            pick = self._pick(queues, ranks, held)
            if pick is None:
                return
            tid = pick.tenant.id
            queues[tid].remove(pick)
            if not queues[tid]:
                del queues[tid]
            held[tid] = held.get(tid, 0) + len(pick.live)
            yield pick

    def _room(self, tenant: Tenant, held: int, need: int) -> bool:
        return held == 0 or held + need <= self.cap(tenant)

    def _pick(self, queues: dict[str, deque[SequenceGroup]], ranks: dict[int, Rank],
              held: dict[str, int]) -> SequenceGroup | None:
        """The next request: the best-ranked one, or (fair) the best-ranked request of its priority within a level
        of it of the tenant served least (then holding fewer slots), each within its tenant's cap."""
        heads = [g for g in (self._first(q, held) for q in queues.values()) if g is not None]
        if not heads:
            return None
        best = min(heads, key=lambda g: ranks[id(g)])
        if not self.enabled:
            return best
        priority, within = best.priority, ranks[id(best)][0] + 1
        pick, key = best, (self._served(best), held.get(best.tenant.id, 0), ranks[id(best)])
        for queue in queues.values():
            for group in queue:
                if ranks[id(group)][0] >= within:
                    break
                if group.priority == priority and self._room(group.tenant, held.get(group.tenant.id, 0), len(group.live)):
                    mine = (self._served(group), held.get(group.tenant.id, 0), ranks[id(group)])
                    if mine < key:
                        pick, key = group, mine
                    break  # its tenant's best-ranked candidate
        return pick

    def _first(self, queue: deque[SequenceGroup], held: dict[str, int]) -> SequenceGroup | None:
        """A tenant's best-ranked request that its cap lets in now."""
        return next((g for g in queue if self._room(g.tenant, held.get(g.tenant.id, 0), len(g.live))), None)

    def _served(self, group: SequenceGroup) -> float:
        account = self._accounts.get(group.tenant.id)
        return account.served if account is not None else 0.0

    # -- the report ----------------------------------------------------------------------------------
    def stats(self, running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup]) -> tuple[TenantStats, ...]:
        """Each tenant's slots, waiting requests and tokens (read from another thread: from copies)."""
        tokens = dict(self._tokens)
        slots: dict[str, int] = {}
        waits: dict[str, int] = {}
        for group in list(running):
            label = self._label(group.tenant)
            slots[label] = slots.get(label, 0) + sum(1 for s in group.seqs if s.holds_slot)
        for group in list(waiting):
            label = self._label(group.tenant)
            waits[label] = waits.get(label, 0) + 1
        return tuple(TenantStats(label, slots.get(label, 0), waits.get(label, 0), tokens.get(label, 0))
                     for label in sorted({*slots, *waits, *tokens}))
