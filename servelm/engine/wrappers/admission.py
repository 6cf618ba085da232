"""Admission: a deployment's waiting queue, counted per caller, reserved at once when a request is let in.

A generation waits from the moment its request is admitted until its first output (its prompt read, or it has
a slot at least): that is what the bound limits, whatever the engine (servelm's, vLLM, Ray replicas). A request
reserves one place per generation it will run (a batch of legacy-completion prompts: one each), all or none,
in the event loop's own thread: the check and the count are one step, so simultaneous requests cannot all pass
a check made before any of them is counted. The places are given back as each generation starts, and whatever
is left when the request ends (finished, failed, abandoned before it started) is given back too.

The same Admission settles the request's token charge (a key's tokens per minute, reserved for max_tokens of
every sequence): QueuedEngine counts the tokens its generations make as they come out of the engine, whatever the
API's answer calls them, and closing the admission gives back the part of the reservation they did not use.

Two bounds: the deployment's (`max_waiting`, 0 for none), and each caller's (an API key, or a client address
on a server without keys), so one caller cannot fill the queue for all.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from typing import Protocol

from servelm.engine.base import Engine, EngineWrapper
from servelm.engine.types import GenerationOutput, GenerationRequest
from servelm.errors import QueueFull


class Charge(Protocol):
    """A token charge reserved for a request's completion tokens (http/ratelimit.py's)."""

    def settle(self, completion_tokens: int) -> None:
        """The request made this many: the rest of the reservation goes back, once."""
        ...


class WaitingQueue:
    def __init__(self) -> None:
        self.total = 0
        self.by_caller: dict[str, int] = {}
        # generation id → the admission holding it; weak, so that an admission nobody holds any more ends (and frees)
        self._owner: weakref.WeakValueDictionary[str, Admission] = weakref.WeakValueDictionary()

    def reserve(self, caller: str, request_ids: Iterable[str], limit: int, caller_limit: int,
                charge: Charge | None = None) -> Admission:
        """Places for every one of the request's generations, or QueueFull (429) naming the bound that is full.
        A limit of 0 is no bound."""
        ids = list(request_ids)
        mine = self.by_caller.get(caller, 0)
        if limit and self.total + len(ids) > limit:
            raise QueueFull(self.total, f"The deployment's queue is full ({self.total} requests waiting)")
        if caller_limit and mine + len(ids) > caller_limit:
            raise QueueFull(mine, f"Your requests already wait for {mine} places in this deployment's queue, and "
                            f"one caller may hold {caller_limit}")
        admission = Admission(self, caller, set(ids), charge)
        self.total += len(ids)
        self.by_caller[caller] = mine + len(ids)
        for rid in ids:
            self._owner[rid] = admission
        return admission

    def output(self, out: GenerationOutput) -> None:
        """A generation's output: its place is free from its first, and its tokens count toward its charge."""
        admission = self._owner.get(out.request_id)
        if admission is not None:
            admission.count(out)
            admission.leave([out.request_id])

    def follow(self, before: Iterable[str], after: Iterable[str]) -> None:
        """A request's next generations (a response's next turn, after its tool calls ran) take the places of its
        earlier ones, which are over: they wait in the same admission and their tokens count toward its charge. A
        running request's next turn is never refused, so no bound is checked."""
        admission = next((a for a in map(self._owner.get, before) if a is not None), None)
        if admission is None:
            return
        admission.leave(before)
        ids = [rid for rid in after if rid not in self._owner]
        admission.join(ids)
        self.total += len(ids)
        self.by_caller[admission.caller] = self.by_caller.get(admission.caller, 0) + len(ids)
        for rid in ids:
            self._owner[rid] = admission

    def ended(self, request_id: str) -> None:
        """The generation ended (done, failed or cancelled): its place is free."""
        admission = self._owner.get(request_id)
        if admission is not None:
            admission.leave([request_id])

    def _give_back(self, caller: str, n: int) -> None:
        self.total -= n
        left = self.by_caller.get(caller, 0) - n
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)

    def _forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._owner.pop(rid, None)


class Admission:
    """A generating request let in: the places it holds in its deployment's queue, the tokens its generations have
    made, and its token charge. close() (or the admission's end, should a stream never start) gives back the places
    left and settles the charge with the tokens made."""

    def __init__(self, queue: WaitingQueue, caller: str, request_ids: set[str], charge: Charge | None = None) -> None:
        self._queue = queue
        self.caller = caller
        self._ids = request_ids  # the generations still waiting for their first output
        self._all = set(request_ids)
        self._charge = charge
        self._made: dict[tuple[str, int], int] = {}  # (generation, choice) → its completion tokens so far

    @property
    def generated(self) -> int:
        return sum(self._made.values())

    def count(self, out: GenerationOutput) -> None:
        key = (out.request_id, out.index)
        self._made[key] = max(self._made.get(key, 0), out.completion_tokens)

    def join(self, request_ids: Iterable[str]) -> None:
        """More generations of the request (WaitingQueue.follow counts their places)."""
        self._ids.update(request_ids)
        self._all.update(request_ids)

    def leave(self, request_ids: Iterable[str]) -> None:
        gone = self._ids.intersection(request_ids)
        if gone:
            self._ids -= gone
            self._queue._give_back(self.caller, len(gone))

    def close(self) -> None:
        """The request is over: its places are free, and its charge is settled with the tokens it made."""
        ids, self._ids = self._ids, set()
        if ids:
            self._queue._give_back(self.caller, len(ids))
        self._queue._forget(self._all)
        charge, self._charge = self._charge, None
        if charge is not None:
            charge.settle(self.generated)

    def __del__(self) -> None:  # a streamed response dropped before its body started never runs its finally
        self.close()


class QueuedEngine(EngineWrapper):
    """An Engine that tells the waiting queue of each generation's outputs (its place is free at the first; its
    tokens count toward its request's charge) and of its end."""

    def __init__(self, inner: Engine, queue: WaitingQueue) -> None:
        super().__init__(inner)
        self.queue = queue

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        try:
            async with aclosing(self.inner.generate(request)) as outputs:
                async for out in outputs:
                    self.queue.output(out)
                    yield out
        finally:
            self.queue.ended(request.request_id)  # done, failed or cancelled (before its first output, too)
