"""Draft-free speculative decoding: drafts from a sequence's own history, and whether a draft is worth its rows.

A decoding sequence may read, beside its next token, a few tokens guessed from its prompt and output (prompt
lookup): the tokens that followed the latest earlier occurrence of its last n tokens (n = 4, 3, 2, then 1). The step
computes a logits row for each guess; the engine samples those rows one after another as if they were successive
steps, and keeps the guesses while the token it samples is the guess (engine/local.py). Rows read one chunk at a
time compute exactly what single rows compute (docs/exactness.md), and each sampled token takes its sequence's
one draw from its RNG, as without a draft: a greedy or seeded answer is the same with and without speculation,
and a sampled one keeps its distribution (the guess is kept with the probability the model gives it; otherwise
the token comes from the rest of the distribution: rejection sampling for a draft that is one token for sure).

Drafts come from the sequence's own tokens only, never another request's, so nothing of one request can show in
another's timing or cells.

Whether to draft, and how far: a step costs about `call_cost` (in rows' time: the runner's `call_cost_rows`) per
forward call plus one per row, and makes one token per decoding sequence. A draft of k tokens adds k rows (and
calls, when its longer chunk splits a run of one-token chunks: llama.cpp passes only equal-length chunks of
consecutive sequences together) and is expected to add alpha + alpha^2 + ... + alpha^k tokens, alpha being the
sequence's rate of kept guesses (a moving average over its verified positions). A sequence drafts the k that
makes the step's expected tokens per row-time highest, and only when that beats the step without it. A guess that
was not worth its row still teaches the rate: once the sequence's next token is known, the rate moves as it would
have had the guess been read (a shadow guess, which costs no row). So a sequence whose guesses fail stops drafting
and spends no more rows finding out whether they still fail, and one whose guesses start to hold (an answer that
begins to copy its prompt) starts drafting, under load too, where a draft pays only for a sequence whose guesses
nearly always hold. A new sequence starts at PRIOR, below what a row costs at one stream: its first guesses are
shadows.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from servelm.engine.plan import ScheduledChunk, StepPlan

NGRAMS = (4, 3, 2, 1)  # n-gram lengths looked up, longest first
MAX_DRAFT = 16  # guesses one sequence reads in a step at most
PRIOR = 0.35  # a new sequence's rate of kept guesses
LEARN = 0.15  # weight of one verified position (or shadow guess) in the moving rate
COST_CACHE = 4096  # step shapes whose cost is kept (a few steps' worth of drafting decisions); emptied when full
# all of a chunk its cost depends on: its slot, its length, its adapters, whether it is text, whether it reads again
Shape = tuple[int, int, tuple[tuple[str, float], ...], bool, bool]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A decoding sequence that may draft: its lookup state, its tokens, and how many more it may take (its
    max_tokens and the context window allow)."""

    drafter: Drafter
    history: Seq[int]
    room: int


@dataclass(eq=False, slots=True)
class Drafter:
    """One sequence's prompt-lookup index, and its rates of kept guesses: one for guesses after a match of two or
    more tokens, one for those after a single token's (a weaker guess, drafted mostly where it costs nothing)."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram → the position after its latest end
    upto: int = 0  # n-grams ending at positions up to here are indexed
    rates: list[float] = field(default_factory=lambda: [PRIOR, PRIOR])  # [after n >= 2, after n = 1]
    weak: bool = False  # whether the latest guess came from a single token's match
    shadowed: tuple[int, int, bool] | None = None  # a guess not drafted: (its position, its token, weak)

    @property
    def rate(self) -> float:
        return self.rates[self.weak]

    def propose(self, history: Seq[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of history's last n-gram (a shadow guess
        whose token has come since is learned from first)."""
        end = len(history)
        shadowed = self.shadowed
        if shadowed is not None and end > shadowed[0]:
            self.shadowed = None
            position, token, weak = shadowed
            held = history[position] == token
            self.rates[weak] = _learned(self.rates[weak], int(held), not held)
        index = self.index
        for e in range(self.upto + 1, end):  # every n-gram that ends before the last token's position
            for n in NGRAMS:
                if e >= n:
                    index[tuple(history[e - n : e])] = e
        self.upto = max(self.upto, end - 1)
        if end < 2 or (history[end - 1],) not in index:  # every n-gram indexed has its last token indexed alone
            return []
        for n in NGRAMS:
            if end > n:
                at = index.get(tuple(history[end - n :]))
                if at is not None:
                    self.weak = n == 1
                    draft = list(history[at : at + limit])
                    cut = next((i for i, t in enumerate(draft) if t < 0), len(draft))  # not an image's placeholder
                    return draft[:cut]
        return []

    def observe(self, kept: int, rejected: bool) -> None:
        """A verified draft: `kept` guesses held, and then one failed (rejected) or the sequence ended."""
        self.rates[self.weak] = _learned(self.rates[self.weak], kept, rejected)

    def shadow(self, history: Seq[int], guess: Seq[int]) -> None:
        """The guess `propose` made for history's next token was not drafted: learn from it once that token is known."""
        self.shadowed = (len(history), guess[0], self.weak) if guess else None


def _learned(rate: float, kept: int, rejected: bool) -> float:
    """The rate after `kept` guesses held and then, if `rejected`, one failed."""
    for _ in range(kept):
        rate += LEARN * (1.0 - rate)
    if rejected:
        rate -= LEARN * rate
    return rate


def expected_kept(rate: float, k: int) -> float:
    """Guesses kept in expectation out of k, each held with probability `rate` once the ones before it have."""
    return sum(rate**i for i in range(1, k + 1))


class Speculator:
    """Decides each step's drafts by the cost model above. `lone_row_from`: from this position on, a micro-batch that is
    a single row of a single sequence reads that sequence's previous position again beside it (the llama.cpp
    runner's way to keep such a row on its exact kernel), so it costs two rows, and a guess in that place costs
    hardly more than the re-read it replaces."""

    def __init__(self, call_cost_rows: float, lone_row_from: int | None = None) -> None:
        self.call_cost = call_cost_rows
        self.lone_row_from = lone_row_from
        self._costs: dict[tuple[Shape, ...], float] = {}  # cost() by the chunks' shapes

    def _rereads(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk's token, as a lone row, is read with its previous position (lone_row_from)."""
        return self.lone_row_from is not None and chunk.start >= self.lone_row_from and chunk.start > 0

    def cost(self, chunks: list[ScheduledChunk]) -> float:
        """What the decode chunks cost in rows' time: each micro-batch's own cost (a read of the weights), each
        token's row, and the row a lone row reads again. Kept by the step's shape (all it depends on): a step's
        drafting decisions ask for the same shapes again and again."""
        return self._cost_of(tuple(map(self._shape, chunks)), chunks)

    def _shape(self, chunk: ScheduledChunk) -> Shape:
        return (chunk.slot, len(chunk.tokens), chunk.adapters, chunk.media is None, self._rereads(chunk))

    def _cost_of(self, shape: tuple[Shape, ...], chunks: list[ScheduledChunk], at: int | None = None,
                 guess: Seq[int] = ()) -> float:
        """cost() of the chunks by their `shape`, with chunk `at` (if any) drafted `guess`: only computed when no
        step has had that shape yet."""
        cost = self._costs.get(shape)
        if cost is None:
            if len(self._costs) >= COST_CACHE:
                self._costs.clear()
            if at is not None:
                chunks = [*chunks[:at], _drafted(chunks[at], guess), *chunks[at + 1 :]]
            cost = self._costs[shape] = self._cost(chunks)
        return cost

    def _cost(self, chunks: list[ScheduledChunk]) -> float:
        plan = StepPlan(chunks)
        micro = [m for call in plan.calls() for m in plan.micro_batches(call)]
        total = len(micro) * self.call_cost + sum(len(c.tokens) for c in chunks)
        for m in micro:
            if len(m) == 1 and len(chunks[m[0][0]].tokens) == 1 and self._rereads(chunks[m[0][0]]):
                total += 1
        return total

    def draft(self, plan: StepPlan, budget: int, max_rows: int, candidates: Mapping[int, Candidate]) -> int:
        """Turn some of the plan's decode chunks (one token each, the plan's only chunks yet) into drafted ones:
        those of `candidates` (by chunk index), within `budget` step tokens and `max_rows` a chunk; returns the
        tokens added."""
        chunks = plan.chunks
        offers: list[tuple[float, int, list[int]]] = []
        for i, candidate in candidates.items():
            limit = min(MAX_DRAFT, max_rows - 1, candidate.room, budget)
            guess = candidate.drafter.propose(candidate.history, limit) if limit > 0 else []
            candidate.drafter.shadow(candidate.history, guess)  # until it is drafted below
            if guess:
                offers.append((candidate.drafter.rate, i, guess))
        if not offers:
            return 0
        made = float(len(chunks))  # the step's expected tokens, and its cost in rows' time
        shapes = list(map(self._shape, chunks))
        cost = self._cost_of(tuple(shapes), chunks)
        added = 0
        for rate, i, guess in sorted(offers, key=lambda o: -o[0]):
            guess = guess[: budget - added]
            if not guess:
                continue
            # the first guess's cost (a row, and the calls a longer chunk splits off, or nothing in place of a lone
            # row's re-read); each further guess is a row more. Its shape is the step's with chunk i a token longer.
            slot, length, adapters, text, rereads = shapes[i]
            longer = (*shapes[:i], (slot, length + 1, adapters, text, rereads), *shapes[i + 1 :])
            first = self._cost_of(longer, chunks, i, guess[:1]) - cost
            best_k, best_kept = _best_draft(made, cost + first - 1, made / cost, rate, len(guess))
            if not best_k:
                continue
            candidates[i].drafter.shadowed = None  # read: its verification teaches the rate
            chunks[i] = _drafted(chunks[i], guess[:best_k])
            shapes[i] = self._shape(chunks[i])
            made += best_kept
            cost = self._cost_of(tuple(shapes), chunks)
            added += best_k
        return added


def _best_draft(made: float, base: float, best: float, rate: float, longest: int) -> tuple[int, float]:
    """The draft length k (0: none) that makes (made + expected_kept(rate, k)) / (base + k) highest, if above `best`,
    and its expected_kept. The sum grows a term a guess, each smaller than the one before, while the cost grows a
    row: once a guess lowers the ratio, every longer draft lowers it more (the ratio after it lies between the ratio
    before and that guess's term, which the next term is below), so the search stops there."""
    best_k, best_kept = 0, 0.0
    kept = 0.0
    previous = None
    for k in range(1, longest + 1):
        kept += rate**k  # expected_kept(rate, k), the same sum in the same order
        value = (made + kept) / (base + k)
        if previous is not None and value <= previous:
            break
        previous = value
        if value > best:
            best, best_k, best_kept = value, k, kept
    return best_k, best_kept


def _drafted(chunk: ScheduledChunk, guess: Seq[int]) -> ScheduledChunk:
    return replace(chunk, tokens=(*chunk.tokens, *guess), drafted=len(guess))

