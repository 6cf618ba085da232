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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelm.constrain.grammars import Grammars, plain_error
from servelm.constrain.masks import MaskComputer
from servelm.engine.beam import BeamSearch
from servelm.engine.detokenizer import Detokenizer
from servelm.engine.plan import StepPlan
from servelm.engine.sampling import SamplerState, log_softmax, logprob_entry, pick_rows, process_rows, token_logprobs
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SeqStatus, Sequence, SequenceGroup
from servelm.engine.types import EngineStats, FinishReason, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from servelm.errors import ApiError, ConstraintFailed, ServerError
from servelm.runners.base import ModelRunner

log = logging.getLogger("servelm.engine")


class EngineError(ServerError, RuntimeError):
    """The engine could not finish a request for a reason of its own (not the client's): a 500 in the envelope."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_error")


@dataclass(eq=False)
class _SeqState:
    sampler: SamplerState
    detok: Detokenizer
    matcher: Any = None  # the llguidance matcher of a constrained choice
    free_unless: tuple[str, ...] = ()  # see Constraint.free_unless
    head: str = ""  # the output so far, while free_unless is undecided
    beam: BeamSearch | None = None  # shared by every beam of a beam-search request
    tokens: list[int] = field(default_factory=list)  # taken since the last output was sent
    logprobs: list[TokenLogprob] | None = None  # theirs, when asked for
    cumulative: float = 0.0
    prompt_logprobs: dict[int, TokenLogprob] | None = None  # by position, while the prompt is read
    grammar_param: str | None = None  # the request parameter the matcher's grammar came from


@dataclass(eq=False)
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class LocalEngine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        prefix_cache: bool = True,
        grammars: Grammars | None = None,
    ) -> None:
        self.runner = runner
        self.grammars = grammars
        self._masks = MaskComputer(runner.vocab_size) if grammars is not None else None
        self.scheduler = Scheduler(runner.num_slots, runner.context_window, runner.max_step_tokens,
                                   max_rows=runner.max_rows, prefix_cache=prefix_cache)
        self._eog = np.asarray(runner.eog_ids, dtype=np.int64)
        self._eog_set = frozenset(int(t) for t in self._eog)
        self._inbox: deque[tuple[str, object]] = deque()
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
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the asyncio side -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        group = SequenceGroup(request.request_id, request.prompt_token_ids, request.params, scope=request.cache_scope)
        params = request.params
        if request.constraint is not None and self.grammars is None:
            raise EngineError("this engine was built without grammar support")
        search = None
        if params.beam is not None:
            search = BeamSearch(params, len(group.seqs), self._eog_set, self._token_text(params.skip_special_tokens))
        for seq in group.seqs:
            sampler = SamplerState.create(params, seq.index, self.runner.vocab_size, request.prompt_token_ids)
            matcher = self.grammars.matcher(request.constraint) if request.constraint is not None else None
            detok = self._detokenizer(params)
            free_unless = request.constraint.free_unless if request.constraint is not None else ()
            seq.state = _SeqState(sampler, detok, matcher, free_unless, beam=search,
                                  logprobs=[] if params.logprobs is not None else None,
                                  grammar_param=request.constraint.param if request.constraint is not None else None)
        if params.prompt_logprobs is not None:
            group.seqs[0].state.prompt_logprobs = {}
        client = _Client(asyncio.get_running_loop(), asyncio.Queue())
        self._clients[request.request_id] = client
        self._post("add", group)
        remaining = params.n if search is not None else len(group.seqs)
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

    def _detokenizer(self, params: SamplingParams) -> Detokenizer:
        return Detokenizer(self._token_text(params.skip_special_tokens), params.stop,
                           include_stop=params.include_stop_str_in_output)

    def _token_text(self, skip_special: bool) -> Callable[[int], bytes]:
        if skip_special or self.grammars is None:
            return self.runner.token_bytes
        texts = self.grammars.spelled  # control tokens spelled out
        return lambda token: texts[token] if 0 <= token < len(texts) else b""

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=s.num_running_seqs,
            waiting=s.num_waiting,
            kv_cells_used=s.kv_cells_used,
            kv_cells_cached=s.kv_cells_cached,
            kv_cells_total=s.kv_cells,
            kv_cell_bytes=self.runner.kv_cell_bytes,
            free_slots=len(s.free_slots),
            total_slots=s.num_slots,
            cache_hits=s.cache_hits,
            cached_tokens=s.cached_tokens,
            step_seconds=self.step_seconds,
            forward_seconds=self.forward_seconds,
            steps=self.steps,
            forward_calls=self.runner.forward_calls,
        )

    def _post(self, kind: str, item: object) -> None:
        self._inbox.append((kind, item))
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
            kind, item = self._inbox.popleft()
            if kind == "add":
                self.scheduler.add(item)  # type: ignore[arg-type]
            else:
                self.scheduler.abort(item)  # type: ignore[arg-type]

    def _step(self) -> None:
        """One recipe: plan → forward pass → sample → record → detokenize and send."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs: dict[str, list[GenerationOutput]] = {}
        if not plan.has_work:
            self._wake.wait(0.005)  # waiting requests that do not fit yet; let the inbox bring news
            self._wake.clear()
            return
        forward = time.perf_counter()
        logits = self.runner.step(plan)  # its failure is every request's in the step (_run fails them)
        self.steps += 1
        self.forward_seconds += time.perf_counter() - forward
        rows = plan.rows()
        self._prompt_logprobs(plan, logits, rows, outputs)
        samplers, processed, tokens, beams = self._sample(plan, logits, rows, outputs)
        self.scheduler.update(plan, dict(zip(samplers, tokens)))
        entries = self._token_logprobs(samplers, processed, tokens, outputs)
        for seq, token, entry in zip(samplers, tokens, entries):
            if seq.status is not SeqStatus.FINISHED:
                self._contain(seq.group, outputs, self._advance, seq, int(token), entry, outputs)
        for group, group_rows in beams.items():
            self._contain(group, outputs, self._beam_step, group, group_rows, outputs)
        self._send(outputs)
        self.step_seconds += time.perf_counter() - start

    # -- containment: one request's failure is its own --------------------------------------------
    def _contain(self, group: SequenceGroup, outputs: dict, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) for one request; if it raises, that request alone fails (its sequences freed, its client
        told) and the step goes on for every other. Returns fn's result, or None after a failure."""
        try:
            return fn(*args)
        except Exception as exc:  # a bug or a pathological input in one request must not fail its neighbours
            log.exception("request %s failed in the engine; the others go on", group.request_id)
            self._fail(group, exc, outputs)
            return None

    def _fail(self, group: SequenceGroup, exc: BaseException, outputs: dict) -> None:
        self.scheduler.abort(group.request_id)
        if not isinstance(exc, ApiError):
            exc = EngineError(f"the engine failed on this request: {type(exc).__name__}: {exc}")
        outputs[group.request_id] = exc  # replaces what the request had this step: only the error goes out

    def _each(self, seqs: list[Sequence], outputs: dict, fn: Callable[[list[int]], list[Any]]) -> list[Any]:
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

    def _sample(self, plan: StepPlan, logits: np.ndarray, rows: list[int], outputs: dict) -> tuple[
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
            process_rows(view, [s.state.sampler for s in chosen], self._eog, self._grammar_masks(chosen))
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

    def _token_logprobs(self, samplers: list[Sequence], rows: np.ndarray, tokens: list[int],
                        outputs: dict) -> list[TokenLogprob | None]:
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

    def _prompt_logprobs(self, plan: StepPlan, logits: np.ndarray, rows: list[int], outputs: dict) -> None:
        """Chunks that read a prompt for its logprobs: each row scores the prompt's next token (raw model)."""
        for chunk, last in zip(plan.chunks, rows):
            if chunk.all_logits and chunk.seq.state.prompt_logprobs is not None:
                self._contain(chunk.seq.group, outputs, self._score_prompt, chunk, logits, last)

    @staticmethod
    def _score_prompt(chunk: Any, logits: np.ndarray, last: int) -> None:
        st: _SeqState = chunk.seq.state
        prompt = chunk.seq.group.prompt_token_ids
        k = chunk.seq.group.params.prompt_logprobs or 0
        first = last - len(chunk.tokens) + 1
        positions = [chunk.start + j + 1 for j in range(len(chunk.tokens)) if chunk.start + j + 1 < len(prompt)]
        if not positions:
            return
        logp = log_softmax(logits[first : first + len(positions)])
        for j, pos in enumerate(positions):
            st.prompt_logprobs[pos] = logprob_entry(logp[j], prompt[pos], k)  # type: ignore[index]

    def _grammar_masks(self, samplers: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """The allowed tokens of every constrained row in this step, computed in one call."""
        constrained = [i for i, s in enumerate(samplers) if s.state.matcher is not None]
        if not constrained or self._masks is None:
            return None
        allowed = self._masks.allowed([samplers[i].state.matcher for i in constrained])
        for i in constrained:
            if samplers[i].state.matcher.is_error():  # past llguidance's per-step limits: its request fails
                raise _constraint_failed(samplers[i])
        return np.asarray(constrained), allowed

    def _advance(self, seq: Sequence, token: int, entry: TokenLogprob | None,
                 outputs: dict[str, list[GenerationOutput]]) -> None:
        """Account for one sampled token: stop conditions, new text, and the output to send."""
        st: _SeqState = seq.state
        params = seq.group.params
        st.sampler.record(token)
        st.tokens.append(token)
        if entry is not None:
            st.cumulative += entry.logprob
            if st.logprobs is not None:
                st.logprobs.append(entry)
        if st.matcher is not None and not st.matcher.consume_token(token):
            raise _constraint_failed(seq)
        if token in self._eog_set and (not params.ignore_eos or st.matcher is not None and st.matcher.is_stopped()):
            return self._finish_output(seq, FinishReason.STOP, None, outputs, ended_by_token=True)
        if token in params.stop_token_ids:
            return self._finish_output(seq, FinishReason.STOP, token, outputs, ended_by_token=True)
        text, hit = st.detok.push(token)
        if st.free_unless and text:
            self._maybe_release(st, text)
        if hit is not None:
            return self._finish_output(seq, FinishReason.STOP, hit, outputs, text=text, flush=False)
        if st.matcher is not None and st.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish_output(seq, FinishReason.STOP, None, outputs, text=text)
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.runner.context_window:
            return self._finish_output(seq, FinishReason.LENGTH, None, outputs, text=text)
        if text or st.logprobs:  # tokens without text yet (part of a character) wait unless logprobs are asked for
            self._emit(seq, text, None, None, outputs)

    @staticmethod
    def _maybe_release(st: _SeqState, text: str) -> None:
        """Drop the matcher once the output is text that no marker of free_unless can begin."""
        st.head += text
        head = st.head.lstrip()
        if not head:
            return
        if any(head.startswith(m) for m in st.free_unless):
            st.free_unless = ()  # committed to the constrained branch: keep the grammar to the end
        elif not any(m.startswith(head) for m in st.free_unless):
            st.matcher = None
            st.free_unless = ()

    def _finish_output(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: str | int | None,
        outputs: dict[str, list[GenerationOutput]],
        *,
        text: str = "",
        flush: bool = True,
        ended_by_token: bool = False,
    ) -> None:
        if seq.state.beam is not None:  # a beam cannot end alone (it ran out of cells): end the search
            return self._finish_beams(seq.group, outputs)
        st: _SeqState = seq.state
        if ended_by_token and st.tokens:  # EOS or a stop token is not part of the text: not reported either
            st.tokens.pop()
            if st.logprobs:
                st.logprobs.pop()
        if flush:
            text += seq.state.detok.flush()
        self.scheduler.finish(seq)
        self._emit(seq, text, reason, stop_reason, outputs)

    def _emit(self, seq: Sequence, text: str, reason: FinishReason | None, stop_reason: str | int | None,
              outputs: dict[str, list[GenerationOutput]]) -> None:
        """Send the sequence's news: its text and the tokens (and logprobs) taken since the last output."""
        st: _SeqState = seq.state
        out = GenerationOutput(
            seq.group.request_id, seq.index, text, st.tokens, finish_reason=reason, stop_reason=stop_reason,
            prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated, cached_tokens=seq.group.cached_tokens,
            logprobs=st.logprobs, cumulative_logprob=st.cumulative,
        )
        st.tokens = []
        if st.logprobs is not None:
            st.logprobs = []
        self._deliver(seq.group, out, outputs)

    def _deliver(self, group: SequenceGroup, out: GenerationOutput, outputs: dict[str, list[GenerationOutput]]) -> None:
        if isinstance(outputs.get(group.request_id), BaseException):  # it failed this step: only the error goes
            return
        first: _SeqState = group.seqs[0].state
        if first.prompt_logprobs is not None:  # the request's first output carries the prompt's logprobs
            prompt = group.prompt_token_ids
            out.prompt_logprobs = [None, *(first.prompt_logprobs.get(p) for p in range(1, len(prompt)))]
            first.prompt_logprobs = None
        outputs.setdefault(group.request_id, []).append(out)

    # -- beam search ------------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup, rows: np.ndarray, outputs: dict[str, list[GenerationOutput]]) -> None:
        """One step of a beam-search request: choose the next beams, move their KV and state, or finish."""
        seqs = group.seqs
        if any(s.status is SeqStatus.FINISHED for s in seqs):  # aborted meanwhile
            return
        search: BeamSearch = seqs[0].state.beam
        moves = search.step(rows)
        if search.done:
            return self._finish_beams(group, outputs)
        samplers = [s.state.sampler for s in seqs]
        host = self.scheduler.rebeam(group, [m.parent for m in moves], [m.token for m in moves])
        for i, move in enumerate(moves):
            sampler = samplers[move.parent].fork()
            sampler.record(move.token)
            seqs[host[i]].state.sampler = sampler
        search.beams = [search.beams[host.index(j)] for j in range(len(seqs))]

    def _finish_beams(self, group: SequenceGroup, outputs: dict[str, list[GenerationOutput]]) -> None:
        search: BeamSearch = group.seqs[0].state.beam
        if search.closed:
            return
        search.closed = True
        for beam in search.beams if not search.done else ():
            search.add_running(beam)
        for seq in group.seqs:
            self.scheduler.finish(seq)
        for out in search.outputs(group.request_id, group.prompt_len, group.cached_tokens,
                                  lambda: self._detokenizer(group.params)):
            self._deliver(group, out, outputs)

    def _send(self, outputs: dict[str, list[GenerationOutput]] | dict[str, BaseException]) -> None:
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


def _constraint_failed(seq: Sequence) -> ConstraintFailed:
    st: _SeqState = seq.state
    return ConstraintFailed(f"The output constraint could not be followed after {seq.num_generated} tokens: "
                            f"{plain_error(st.matcher.get_error())}.", st.grammar_param)
