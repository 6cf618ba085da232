"""The sampling stage of a step: the logits rows a plan asked for → each sequence's token and logprobs, each beam
search's rows, each prompt position's score.

It reads the choices' state (engine/choice.py: RNG and penalties, grammar matcher, a thought's forced token) and
changes only the draws' RNGs and a beam search's rows gathered so far; what a token means is the output
processor's business. Every row is processed and drawn at once; should that raise, row by row, so that a request
whose own row raises fails alone (SampledStep.failed) and its neighbours are sampled as if nothing happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from servelm.constrain.masks import MaskComputer
from servelm.engine.choice import Choice, constraint_failed
from servelm.engine.clock import PhaseClock
from servelm.engine.plan import ScheduledChunk, SeqKey, StepPlan
from servelm.engine.sampling import Undo, log_softmax, logprob_entry, pick_rows, process_rows, restore, token_logprobs
from servelm.engine.types import TokenLogprob

log = logging.getLogger("servelm.engine")

T = TypeVar("T")


@dataclass(slots=True)
class Drawn:
    """One sequence's tokens in a step: the token of its chunk's row, then those of the rows after each guess that
    held (engine/speculate.py), each with its logprob entry when one is wanted."""

    tokens: list[int] = field(default_factory=list)
    entries: list[TokenLogprob | None] = field(default_factory=list)
    drafted: int = 0  # guesses its chunk read
    accepted: int = 0  # of which held: each a token after the first


@dataclass
class SampledStep:
    drawn: dict[SeqKey, Drawn] = field(default_factory=dict)  # in the order drawn
    beams: dict[str, np.ndarray] = field(default_factory=dict)  # request id → its beams' processed rows (width × vocab)
    prompt: dict[SeqKey, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)  # prompt positions scored
    failed: dict[str, Exception] = field(default_factory=dict)  # request id → why it failed in this stage (or before)

    def held(self, chunk: ScheduledChunk, j: int) -> bool:
        """Whether the drafted chunk's row j (the row after its guess j - 1) is its sequence's next: every guess
        before it held."""
        drawn = self.drawn.get(chunk.seq)
        return (0 < j <= chunk.drafted and drawn is not None and len(drawn.tokens) == j
                and drawn.tokens[-1] == chunk.tokens[j])

    def extend(self, more: SampledStep) -> None:
        """A later round of the same step (verified guesses' rows)."""
        for key, drawn in more.drawn.items():
            mine = self.drawn.setdefault(key, Drawn())
            mine.tokens += drawn.tokens
            mine.entries += drawn.entries
            mine.drafted += drawn.drafted
            mine.accepted += drawn.accepted
        self.beams.update(more.beams)
        self.prompt.update(more.prompt)
        for request_id, exc in more.failed.items():
            self.failed.setdefault(request_id, exc)


class StepSampler:
    def __init__(self, vocab_size: int, eog_ids: np.ndarray, choices: Mapping[SeqKey, Choice],
                 grammars: bool, clock: PhaseClock | None = None) -> None:
        self.choices = choices  # the output processor's, read here
        self.clock = clock or PhaseClock()
        self.eog = np.asarray(eog_ids, dtype=np.int64)
        self._masks = MaskComputer(vocab_size) if grammars else None
        self.vocab_size = vocab_size

    def sample(self, plan: StepPlan, logits: np.ndarray, failed: Mapping[str, Exception] | None = None) -> SampledStep:
        """Every chunk's prompt scores and its samplers' tokens (a drafted chunk's first row only: the rows after its
        guesses are sample_rows' once the tokens before them are taken). `failed`: requests that already failed this
        step (their image's encoding)."""
        out = SampledStep(failed=dict(failed or {}))
        rows = plan.rows()
        for chunk, last in zip(plan.chunks, rows):
            if chunk.all_logits:
                self._score_prompt(chunk, logits, last, out)
        keys = [key for chunk in plan.chunks for key in chunk.samplers]
        picks = [r for chunk, r in zip(plan.chunks, rows) for _ in chunk.samplers]
        self._draw(keys, picks, logits, out)
        for chunk in plan.chunks:
            drawn = out.drawn.get(chunk.seq)
            if chunk.drafted and drawn is not None:
                drawn.drafted = chunk.drafted
        return out

    def sample_rows(self, rows: list[tuple[SeqKey, int]], logits: np.ndarray) -> SampledStep:
        """Each sequence's row after a guess that held (logits row by key): its token, as the step it stands for
        would have drawn it."""
        out = SampledStep()
        self._draw([k for k, _ in rows], [r for _, r in rows], logits, out)
        for drawn in out.drawn.values():
            drawn.accepted = len(drawn.tokens)
        return out

    # -- the rows ---------------------------------------------------------------------------------
    def _ok(self, choice: Choice, out: SampledStep) -> bool:
        return choice.live and choice.request.request_id not in out.failed

    def _draw(self, keys: list[SeqKey], picks: list[int], logits: np.ndarray, out: SampledStep) -> None:
        """Process the rows (picks[i] is keys[i]'s), gather beam searches' rows, draw the plain ones' tokens."""
        pairs = [(self.choices[k], r) for k, r in zip(keys, picks) if self._ok(self.choices[k], out)]
        if not pairs:
            return
        choices = [c for c, _ in pairs]
        sources = [r for _, r in pairs]
        rows = _gather(logits, sources)
        self._process(rows, choices, out)
        plain: list[int] = []
        for i, choice in enumerate(choices):
            search = choice.request.beam
            if not self._ok(choice, out):
                continue
            if search is None:
                plain.append(i)
                continue
            # a beam step waits for every beam's row (beams that read in different steps)
            search.rows[choice.index] = rows[i].copy()
            if len(search.rows) == search.width:
                out.beams[choice.request.request_id] = np.stack([search.rows.pop(j) for j in range(search.width)])
        if not plain:
            return
        rows, choices = _only(rows, choices, plain)
        drawn = self._each(choices, out, lambda idx: [int(t) for t in pick_rows(
            rows if len(idx) == len(choices) else rows[idx], [choices[i].sampler for i in idx])])
        rows, choices = _only(rows, choices, [i for i, t in enumerate(drawn) if t is not None])
        tokens = [t for t in drawn if t is not None]
        want = [i for i, c in enumerate(choices) if c.request.group.params.wants_cumulative]
        entries: list[TokenLogprob | None] = [None] * len(choices)
        if want:
            with self.clock.phase("logprobs"):
                found = self._each([choices[i] for i in want], out, lambda idx: token_logprobs(
                    rows, [want[j] for j in idx], [tokens[want[j]] for j in idx],
                    [choices[want[j]].request.group.params.logprobs for j in idx]))
            for i, entry in zip(want, found):
                entries[i] = entry
        for choice, token, entry in zip(choices, tokens, entries):
            if self._ok(choice, out):
                mine = out.drawn.setdefault(choice.key, Drawn())
                mine.tokens.append(token)
                mine.entries.append(entry)

    def _process(self, rows: np.ndarray, choices: list[Choice], out: SampledStep) -> None:
        """logit_bias, penalties, banned tokens and masks over every row at once, else row by row (each redone from
        its logits as they came: the batched attempt may have half-processed it)."""
        undo: Undo = []
        try:
            process_rows(rows, [c.sampler for c in choices], self.eog, self.masks(choices), undo)
            return
        except Exception:
            log.warning("a batched sampling step raised; isolating the request at fault", exc_info=True)
        restore(rows, undo)
        for i, choice in enumerate(choices):
            try:
                process_rows(rows[i : i + 1], [choice.sampler], self.eog, self.masks([choice]))
            except Exception as exc:  # a bug or a pathological input in one request must not fail its neighbours
                self._fail(choice, exc, out)

    def _each(self, choices: list[Choice], out: SampledStep, fn: Callable[[list[int]], list[T]]) -> list[T | None]:
        """fn(indices) → one result per index, for every row at once; should that raise, row by row, so that only the
        requests whose own rows raise fail (their results None)."""
        try:
            return list(fn(list(range(len(choices)))))
        except Exception:
            log.warning("a batched sampling step raised; isolating the request at fault", exc_info=True)
        results: list[T | None] = []
        for i, choice in enumerate(choices):
            try:
                results.append(fn([i])[0])
            except Exception as exc:
                self._fail(choice, exc, out)
                results.append(None)
        return results

    @staticmethod
    def _fail(choice: Choice, exc: Exception, out: SampledStep) -> None:
        log.error("request %s failed in the engine; the others go on", choice.request.request_id, exc_info=exc)
        out.failed.setdefault(choice.request.request_id, exc)

    def masks(self, choices: list[Choice]) -> tuple[np.ndarray, np.ndarray] | None:
        """The allowed tokens of every masked row: a grammar's (computed in one call), or the one token a spent
        thinking budget writes next."""
        forced = {i: c.think.forced[0] for i, c in enumerate(choices) if c.think and c.think.forced}
        constrained = [i for i, c in enumerate(choices) if c.matcher is not None and i not in forced]
        grammar = None
        if constrained and self._masks is not None:
            matchers = [m for m in (choices[i].matcher for i in constrained) if m is not None]
            with self.clock.phase("grammar"):
                grammar = self._masks.allowed(matchers)
            for matcher, i in zip(matchers, constrained):
                if matcher.is_error():  # past llguidance's per-step limits: its request fails
                    raise constraint_failed(choices[i])
        if not forced:  # the common case: the grammar's rows as they are
            return (np.asarray(constrained), grammar) if grammar is not None else None
        rows = list(forced) + (constrained if grammar is not None else [])
        allowed = np.zeros((len(rows), self.vocab_size), dtype=bool)
        allowed[np.arange(len(forced)), list(forced.values())] = True
        if grammar is not None:
            allowed[len(forced):] = grammar
        return np.asarray(rows), allowed

    # -- prompt logprobs --------------------------------------------------------------------------
    def _score_prompt(self, chunk: ScheduledChunk, logits: np.ndarray, last: int, out: SampledStep) -> None:
        """A prompt chunk read for its logprobs: each row scores the prompt's next token (raw model)."""
        choice = self.choices[chunk.seq]
        request = choice.request
        if request.prompt_logprobs is None or not self._ok(choice, out):
            return
        prompt = request.group.prompt_token_ids
        k = request.group.params.prompt_logprobs or 0
        first = last - len(chunk.tokens) + 1
        positions = [chunk.start + j + 1 for j in range(len(chunk.tokens)) if chunk.start + j + 1 < len(prompt)]
        if not positions:
            return
        try:
            with self.clock.phase("logprobs"):
                logp = log_softmax(logits[first : first + len(positions)])
                out.prompt[chunk.seq] = [(pos, logprob_entry(logp[j], prompt[pos], k))
                                         for j, pos in enumerate(positions)]
        except Exception as exc:
            self._fail(choice, exc, out)


def _gather(logits: np.ndarray, sources: list[int]) -> np.ndarray:
    """The rows drawn from, processed in place: the logits' own when they are consecutive (no copy of a large
    vocabulary's rows; the runner's buffer, which no one reads after the draw), else a copy."""
    first = sources[0]
    if sources == list(range(first, first + len(sources))):
        return logits[first : first + len(sources)]
    return np.asarray(logits[np.asarray(sources)])


def _only(rows: np.ndarray, choices: list[Choice], keep: list[int]) -> tuple[np.ndarray, list[Choice]]:
    """The rows (and their choices) at `keep`: the same array when that is all of them (no copy of a step's rows)."""
    if len(keep) == len(choices):
        return rows, choices
    return rows[keep], [choices[i] for i in keep]
