"""LocalEngine: the engine thread, its step loop, and the bridge back to asyncio.

The loop runs on its own thread so HTTP stays responsive while the model computes (llama_decode
releases the GIL). Requests and aborts arrive through an inbox; each step's outputs go back to each
request's asyncio queue with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servelm.constrain.grammars import Grammars
from servelm.constrain.masks import MaskComputer
from servelm.engine.detokenizer import Detokenizer
from servelm.engine.sampling import SamplerState, sample_rows
from servelm.engine.scheduler import Scheduler, StepPlan
from servelm.engine.sequence import Sequence, SequenceGroup
from servelm.engine.types import EngineStats, FinishReason, GenerationOutput, GenerationRequest
from servelm.runners.base import KVCacheFull, ModelRunner

log = logging.getLogger("servelm.engine")


class EngineError(RuntimeError):
    """The engine could not finish a request for a reason of its own (not the client's)."""


@dataclass(eq=False)
class _SeqState:
    sampler: SamplerState
    detok: Detokenizer
    matcher: Any = None  # the llguidance matcher of a constrained choice
    free_unless: tuple[str, ...] = ()  # see Constraint.free_unless
    head: str = ""  # the output so far, while free_unless is undecided


@dataclass(eq=False)
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class LocalEngine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        seeded_step_tokens: int | None = None,
        prefix_cache: bool = False,
        grammars: Grammars | None = None,
    ) -> None:
        self.runner = runner
        self.grammars = grammars
        self._masks = MaskComputer(runner.vocab_size) if grammars is not None else None
        self.scheduler = Scheduler(
            runner.num_slots,
            runner.kv_cells,
            runner.max_step_tokens,
            seeded_step_tokens=seeded_step_tokens,
            prefix_cache=prefix_cache,
        )
        self._eog = np.asarray(runner.eog_ids, dtype=np.int64)
        self._eog_set = frozenset(int(t) for t in self._eog)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._clients: dict[str, _Client] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

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
        group = SequenceGroup(request.request_id, request.prompt_token_ids, request.params)
        if request.constraint is not None and self.grammars is None:
            raise EngineError("this engine was built without grammar support")
        for seq in group.seqs:
            sampler = SamplerState.create(request.params, seq.index, self.runner.vocab_size, request.prompt_token_ids)
            matcher = self.grammars.matcher(request.constraint) if request.constraint is not None else None
            detok = Detokenizer(self._token_text(request.params.skip_special_tokens), request.params.stop)
            free_unless = request.constraint.free_unless if request.constraint is not None else ()
            seq.state = _SeqState(sampler, detok, matcher, free_unless)
        client = _Client(asyncio.get_running_loop(), asyncio.Queue())
        self._clients[request.request_id] = client
        self._post("add", group)
        remaining = len(group.seqs)
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
            kv_cells_used=s.kv_cells_used - len(s.prefix),
            kv_cells_cached=len(s.prefix),
            kv_cells_total=s.kv_cells,
            free_slots=len(s.free_slots),
            total_slots=s.num_slots,
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
            except Exception as exc:  # a bug or a broken model must not kill the engine thread
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
        plan = self.scheduler.schedule()
        outputs: dict[str, list[GenerationOutput]] = {}
        for seq in plan.out_of_cells:
            self._finish_output(seq, FinishReason.LENGTH, None, outputs)
        if not plan.has_work:
            self._send(outputs)
            self._wake.wait(0.005)  # waiting requests that do not fit yet; let the inbox bring news
            self._wake.clear()
            return
        try:
            logits = self.runner.step(plan)
        except KVCacheFull:
            log.warning("KV cache full at decode; preempting the newest request")
            self.scheduler.preempt_newest()
            self._send(outputs)
            return
        self.steps += 1
        samplers, tokens = self._sample(plan, logits)
        self.scheduler.update(plan, dict(zip(samplers, tokens)))
        for seq, token in zip(samplers, tokens):
            self._advance(seq, int(token), outputs)
        self._send(outputs)

    def _sample(self, plan: StepPlan, logits: np.ndarray) -> tuple[list[Sequence], list[int]]:
        rows: list[int] = []
        samplers: list[Sequence] = []
        r = 0
        for chunk in plan.chunks:
            if not chunk.wants_logits:
                continue
            for seq in chunk.samplers:
                rows.append(r)
                samplers.append(seq)
            r += 1
        if not samplers:
            return [], []
        picked = logits[np.asarray(rows)]  # a copy we may modify
        tokens = sample_rows(picked, [s.state.sampler for s in samplers], self._eog, self._grammar_masks(samplers))
        return samplers, tokens.tolist()

    def _grammar_masks(self, samplers: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """The allowed tokens of every constrained row in this step, computed in one call."""
        constrained = [i for i, s in enumerate(samplers) if s.state.matcher is not None]
        if not constrained or self._masks is None:
            return None
        return np.asarray(constrained), self._masks.allowed([samplers[i].state.matcher for i in constrained])

    def _advance(self, seq: Sequence, token: int, outputs: dict[str, list[GenerationOutput]]) -> None:
        """Account for one sampled token: stop conditions, new text, and the output to send."""
        st: _SeqState = seq.state
        params = seq.group.params
        st.sampler.record(token)
        if st.matcher is not None and not st.matcher.consume_token(token):
            log.error("grammar rejected sampled token %d: %s", token, st.matcher.get_error())
            return self._finish_output(seq, FinishReason.STOP, None, outputs, token)
        if token in self._eog_set and (not params.ignore_eos or st.matcher is not None and st.matcher.is_stopped()):
            return self._finish_output(seq, FinishReason.STOP, None, outputs, token)
        if token in params.stop_token_ids:
            return self._finish_output(seq, FinishReason.STOP, token, outputs, token)
        text, hit = st.detok.push(token)
        if st.free_unless and text:
            self._maybe_release(st, text)
        if hit is not None:
            return self._finish_output(seq, FinishReason.STOP, hit, outputs, token, text=text, flush=False)
        if st.matcher is not None and st.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish_output(seq, FinishReason.STOP, None, outputs, token, text=text)
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.runner.context_window:
            return self._finish_output(seq, FinishReason.LENGTH, None, outputs, token, text=text)
        if text:
            outputs.setdefault(seq.group.request_id, []).append(
                GenerationOutput(seq.group.request_id, seq.index, text, [token], prompt_tokens=seq.prompt_len,
                                 completion_tokens=seq.num_generated, cached_tokens=seq.group.cached_tokens)
            )

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
        token: int | None = None,
        *,
        text: str = "",
        flush: bool = True,
    ) -> None:
        if flush:
            text += seq.state.detok.flush()
        self.scheduler.finish(seq)
        outputs.setdefault(seq.group.request_id, []).append(
            GenerationOutput(
                seq.group.request_id, seq.index, text, [] if token is None else [token],
                finish_reason=reason, stop_reason=stop_reason,
                prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated,
                cached_tokens=seq.group.cached_tokens,
            )
        )

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
