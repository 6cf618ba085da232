"""LocalEngine: the engine thread, its step loop, and the bridge back to asyncio.

The loop runs on its own thread so HTTP stays responsive while the model computes (llama_decode
releases the GIL). Requests and aborts arrive through an inbox; each step's outputs go back to the requests'
asyncio queues through one loop.call_soon_threadsafe a step (a _Hop per event loop), not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from servelm.constrain.grammars import Grammars
from servelm.engine.base import AdapterInUse
from servelm.engine.choice import RequestState
from servelm.engine.clock import ENGINE_THREAD, PhaseClock, name_thread
from servelm.engine.output import Delivery, OutputProcessor, Outputs, StepResult
from servelm.engine.output import EngineError as EngineError  # the error a request fails with for the engine's reasons
from servelm.engine.pacing import StepPacer
from servelm.engine.plan import StepPlan
from servelm.engine.runner import ModelRunner, RestoreFailed
from servelm.engine.sampler import SampledStep, StepSampler
from servelm.engine.sampling import settle
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SequenceGroup
from servelm.engine.speculate import Speculator
from servelm.engine.spill import SpillStore
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, SamplingParams, adapter_scope
from servelm.errors import ApiError

log = logging.getLogger("servelm.engine")


_Item = tuple[str, "asyncio.Queue[Delivery]", Delivery]  # a delivery: the request's id, its queue, what goes in


class _Hop:
    """The bridge to one event loop. The engine thread leaves each step's deliveries in `pending` and wakes the loop
    once (call_soon_threadsafe: a self-pipe write and a wake-up), unless a hand-out it asked for has not run yet,
    which then takes them too; on the loop, the hand-out puts everything pending into its queue, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: deque[_Item] = deque()
        self.asked = False  # a hand-out is on the loop's way

    def send(self, items: list[_Item]) -> bool:
        """On the engine thread; False when the loop is closed (nothing will take them)."""
        self.pending.extend(items)
        # the hand-out clears `asked` before it empties `pending`: seen set here, it has not begun, and takes these
        if self.asked and not self.loop.is_closed():
            return True
        self.asked = True
        try:
            self.loop.call_soon_threadsafe(self._hand_out)
        except RuntimeError:  # the loop is closed
            self.pending.clear()
            return False
        return True

    def _hand_out(self) -> None:
        self.asked = False
        pending = self.pending
        while pending:
            _, queue, batch = pending.popleft()
            queue.put_nowait(batch)


@dataclass(eq=False)
class _Client:
    hop: _Hop
    queue: asyncio.Queue[Delivery]


@dataclass(eq=False)
class _Call:
    """Work for the engine thread between two steps (after the inbox's earlier requests and aborts)."""
    fn: Callable[[], None]
    done: Future[None] = field(default_factory=Future)

    def run(self) -> None:
        if self.done.set_running_or_notify_cancel():  # not run by its caller already (the thread had stopped)
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - the caller's to raise
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)


class LocalEngine:
    def __init__(self, runner: ModelRunner, *, prefix_cache: bool = True, grammars: Grammars | None = None,
                 speculative: bool = True, spill: SpillStore | None = None, pacer: StepPacer | None = None,
                 priority_aging_s: float = 60.0, fair_share: bool = True) -> None:
        self.runner = runner
        if hasattr(runner, "settle_readers"):  # it may free the memory a step's logits rows lie in: not while the
            runner.settle_readers = settle  # sampler's helper threads may still read them (sampling.by_rows)
        self.grammars = grammars
        self.pacer = pacer  # the scheduler asks it how much prompt a decoding step may read; each step teaches it
        speculator = Speculator(runner.call_cost_rows, runner.lone_row_from) if speculative else None
        self.scheduler = Scheduler(runner.num_slots, runner.context_window, runner.max_step_tokens,
                                   max_rows=runner.max_rows, tile_rows=runner.tile_rows, prefix_cache=prefix_cache,
                                   speculator=speculator,
                                   spill=spill, pacer=pacer, aging_s=priority_aging_s, fair_share=fair_share)
        self.clock = PhaseClock()  # the engine thread's time by phase (engine/clock.py)
        self.output = OutputProcessor(runner, grammars, self.clock)
        self.sampler = StepSampler(runner.vocab_size, runner.eog_ids, self.output.choices, grammars is not None,
                                   self.clock)
        self._inbox: deque[RequestState | str | _Call] = deque()  # a request to add, an abort's id, a call
        self._adapters: set[str] = set()  # the LoRA adapters loaded in the runner
        self._wake = threading.Event()
        self._clients: dict[str, _Client] = {}
        self._hops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hop] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.step_seconds = 0.0  # engine-thread time in steps with work: the loop's share outside the model
        self.forward_seconds = 0.0  # is 1 - forward_seconds / step_seconds (README: Python overhead)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            stopped = not self._thread.is_alive()
            self._thread = None
            if stopped:
                self._persist()

    def _persist(self) -> None:
        """At a stop, the prefix cache's entries go to the spill store's directory, if it has one: each slot at
        rest, then what is in RAM (a restarted server reads them back)."""
        self.scheduler.cache.persist(self.runner.save_seq)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def load_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter loaded into the runner (between two steps: the runner's own lock)."""
        self.runner.load_adapter(name, path)
        self._adapters.add(name)

    def free_adapter(self, name: str) -> None:
        """The adapter freed on the engine thread between two steps, once the aborts posted before are done;
        AdapterInUse while a request running or waiting here names it (it stays loaded)."""

        def free() -> None:
            if self.scheduler.names_adapter(name):
                raise AdapterInUse(f"the LoRA adapter {name!r} is named by scheduled work")
            self._adapters.discard(name)
            self.runner.free_adapter(name)

        self._between_steps(free)

    def _between_steps(self, fn: Callable[[], None]) -> None:
        """fn() on the engine thread between two steps (at once, here, when the thread does not run)."""
        if self._thread is None or threading.current_thread() is self._thread:
            fn()
            return
        call = _Call(fn)
        self._post(call)
        while True:
            try:
                call.done.result(timeout=1.0)
                return
            except TimeoutError:
                if not self.alive and call.done.cancel():  # the thread stopped before it took the call
                    fn()
                    return

    # -- the asyncio side -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        group = SequenceGroup(request.request_id, request.prompt_token_ids, request.params,
                              scope=adapter_scope(request.cache_scope, request.adapters),
                              pin_seconds=request.pin_seconds, media=request.media, priority=request.priority,
                              adapters=request.adapters, tenant=request.tenant)
        params = request.params
        if request.constraint is not None and self.grammars is None:
            raise EngineError("this engine was built without grammar support")
        state = self.output.prepare(request, group)
        loop = asyncio.get_running_loop()
        hop = self._hops.get(loop)
        if hop is None:
            hop = self._hops[loop] = _Hop(loop)
        client = _Client(hop, asyncio.Queue())
        self._clients[request.request_id] = client
        self._post(state)
        remaining = params.n if params.beam is not None else len(group.seqs)
        try:
            while remaining:
                batch = await client.queue.get()
                if isinstance(batch, ApiError):
                    raise batch
                for out in batch:
                    if out.finished:
                        remaining -= 1
                    yield out
        finally:
            self._clients.pop(request.request_id, None)
            if remaining:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._post(request_id)

    def check_params(self, params: SamplingParams) -> None:
        """Every parameter the service layer lets through runs here."""

    def stats(self) -> EngineStats:
        s, c = self.scheduler, self.scheduler.cache.stats()
        return EngineStats(
            running=s.num_running_seqs, waiting=s.num_waiting, kv_cells_used=s.kv_cells_used,
            kv_cells_cached=c.kv_cells_cached, kv_cells_total=s.kv_cells, kv_cell_bytes=self.runner.kv_cell_bytes,
            free_slots=c.free_slots, total_slots=s.num_slots, cache_hits=c.cache_hits,
            cached_tokens=c.cached_tokens, step_seconds=self.step_seconds, forward_seconds=self.forward_seconds,
            steps=self.steps, forward_calls=self.runner.forward_calls, phase_seconds=self.clock.seconds,
            draft_tokens=s.draft_tokens, draft_accepted=s.draft_accepted,
            spill_ram_bytes=c.spill_ram_bytes, spill_disk_bytes=c.spill_disk_bytes, spill_entries=c.spill_entries,
            spill_restored=c.spill_restored, spill_restore_failures=c.spill_restore_failures,
            preemptions=s.preemptions, resumed_tokens=c.resumed_tokens,
            tenants=s.share.stats(s.running, s.waiting),
        )

    def _post(self, item: RequestState | str | _Call) -> None:
        self._inbox.append(item)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        name_thread(ENGINE_THREAD)
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as exc:  # the forward pass itself (every request's), or a bug outside any one request
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineError(f"the engine failed: {exc}"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Call):
                item.run()
            elif isinstance(item, RequestState):
                missing = [n for n, _ in item.group.adapters if n not in self._adapters]
                if missing:  # never scheduled: a step with it would fail every request in it
                    self._send({item.group.request_id: EngineError(f"the LoRA adapters {missing} are not loaded")})
                    continue
                self.output.attach(item)
                self.scheduler.add(item.group)
            else:
                self._abort(item)

    def _abort(self, request_id: str) -> None:
        group = self.scheduler.abort(request_id)
        if group is not None:
            self.output.forget(group)

    def _step(self) -> None:
        """One step, a pipeline of values: plan → logits → sampled tokens → outputs and events → the scheduler's
        update → send."""
        start = time.perf_counter()
        clock = self.clock
        with clock.phase("loop"):
            plan = self.scheduler.schedule()
            if not plan.has_work:  # waiting requests that do not fit yet: let the inbox bring news
                with clock.phase("idle"):
                    self._wake.wait(0.005)
                    self._wake.clear()
                return
            plan, failed = self._encode_media(plan)
            plan, logits = self._forward(plan)
            with clock.phase("sample"):
                sampled = self.sampler.sample(plan, logits, failed)
            with clock.phase("output"):
                result = self.output.process(sampled)
            self._verify(plan, logits, sampled, result)
            for group in self.scheduler.update(plan, sampled, result):
                self.output.forget(group)
            with clock.phase("send"):
                self._send(result.outputs)
            took = time.perf_counter() - start
            self.step_seconds += took
            if self.pacer is not None:
                self.pacer.observe(plan.decode_tokens, plan.num_tokens - plan.decode_tokens, took)

    def _encode_media(self, plan: StepPlan) -> tuple[StepPlan, dict[str, Exception]]:
        """The step's image, encoded before the pass (the runner keeps its embeddings): should that fail, its
        request alone fails and its chunk leaves the plan."""
        failed: dict[str, Exception] = {}
        for chunk in plan.chunks:
            if chunk.media is not None and chunk.offset == 0:
                try:
                    self.runner.encode_media(chunk.media)
                except Exception as exc:  # one image must not fail the step's other requests
                    log.exception("an image of request %s failed to encode", self.output.request_id(chunk.seq))
                    failed[self.output.request_id(chunk.seq)] = exc
        if failed:
            plan = plan.without(lambda c: self.output.request_id(c.seq) not in failed)
        return plan, failed

    def _forward(self, plan: StepPlan) -> tuple[StepPlan, np.ndarray]:
        """The model's pass, and the plan it read; its failure is every request's in the step (_run fails them). A
        saved state the model refuses is its request's alone, and not even a failure: the step's KV operations are
        done by then, and its other chunks are read again without it (Scheduler.update has that request read its
        prompt instead)."""
        forward = time.perf_counter()
        decoding = self.runner.decode_seconds
        with self.clock.phase("runner"):
            try:
                logits = self.runner.step(plan)
            except RestoreFailed as exc:
                plan = StepPlan([c for c in plan.chunks if c.slot not in exc.slots], [], frozenset(exc.slots),
                            plan.decode_tokens)
                logits = self.runner.step(plan)
        self.clock.move(self.runner.decode_seconds - decoding, "runner", "decode")
        self.steps += 1
        self.forward_seconds += time.perf_counter() - forward
        return plan, logits

    def _verify(self, plan: StepPlan, logits: np.ndarray, sampled: SampledStep, result: StepResult) -> None:
        """The rows after each drafted chunk's guesses, sampled as the steps they stand for would have been (one row
        of each sequence at a time, its choice's state moved on by the token before): while the token drawn is the
        next guess, the sequence goes on to the following row (engine/speculate.py)."""
        drafted = [(c, r) for c, r in zip(plan.chunks, plan.rows()) if c.drafted]
        for j in range(1, plan.max_drafted + 1):
            due = [(c.seq, r + j) for c, r in drafted if sampled.held(c, j) and self.output.live(c.seq)]
            if not due:
                break
            with self.clock.phase("sample"):
                more = self.sampler.sample_rows(due, logits)
            sampled.extend(more)
            with self.clock.phase("output"):
                result.extend(self.output.process(more))

    def _send(self, outputs: Outputs) -> None:
        """The step's deliveries to their requests' queues: one hop per event loop (in practice one)."""
        by_hop: dict[_Hop, list[_Item]] = {}
        for request_id, batch in outputs.items():
            client = self._clients.get(request_id)
            if client is None:  # the client went away; its abort is on the way
                continue
            by_hop.setdefault(client.hop, []).append((request_id, client.queue, batch))
        for hop, items in by_hop.items():
            if not hop.send(items):  # its event loop is closed
                for request_id, _, _ in items:
                    self._abort(request_id)

    def _fail_all(self, exc: ApiError) -> None:
        groups = [*self.scheduler.running, *self.scheduler.waiting]
        for group in groups:
            self._abort(group.request_id)
        self._send({g.request_id: exc for g in groups})
