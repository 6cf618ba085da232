"""The output side of a step: what each sequence's sampled token means for its request.

Per sequence it owns the output state (the sampler's history, the detokenizer, the grammar matcher, logprobs
taken since the last output), applies the stop rules (end-of-generation and stop tokens, stop strings, a
finished grammar, max_tokens, the context window), scores prompts for their logprobs, drives beam search, and
turns all of it into GenerationOutputs, gathered per request for the loop to send. The loop (engine/local.py)
calls it under its containment: whatever one request's output raises fails that request alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelm.constrain.grammars import Grammars, plain_error
from servelm.constrain.masks import MaskComputer
from servelm.engine.beam import BeamSearch
from servelm.engine.detokenizer import Detokenizer
from servelm.engine.plan import ScheduledChunk
from servelm.engine.sampling import SamplerState, log_softmax, logprob_entry
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import SeqStatus, Sequence, SequenceGroup
from servelm.engine.thinking import ThinkTracker
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from servelm.errors import ConstraintFailed
from servelm.runners.base import ModelRunner

Outputs = dict[str, Any]  # request id → its outputs this step (a list), or the exception it failed with


@dataclass(eq=False)
class SeqState:
    """One sequence's output state, from its admission to its last output."""

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
    think: ThinkTracker | None = None  # a choice that may think: its thought's tokens, and its budget


class OutputProcessor:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, grammars: Grammars | None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.grammars = grammars
        self.eog = np.asarray(runner.eog_ids, dtype=np.int64)
        self._masks = MaskComputer(runner.vocab_size) if grammars is not None else None
        self._eog_set = frozenset(int(t) for t in self.eog)

    def attach(self, request: GenerationRequest, group: SequenceGroup) -> None:
        """Give each sequence of a new request its output state."""
        params, constraint = request.params, request.constraint
        search = None
        if params.beam is not None:
            search = BeamSearch(params, len(group.seqs), self._eog_set, self._token_text(params.skip_special_tokens))
        for seq in group.seqs:
            sampler = SamplerState.create(params, seq.index, self.runner.vocab_size, request.prompt_token_ids)
            matcher = self.grammars.matcher(constraint) if constraint is not None and self.grammars else None
            seq.state = SeqState(sampler, self._detokenizer(params), matcher,
                                 constraint.free_unless if constraint is not None else (), beam=search,
                                 logprobs=[] if params.logprobs is not None else None,
                                 grammar_param=constraint.param if constraint is not None else None,
                                 think=ThinkTracker(request.thinking) if request.thinking is not None else None)
        if params.prompt_logprobs is not None:
            group.seqs[0].state.prompt_logprobs = {}

    def _detokenizer(self, params: SamplingParams) -> Detokenizer:
        return Detokenizer(self._token_text(params.skip_special_tokens), params.stop,
                           include_stop=params.include_stop_str_in_output)

    def _token_text(self, skip_special: bool) -> Callable[[int], bytes]:
        if skip_special or self.grammars is None:
            return self.runner.token_bytes
        texts = self.grammars.spelled  # control tokens spelled out
        return lambda token: texts[token] if 0 <= token < len(texts) else b""

    def masks(self, samplers: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """The allowed tokens of every masked row in this step: a grammar's (computed in one call), or the one
        token a spent thinking budget writes next."""
        forced = {i: s.state.think.forced[0] for i, s in enumerate(samplers) if s.state.think and s.state.think.forced}
        constrained = [i for i, s in enumerate(samplers) if s.state.matcher is not None and i not in forced]
        grammar = None
        if constrained and self._masks is not None:
            grammar = self._masks.allowed([samplers[i].state.matcher for i in constrained])
            for i in constrained:
                if samplers[i].state.matcher.is_error():  # past llguidance's per-step limits: its request fails
                    raise constraint_failed(samplers[i])
        if not forced:  # the common case: the grammar's rows as they are
            return (np.asarray(constrained), grammar) if grammar is not None else None
        rows = list(forced) + (constrained if grammar is not None else [])
        allowed = np.zeros((len(rows), self.runner.vocab_size), dtype=bool)
        allowed[np.arange(len(forced)), list(forced.values())] = True
        if grammar is not None:
            allowed[len(forced):] = grammar
        return np.asarray(rows), allowed

    @staticmethod
    def score_prompt(chunk: ScheduledChunk, logits: np.ndarray, last: int) -> None:
        """A prompt chunk read for its logprobs: each row scores the prompt's next token (raw model)."""
        st = chunk.seq.state
        prompt = chunk.seq.group.prompt_token_ids
        k = chunk.seq.group.params.prompt_logprobs or 0
        first = last - len(chunk.tokens) + 1
        positions = [chunk.start + j + 1 for j in range(len(chunk.tokens)) if chunk.start + j + 1 < len(prompt)]
        if not positions:
            return
        logp = log_softmax(logits[first : first + len(positions)])
        for j, pos in enumerate(positions):
            st.prompt_logprobs[pos] = logprob_entry(logp[j], prompt[pos], k)

    def advance(self, seq: Sequence, token: int, entry: TokenLogprob | None, outputs: Outputs) -> None:
        """Account for one sampled token: stop conditions, new text, and the output to send."""
        st = seq.state
        params = seq.group.params
        st.sampler.record(token)
        st.tokens.append(token)
        if st.think is not None:
            st.think.step(token, self.runner.token_bytes(token))
        if entry is not None:
            st.cumulative += entry.logprob
            if st.logprobs is not None:
                st.logprobs.append(entry)
        if st.matcher is not None and not st.matcher.consume_token(token):
            raise constraint_failed(seq)
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
    def _maybe_release(st: SeqState, text: str) -> None:
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
        outputs: Outputs,
        *,
        text: str = "",
        flush: bool = True,
        ended_by_token: bool = False,
    ) -> None:
        st = seq.state
        if st.beam is not None:  # a beam cannot end alone (it ran out of cells): end the search
            return self._finish_beams(seq.group, outputs)
        if ended_by_token and st.tokens:  # EOS or a stop token is not part of the text: not reported either
            st.tokens.pop()
            if st.logprobs:
                st.logprobs.pop()
        if flush:
            text += st.detok.flush()
        self.scheduler.finish(seq)
        self._emit(seq, text, reason, stop_reason, outputs)

    def _emit(self, seq: Sequence, text: str, reason: FinishReason | None, stop_reason: str | int | None,
              outputs: Outputs) -> None:
        """Send the sequence's news: its text and the tokens (and logprobs) taken since the last output."""
        st = seq.state
        group = seq.group
        if not group.first_token_at:
            group.first_token_at = time.perf_counter()
        out = GenerationOutput(
            group.request_id, seq.index, text, st.tokens, finish_reason=reason, stop_reason=stop_reason,
            prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated, cached_tokens=group.cached_tokens,
            logprobs=st.logprobs, cumulative_logprob=st.cumulative,
            reasoning_tokens=st.think.reasoning_tokens if st.think is not None else 0,
            queued_seconds=max(0.0, group.started_at - group.received_at) if group.started_at else 0.0,
            prompt_seconds=max(0.0, group.first_token_at - group.started_at) if group.started_at else 0.0,
            draft_tokens=seq.draft_tokens, draft_accepted=seq.draft_accepted,
        )
        st.tokens = []
        if st.logprobs is not None:
            st.logprobs = []
        self._deliver(seq.group, out, outputs)

    def _deliver(self, group: SequenceGroup, out: GenerationOutput, outputs: Outputs) -> None:
        if isinstance(outputs.get(group.request_id), BaseException):  # it failed this step: only the error goes
            return
        first = group.seqs[0].state
        if first.prompt_logprobs is not None:  # the request's first output carries the prompt's logprobs
            prompt = group.prompt_token_ids
            out.prompt_logprobs = [None, *(first.prompt_logprobs.get(p) for p in range(1, len(prompt)))]
            first.prompt_logprobs = None
        outputs.setdefault(group.request_id, []).append(out)

    # -- beam search ------------------------------------------------------------------------------
    def beam_step(self, group: SequenceGroup, rows: np.ndarray, outputs: Outputs) -> None:
        """One step of a beam-search request: choose the next beams, move their KV and state, or finish."""
        seqs = group.seqs
        if any(s.status is SeqStatus.FINISHED for s in seqs):  # aborted meanwhile
            return
        search = seqs[0].state.beam
        assert search is not None  # a beam step runs for beam-search groups only
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

    def _finish_beams(self, group: SequenceGroup, outputs: Outputs) -> None:
        search = group.seqs[0].state.beam
        assert search is not None  # a beam step runs for beam-search groups only
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


def constraint_failed(seq: Sequence) -> ConstraintFailed:
    st = seq.state
    return ConstraintFailed(f"The output constraint could not be followed after {seq.num_generated} tokens: "
                            f"{plain_error(st.matcher.get_error())}.", st.grammar_param)
