"""The output stage of a step: what each sampled token means for its request.

Per sequence it keeps the choice's state (engine/choice.py: the sampler's history, the detokenizer, the grammar
matcher, logprobs taken since the last output), applies the stop rules (end-of-generation and stop tokens, stop
strings, a finished grammar, max_tokens, the context window), files prompt scores, drives beam search, and turns
all of it into a StepResult: GenerationOutputs (or an error) per request for the loop to send, and the events the
scheduler applies (a sequence finished, a request failed, beams moved). It changes no scheduler state: that is
Scheduler.update's, from this result. Whatever one request's output raises fails that request alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from servelm.constrain.grammars import Grammars
from servelm.engine.beam import BeamSearch, beam_hosts
from servelm.engine.choice import Choice, RequestState, constraint_failed
from servelm.engine.clock import PhaseClock
from servelm.engine.detokenizer import Detokenizer
from servelm.engine.plan import SeqKey
from servelm.engine.runner import ModelRunner
from servelm.engine.sampler import SampledStep
from servelm.engine.sampling import SamplerState
from servelm.engine.sequence import SequenceGroup
from servelm.engine.thinking import ThinkTracker
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from servelm.errors import ApiError, ServerError

log = logging.getLogger("servelm.engine")


class EngineError(ServerError, RuntimeError):
    """The engine could not finish a request for a reason of its own (not the client's): a 500 in the envelope."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_error")


@dataclass(frozen=True, slots=True)
class Finish:
    """The sequence's last output is made: its slot goes back (its cells kept as a cache entry)."""

    seq: SeqKey


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed in this step: every sequence of it ends."""

    request_id: str


@dataclass(frozen=True, slots=True)
class BeamMove:
    """Beam search moved on: new beam i continues beam parents[i] with tokens[i] (engine/beam.py's beam_hosts says
    which sequence holds it)."""

    request_id: str
    parents: tuple[int, ...]
    tokens: tuple[int, ...]


Event = Finish | Failed | BeamMove
Delivery = list[GenerationOutput] | ApiError  # one step's outputs of a request, or what it failed with
Outputs = dict[str, Delivery]  # by request id


@dataclass
class StepResult:
    outputs: Outputs = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)  # in the order they happened

    def extend(self, more: StepResult) -> None:
        """A later round of the same step: its outputs after these; a failure replaces what its request had."""
        for request_id, news in more.outputs.items():
            mine = self.outputs.get(request_id)
            if isinstance(news, ApiError) or mine is None:
                self.outputs[request_id] = news
            elif not isinstance(mine, ApiError):
                mine += news
        self.events += more.events


class OutputProcessor:
    def __init__(self, runner: ModelRunner, grammars: Grammars | None, clock: PhaseClock | None = None) -> None:
        self.runner = runner
        self.grammars = grammars
        self.clock = clock or PhaseClock()
        self._eog = frozenset(int(t) for t in runner.eog_ids)
        self.choices: dict[SeqKey, Choice] = {}  # every admitted sequence's, until its request ends
        self.requests: dict[str, RequestState] = {}  # and its request's, by id

    # -- a request's state ------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest, group: SequenceGroup) -> RequestState:
        """A new request's state (made on the caller's thread; `attach` files it on the engine's)."""
        params, constraint = request.params, request.constraint
        state = RequestState(group, prompt_logprobs={} if params.prompt_logprobs is not None else None)
        if params.beam is not None:
            state.beam = BeamSearch(params, len(group.seqs), self._eog, self._token_text(params.skip_special_tokens))
        for seq in group.seqs:
            sampler = SamplerState.create(params, seq.index, self.runner.vocab_size, request.prompt_token_ids)
            matcher = self.grammars.matcher(constraint) if constraint is not None and self.grammars else None
            state.choices.append(Choice(
                seq.key, seq.index, state, sampler, self._detokenizer(params), matcher,
                constraint.free_unless if constraint is not None else (),
                logprobs=[] if params.logprobs is not None else None,
                grammar_param=constraint.param if constraint is not None else None,
                think=ThinkTracker(request.thinking) if request.thinking is not None else None))
        return state

    def attach(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for choice in state.choices:
            self.choices[choice.key] = choice

    def forget(self, group: SequenceGroup) -> None:
        state = self.requests.get(group.request_id)
        if state is not None and state.group is group:
            del self.requests[group.request_id]
        for seq in group.seqs:
            self.choices.pop(seq.key, None)

    def request_id(self, key: SeqKey) -> str:
        return self.choices[key].request.request_id

    def live(self, key: SeqKey) -> bool:
        choice = self.choices.get(key)
        return choice is not None and choice.live

    def _detokenizer(self, params: SamplingParams) -> Detokenizer:
        return Detokenizer(self._token_text(params.skip_special_tokens), params.stop,
                           include_stop=params.include_stop_str_in_output)

    def _token_text(self, skip_special: bool) -> Callable[[int], bytes]:
        if skip_special or self.grammars is None:
            return self.runner.token_bytes
        texts = self.grammars.spelled  # control tokens spelled out
        return lambda token: texts[token] if 0 <= token < len(texts) else b""

    # -- the stage --------------------------------------------------------------------------------
    def process(self, sampled: SampledStep) -> StepResult:
        """The sampled step's tokens, beam rows and prompt scores, taken in the order they were drawn."""
        result = StepResult()
        for request_id, exc in sampled.failed.items():
            request = self.requests.get(request_id)
            if request is not None and not request.failed:
                self._fail(request, exc, result)
        for key, scores in sampled.prompt.items():
            request = self.choices[key].request
            if request.prompt_logprobs is not None and not request.failed:
                request.prompt_logprobs.update(scores)
        for key, drawn in sampled.drawn.items():
            choice = self.choices[key]
            choice.draft_tokens += drawn.drafted
            guesses_from = len(drawn.tokens) - drawn.accepted  # the tokens from here on are guesses that held
            for n, (token, entry) in enumerate(zip(drawn.tokens, drawn.entries)):
                if not choice.live:
                    break
                choice.draft_accepted += n >= guesses_from
                self._contain(choice.request, result, partial(self._advance, choice, token, entry, result))
        for request_id, rows in sampled.beams.items():
            request = self.requests[request_id]
            if not request.failed:
                self._contain(request, result, partial(self._beam_step, request, rows, result))
        return result

    def _contain(self, request: RequestState, result: StepResult, fn: Callable[[], None]) -> None:
        """fn() for one request; if it raises, that request alone fails, and the step goes on for every other."""
        try:
            fn()
        except Exception as exc:  # a bug or a pathological input in one request must not fail its neighbours
            log.exception("request %s failed in the engine; the others go on", request.request_id)
            self._fail(request, exc, result)

    @staticmethod
    def _fail(request: RequestState, exc: BaseException, result: StepResult) -> None:
        request.failed = True
        if not isinstance(exc, ApiError):
            exc = EngineError(f"the engine failed on this request: {type(exc).__name__}: {exc}")
        result.outputs[request.request_id] = exc  # replaces what the request had this step: only the error goes out
        result.events.append(Failed(request.request_id))

    def _advance(self, choice: Choice, token: int, entry: TokenLogprob | None, result: StepResult) -> None:
        """Account for one sampled token: stop conditions, new text, and the output to send."""
        params = choice.request.group.params
        choice.generated += 1
        choice.sampler.record(token)
        choice.tokens.append(token)
        if choice.think is not None:
            choice.think.step(token, self.runner.token_bytes(token))
        if entry is not None:
            choice.cumulative += entry.logprob
            if choice.logprobs is not None:
                choice.logprobs.append(entry)
        matcher = choice.matcher
        if matcher is not None:
            with self.clock.phase("grammar"):
                consumed = matcher.consume_token(token)
            if not consumed:
                raise constraint_failed(choice)
        if token in self._eog and (not params.ignore_eos or matcher is not None and matcher.is_stopped()):
            return self._finish(choice, FinishReason.STOP, None, result, ended_by_token=True)
        if token in params.stop_token_ids:
            return self._finish(choice, FinishReason.STOP, token, result, ended_by_token=True)
        with self.clock.phase("detokenize"):
            text, hit = choice.detok.push(token)
        if choice.free_unless and text:
            self._maybe_release(choice, text)
        if hit is not None:
            return self._finish(choice, FinishReason.STOP, hit, result, text=text, flush=False)
        if choice.matcher is not None and choice.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish(choice, FinishReason.STOP, None, result, text=text)
        prompt_len = choice.request.group.prompt_len
        if choice.generated >= params.max_tokens or prompt_len + choice.generated >= self.runner.context_window:
            return self._finish(choice, FinishReason.LENGTH, None, result, text=text)
        if text or choice.logprobs:  # tokens without text yet (part of a character) wait unless logprobs are asked for
            self._emit(choice, text, None, None, result)

    @staticmethod
    def _maybe_release(choice: Choice, text: str) -> None:
        """Drop the matcher once the output is text that no marker of free_unless can begin."""
        choice.head += text
        head = choice.head.lstrip()
        if not head:
            return
        if any(head.startswith(m) for m in choice.free_unless):
            choice.free_unless = ()  # committed to the constrained branch: keep the grammar to the end
        elif not any(m.startswith(head) for m in choice.free_unless):
            choice.matcher = None
            choice.free_unless = ()

    def _finish(
        self,
        choice: Choice,
        reason: FinishReason,
        stop_reason: str | int | None,
        result: StepResult,
        *,
        text: str = "",
        flush: bool = True,
        ended_by_token: bool = False,
    ) -> None:
        if choice.request.beam is not None:  # a beam cannot end alone (it ran out of cells): end the search
            return self._finish_beams(choice.request, result)
        if ended_by_token and choice.tokens:  # EOS or a stop token is not part of the text: not reported either
            choice.tokens.pop()
            if choice.logprobs:
                choice.logprobs.pop()
        if flush:
            text += choice.detok.flush()
        choice.done = True
        result.events.append(Finish(choice.key))
        self._emit(choice, text, reason, stop_reason, result)

    def _emit(self, choice: Choice, text: str, reason: FinishReason | None, stop_reason: str | int | None,
              result: StepResult) -> None:
        """Send the sequence's news: its text and the tokens (and logprobs) taken since the last output."""
        request = choice.request
        group = request.group
        if not request.first_token_at:
            request.first_token_at = time.perf_counter()
        out = GenerationOutput(
            group.request_id, choice.index, text, choice.tokens, finish_reason=reason, stop_reason=stop_reason,
            prompt_tokens=group.prompt_len, completion_tokens=choice.generated, cached_tokens=group.cached_tokens,
            logprobs=choice.logprobs, cumulative_logprob=choice.cumulative,
            reasoning_tokens=choice.think.reasoning_tokens if choice.think is not None else 0,
            queued_seconds=max(0.0, group.started_at - group.received_at) if group.started_at else 0.0,
            prompt_seconds=max(0.0, request.first_token_at - group.started_at) if group.started_at else 0.0,
            draft_tokens=choice.draft_tokens, draft_accepted=choice.draft_accepted,
        )
        choice.tokens = []
        if choice.logprobs is not None:
            choice.logprobs = []
        self._deliver(request, out, result)

    @staticmethod
    def _deliver(request: RequestState, out: GenerationOutput, result: StepResult) -> None:
        mine = result.outputs.setdefault(request.request_id, [])
        if isinstance(mine, ApiError):  # it failed this step: only the error goes
            return
        if request.prompt_logprobs is not None:  # the request's first output carries the prompt's logprobs
            prompt = request.group.prompt_token_ids
            out.prompt_logprobs = [None, *(request.prompt_logprobs.get(p) for p in range(1, len(prompt)))]
            request.prompt_logprobs = None
        mine.append(out)

    # -- beam search ------------------------------------------------------------------------------
    def _beam_step(self, request: RequestState, rows: np.ndarray, result: StepResult) -> None:
        """One step of a beam-search request: choose the next beams and move their state, or finish."""
        search = request.beam
        choices = request.choices
        if search is None or any(c.done for c in choices):
            return
        moves = search.step(rows)
        if search.done:
            return self._finish_beams(request, result)
        parents = [m.parent for m in moves]
        host = beam_hosts(parents, len(choices))
        samplers = [c.sampler for c in choices]
        for i, move in enumerate(moves):
            sampler = samplers[move.parent].fork()
            sampler.record(move.token)
            choices[host[i]].sampler = sampler
        search.beams = [search.beams[host.index(j)] for j in range(len(choices))]
        result.events.append(BeamMove(request.request_id, tuple(parents), tuple(m.token for m in moves)))

    def _finish_beams(self, request: RequestState, result: StepResult) -> None:
        search = request.beam
        if search is None or search.closed:
            return
        search.closed = True
        for beam in search.beams if not search.done else ():
            search.add_running(beam)
        for choice in request.choices:
            choice.done = True
            result.events.append(Finish(choice.key))
        group = request.group
        for out in search.outputs(group.request_id, group.prompt_len, group.cached_tokens,
                                  lambda: self._detokenizer(group.params)):
            self._deliver(request, out, result)
