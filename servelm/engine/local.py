"""LocalEngine: the engine thread, its step loop, and the bridge back to asyncio.

The loop runs on its own thread so HTTP stays responsive while the model computes (llama_decode
releases the GIL). Requests and aborts arrive through an inbox; each step's outputs go back to each
request's asyncio queue with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servelm.constrain.grammars import Grammars
from servelm.engine.output import OutputProcessor, Outputs
from servelm.engine.plan import StepPlan
from servelm.engine.sampling import pick_rows, process_rows, token_logprobs
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SeqStatus, Sequence, SequenceGroup
from servelm.engine.speculate import Speculator
from servelm.engine.spill import SpillStore
from servelm.engine.types import EngineStats, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from servelm.errors import ApiError, ServerError
from servelm.runners.base import ModelRunner, RestoreFailed

log = logging.getLogger("servelm.engine")


class EngineError(ServerError, RuntimeError):
    """The engine could not finish a request for a reason of its own (not the client's): a 500 in the envelope."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_error")


@dataclass(eq=False)
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


class LocalEngine:
    def __init__(self, runner: ModelRunner, *, prefix_cache: bool = True, grammars: Grammars | None = None,
                 speculative: bool = True, spill: SpillStore | None = None) -> None:
        self.runner = runner
        self.grammars = grammars
        speculator = Speculator(runner.call_cost_rows, runner.lone_row_from) if speculative else None
        self.scheduler = Scheduler(runner.num_slots, runner.context_window, runner.max_step_tokens,
                                   max_rows=runner.max_rows, prefix_cache=prefix_cache, speculator=speculator,
                                   spill=spill)
        self.output = OutputProcessor(runner, self.scheduler, grammars)
        self._inbox: deque[SequenceGroup | str] = deque()  # a group to add, or the id of a request to abort
        self._wake = threading.Event()
        self._clients: dict[str, _Client] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.step_seconds = 0.0  # engine-thread time in steps with work: the loop's share outside the model
        self.forward_seconds = 0.0  # is 1 - forward_seconds / step_seconds (README: Python overhead)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)
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
        spill = self.scheduler.spill
        if spill is None or spill.directory is None:
            return
        spill.settle()
        for slot in self.scheduler.slots.slots:
            if slot.seq is None and spill.wants(slot.cached, slot.scope):
                try:
                    spill.persist(slot.cached, slot.scope, self.runner.save_seq(slot.index))
                except Exception:  # one slot's state must not keep the others from disk
                    log.exception("the prefix cache entry of slot %d was not saved", slot.index)
        spill.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the asyncio side -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        group = SequenceGroup(request.request_id, request.prompt_token_ids, request.params, scope=request.cache_scope,
                              pin_seconds=request.pin_seconds, media=request.media)
        params = request.params
        if request.constraint is not None and self.grammars is None:
            raise EngineError("this engine was built without grammar support")
        self.output.attach(request, group)
        client = _Client(asyncio.get_running_loop(), asyncio.Queue())
        self._clients[request.request_id] = client
        self._post(group)
        remaining = params.n if params.beam is not None else len(group.seqs)
        try:
            while remaining:
                batch = await client.queue.get()
                if isinstance(batch, BaseException):
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
        s = self.scheduler
        return EngineStats(
            running=s.num_running_seqs, waiting=s.num_waiting, kv_cells_used=s.kv_cells_used,
            kv_cells_cached=s.kv_cells_cached, kv_cells_total=s.kv_cells, kv_cell_bytes=self.runner.kv_cell_bytes,
            free_slots=len(s.free_slots), total_slots=s.num_slots, cache_hits=s.cache_hits,
            cached_tokens=s.cached_tokens, step_seconds=self.step_seconds, forward_seconds=self.forward_seconds,
            steps=self.steps, forward_calls=self.runner.forward_calls, draft_tokens=s.draft_tokens,
            draft_accepted=s.draft_accepted,
            spill_ram_bytes=s.spill.ram_used if s.spill else 0, spill_disk_bytes=s.spill.disk_used if s.spill else 0,
            spill_entries=len(s.spill.entries) if s.spill else 0, spill_restored=s.spill.restored if s.spill else 0,
            spill_restore_failures=s.spill.restore_failures if s.spill else 0,
        )

    def _post(self, item: SequenceGroup | str) -> None:
        self._inbox.append(item)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
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
            if isinstance(item, SequenceGroup):
                self.scheduler.add(item)
            else:
                self.scheduler.abort(item)

    def _step(self) -> None:
        """One recipe: plan → forward pass → sample → schedule's update → outputs → send."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.has_work:  # waiting requests that do not fit yet: let the inbox bring news
            self._wake.wait(0.005)
            self._wake.clear()
            return
        outputs: Outputs = {}
        self._encode_media(plan, outputs)
        logits, rows = self._forward(plan), plan.rows()
        self._prompt_logprobs(plan, logits, rows, outputs)
        samplers, processed, tokens, beams = self._sample(plan, logits, rows, outputs)
        self.scheduler.update(plan, dict(zip(samplers, tokens)))
        self._record(samplers, processed, tokens, beams, outputs)
        self._verify(plan, logits, rows, outputs)
        self._send(outputs)
        self.step_seconds += time.perf_counter() - start

    def _encode_media(self, plan: StepPlan, outputs: Outputs) -> None:
        """The step's image, encoded before the pass (the runner keeps its embeddings): should that fail, its
        request alone fails and leaves the plan."""
        for chunk in plan.chunks:
            if chunk.media is not None and chunk.offset == 0:
                self._contain(chunk.seq.group, outputs, self.runner.encode_media, chunk.media)
        if outputs:
            plan.chunks = [c for c in plan.chunks if c.seq.status is not SeqStatus.FINISHED]

    def _forward(self, plan: StepPlan) -> np.ndarray:
        """The model's pass; its failure is every request's in the step (_run fails them). A saved state the model
        refuses is its request's alone, and not even a failure: that request reads its prompt instead, and the
        step's other chunks are read as planned (the step's KV operations are done by then)."""
        forward = time.perf_counter()
        try:
            logits = self.runner.step(plan)
        except RestoreFailed as exc:
            reset = self.scheduler.restore_failed(exc.slots)
            plan.chunks = [c for c in plan.chunks if c.seq not in reset]
            plan.ops = []
            logits = self.runner.step(plan)
        self.steps += 1
        self.forward_seconds += time.perf_counter() - forward
        return logits

    def _record(self, samplers: list[Sequence], processed: np.ndarray, tokens: list[int],
                beams: dict[SequenceGroup, np.ndarray], outputs: Outputs) -> None:
        """Each sampled token (with its logprobs) and each beam step, through the output processor."""
        entries = self._token_logprobs(samplers, processed, tokens, outputs)
        for seq, token, entry in zip(samplers, tokens, entries):
            if seq.status is not SeqStatus.FINISHED:
                self._contain(seq.group, outputs, self.output.advance, seq, int(token), entry, outputs)
        for group, group_rows in beams.items():
            self._contain(group, outputs, self.output.beam_step, group, group_rows, outputs)

    # -- containment: one request's failure is its own --------------------------------------------
    def _contain(self, group: SequenceGroup, outputs: Outputs, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) for one request; if it raises, that request alone fails (its sequences freed, its client
        told) and the step goes on for every other. Returns fn's result, or None after a failure."""
        try:
            return fn(*args)
        except Exception as exc:  # a bug or a pathological input in one request must not fail its neighbours
            log.exception("request %s failed in the engine; the others go on", group.request_id)
            self._fail(group, exc, outputs)
            return None

    def _fail(self, group: SequenceGroup, exc: BaseException, outputs: Outputs) -> None:
        self.scheduler.abort(group.request_id)
        if not isinstance(exc, ApiError):
            exc = EngineError(f"the engine failed on this request: {type(exc).__name__}: {exc}")
        outputs[group.request_id] = exc  # replaces what the request had this step: only the error goes out

    def _each(self, seqs: list[Sequence], outputs: Outputs, fn: Callable[[list[int]], list[Any]]) -> list[Any]:
        """fn(indices) → one result per index, for every row at once; should that raise, row by row, so that only
        the requests whose own rows raise fail (their results None)."""
        try:
            return fn(list(range(len(seqs))))
        except Exception:
            log.warning("a batched sampling step raised; isolating the request at fault", exc_info=True)
        out = []
        for i, seq in enumerate(seqs):
            one = self._contain(seq.group, outputs, fn, [i])
            out.append(None if one is None else one[0])
        return out

    def _sample(self, plan: StepPlan, logits: np.ndarray, rows: list[int], outputs: Outputs) -> tuple[
        list[Sequence], np.ndarray, list[int], dict[SequenceGroup, np.ndarray]
    ]:
        """Process every sampler's row; draw for the plain ones; hand beam-search rows back by group. A request
        whose row cannot be processed or drawn from fails alone."""
        picks: list[int] = []
        samplers: list[Sequence] = []
        for chunk, r in zip(plan.chunks, rows):
            for seq in chunk.samplers:
                picks.append(r)
                samplers.append(seq)
        return self._sample_rows(samplers, picks, logits, outputs)

    def _sample_rows(self, samplers: list[Sequence], picks: list[int], logits: np.ndarray, outputs: Outputs) -> tuple[
        list[Sequence], np.ndarray, list[int], dict[SequenceGroup, np.ndarray]
    ]:
        """_sample for the given rows (picks[i] is samplers[i]'s)."""
        if not samplers:
            return [], logits[:0], [], {}
        picked = logits[np.asarray(picks)]  # a copy we may modify
        alone = False  # set once processing every row at once has raised: rows are then redone one by one

        def process(idx: list[int]) -> list[bool]:
            nonlocal alone
            view = picked
            if alone:
                picked[idx[0]] = logits[picks[idx[0]]]  # the batched attempt may have half-processed it
                view = picked[idx[0] : idx[0] + 1]
            alone = True
            chosen = [samplers[i] for i in idx]
            process_rows(view, [s.state.sampler for s in chosen], self.output.eog, self.output.masks(chosen))
            return [True] * len(idx)

        self._each(samplers, outputs, process)
        live = [i for i, s in enumerate(samplers) if s.status is not SeqStatus.FINISHED]
        beams: dict[SequenceGroup, np.ndarray] = {}
        for i in live:
            s = samplers[i]
            search = s.state.beam
            if search is not None:
                # beams recomputed after a preemption may finish reading in different steps: a beam step
                # waits for every beam's row
                search.rows[s.index] = picked[i].copy()
                if len(search.rows) == search.width:
                    beams[s.group] = np.stack([search.rows.pop(j) for j in range(search.width)])
        plain = [i for i in live if samplers[i].state.beam is None]
        if len(plain) < len(samplers):
            picked, samplers = picked[plain], [samplers[i] for i in plain]
        if not samplers:
            return [], picked, [], beams
        drawn = self._each(samplers, outputs, lambda idx: pick_rows(
            picked[idx], [samplers[i].state.sampler for i in idx]).tolist())
        ok = [i for i, t in enumerate(drawn) if t is not None]
        if len(ok) < len(samplers):
            picked, samplers, drawn = picked[ok], [samplers[i] for i in ok], [drawn[i] for i in ok]
        return samplers, picked, drawn, beams

    def _verify(self, plan: StepPlan, logits: np.ndarray, rows: list[int], outputs: Outputs) -> None:
        """The rows after each drafted chunk's guesses, sampled as the steps they stand for would have been (one row
        of each sequence at a time, its state moved on by the token before): while the token drawn is the next
        guess, the sequence goes on to the following row (engine/speculate.py)."""
        drafted = [(c, r) for c, r in zip(plan.chunks, rows) if c.drafted]
        if not drafted:
            return
        for j in range(1, max(c.drafted for c, _ in drafted) + 1):
            due = [(c, r) for c, r in drafted if self.scheduler.verifies(c, j)]
            if not due:
                break
            samplers, processed, tokens, _ = self._sample_rows([c.seq for c, _ in due], [r + j for _, r in due],
                                                               logits, outputs)
            for seq, token in zip(samplers, tokens):
                self.scheduler.accept(seq, token)
            self._record(samplers, processed, tokens, {}, outputs)
        for chunk, _ in drafted:
            self.scheduler.settle(chunk)

    def _token_logprobs(self, samplers: list[Sequence], rows: np.ndarray, tokens: list[int],
                        outputs: Outputs) -> list[TokenLogprob | None]:
        """Logprob entries for the rows that report them or rank best_of samples, from the processed rows."""
        want = [i for i, s in enumerate(samplers) if s.group.params.wants_cumulative]
        out: list[TokenLogprob | None] = [None] * len(samplers)
        if want:
            seqs = [samplers[i] for i in want]
            entries = self._each(seqs, outputs, lambda idx: token_logprobs(
                rows[[want[j] for j in idx]], [tokens[want[j]] for j in idx], [seqs[j].group.params.logprobs for j in idx]))
            for i, e in zip(want, entries):
                out[i] = e
        return out

    def _prompt_logprobs(self, plan: StepPlan, logits: np.ndarray, rows: list[int], outputs: Outputs) -> None:
        """Chunks that read a prompt for its logprobs: each row scores the prompt's next token (raw model)."""
        for chunk, last in zip(plan.chunks, rows):
            if chunk.all_logits and chunk.seq.state.prompt_logprobs is not None:
                self._contain(chunk.seq.group, outputs, self.output.score_prompt, chunk, logits, last)

    def _send(self, outputs: Outputs) -> None:
        for request_id, batch in outputs.items():
            client = self._clients.get(request_id)
            if client is None:  # the client went away; its abort is on the way
                continue
            try:
                client.loop.call_soon_threadsafe(client.queue.put_nowait, batch)
            except RuntimeError:  # its event loop is closed
                self.scheduler.abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        groups = [*self.scheduler.running, *self.scheduler.waiting]
        for group in groups:
            self.scheduler.abort(group.request_id)
        self._send({g.request_id: exc for g in groups})


