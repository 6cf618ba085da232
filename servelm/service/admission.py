"""Admission: a deployment's waiting queue, counted per caller, reserved at once when a request is let in.

A generation waits from the moment its request is admitted until its first output (its prompt read, or it has
a slot at least): that is what the bound limits, whatever the engine (servelm's, vLLM, Ray replicas). A request
reserves one place per generation it will run (a batch of legacy-completion prompts: one each), all or none,
in the event loop's own thread: the check and the count are one step, so simultaneous requests cannot all pass
a check made before any of them is counted. The places are given back as each generation starts, and whatever
is left when the request ends (finished, failed, abandoned before it started) is given back too.

Two bounds: the deployment's (`max_waiting`, 0 for none), and each caller's (an API key, or a client address
on a server without keys), so one caller cannot fill the queue for all.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing

from servelm.engine.base import Engine
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, SamplingParams
from servelm.errors import QueueFull


class WaitingQueue:
    def __init__(self) -> None:
        self.total = 0
        self.by_caller: dict[str, int] = {}
        # request id → the ticket holding its place; weak, so that a ticket nobody holds any more ends (and frees)
        self._owner: weakref.WeakValueDictionary[str, Ticket] = weakref.WeakValueDictionary()

    def reserve(self, caller: str, request_ids: Iterable[str], limit: int, caller_limit: int) -> Ticket:
        """Places for every one of the request's generations, or QueueFull (429) naming the bound that is full.
        A limit of 0 is no bound."""
        ids = list(request_ids)
        mine = self.by_caller.get(caller, 0)
        if limit and self.total + len(ids) > limit:
            raise QueueFull(self.total, f"The deployment's queue is full ({self.total} requests waiting)")
        if caller_limit and mine + len(ids) > caller_limit:
            raise QueueFull(mine, f"Your requests already wait for {mine} places in this deployment's queue, and "
                            f"one caller may hold {caller_limit}")
        ticket = Ticket(self, caller, set(ids))
        self.total += len(ids)
        self.by_caller[caller] = mine + len(ids)
        for rid in ids:
            self._owner[rid] = ticket
        return ticket

    def started(self, request_id: str) -> None:
        """The generation has its first output: its place is free."""
        ticket = self._owner.pop(request_id, None)
        if ticket is not None:
            ticket.leave([request_id])

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


class Ticket:
    """The places one request holds. release() (or the ticket's end, should a stream never start) gives back
    what is left."""

    def __init__(self, queue: WaitingQueue, caller: str, request_ids: set[str]) -> None:
        self._queue = queue
        self._caller = caller
        self._ids = request_ids

    def leave(self, request_ids: Iterable[str]) -> None:
        gone = self._ids.intersection(request_ids)
        if gone:
            self._ids -= gone
            self._queue._give_back(self._caller, len(gone))

    def release(self) -> None:
        ids, self._ids = self._ids, set()
        if ids:
            self._queue._forget(ids)
            self._queue._give_back(self._caller, len(ids))

    def __del__(self) -> None:  # a streamed response dropped before its body started never runs its finally
        self.release()


class QueuedEngine:
    """An Engine that frees a generation's place in the waiting queue at its first output."""

    def __init__(self, inner: Engine, queue: WaitingQueue) -> None:
        self.inner = inner
        self.queue = queue

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        waiting = True
        try:
            async with aclosing(self.inner.generate(request)) as outputs:
                async for out in outputs:
                    if waiting:
                        waiting = False
                        self.queue.started(request.request_id)
                    yield out
        finally:
            if waiting:
                self.queue.started(request.request_id)  # failed or cancelled before its first output

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def check_params(self, params: SamplingParams) -> None:
        self.inner.check_params(params)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    @property
    def alive(self) -> bool:  # /health and /ping ask
        return self.inner.alive
